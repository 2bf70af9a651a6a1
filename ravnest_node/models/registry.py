"""The models a swarm can train by name: the built-in presets, models registered in this
process, models that installed packages declare (installed.py), and pretrained ``hf:DIR,...``
directories.

Above every model module (base, bytelm, pretrained), so that none of them imports another to
be found: `get_model` is the one place a name becomes a model.
"""

from __future__ import annotations

from collections.abc import Callable

from ravnest_node.errors import ConfigError
from ravnest_node.models.base import BlockModel
from ravnest_node.models.bytelm import PRESETS, ByteLM, ByteLMConfig
from ravnest_node.models.installed import ENTRY_POINT_GROUP, Installed, InstalledModels
from ravnest_node.models.llama_bench import LLAMA_300M, LlamaBench
from ravnest_node.models.pretrained import PretrainedModel
from ravnest_node.models.subspace import SubspaceLM

__all__ = [
    "INSTALLED",
    "MODEL_PRESETS",
    "get_model",
    "hidden_models",
    "installed_models",
    "model_names",
    "register_model",
]

MODEL_PRESETS: dict[str, Callable[[], BlockModel]] = {}
"""Registry: model name -> zero-argument factory. Filled by `register_model`; the built-in presets
are registered when `ravnest_node.models` is imported."""

INSTALLED = InstalledModels()
"""The models installed packages declare (entry points of ``ravnest_node.models``)."""


def register_model(name: str, factory: Callable[[], BlockModel]) -> None:
    """Add a preset to `MODEL_PRESETS`; raises `ValueError` if `name` is already taken."""
    if name in MODEL_PRESETS:
        raise ValueError(f"model name {name!r} is already registered")
    MODEL_PRESETS[name] = factory


def installed_models() -> dict[str, Installed]:
    """The models installed packages declare, by name, less those a built-in name hides."""
    return INSTALLED.found(MODEL_PRESETS)


def hidden_models() -> dict[str, Installed]:
    """The models installed packages declare under a built-in name, which wins, by name."""
    return INSTALLED.hidden(MODEL_PRESETS)


def model_names() -> list[str]:
    """The names of the built-in and registered models and of the installed ones, sorted."""
    return sorted({*MODEL_PRESETS, *installed_models()})


def get_model(name: str) -> BlockModel:
    """A fresh instance of the preset `name`, of the model an installed package declares
    under that name (a built-in name wins), or of the pretrained model an ``hf:DIR,...`` name
    describes. ConfigError if no model has that name, if its package's entry point is broken
    (installed.py), or if the directory is unusable."""
    if name.startswith("hf:"):  # a pretrained model directory (models/pretrained/)
        return PretrainedModel(name)
    factory = MODEL_PRESETS.get(name)
    if factory is not None:
        return factory()
    model = INSTALLED.build(name, MODEL_PRESETS)
    if model is None:
        raise ConfigError(
            f"unknown model {name!r}; choose one of: {', '.join(model_names())}; or install "
            f"the package that declares it (entry-point group {ENTRY_POINT_GROUP})"
        )
    return model


def _preset(cfg: ByteLMConfig, name: str) -> Callable[[], BlockModel]:
    def factory() -> BlockModel:
        return ByteLM(cfg, name=name)

    return factory


def _subspace(cfg: ByteLMConfig, name: str) -> Callable[[], BlockModel]:
    def factory() -> BlockModel:
        return SubspaceLM(cfg, name=name)

    return factory


for _name, _cfg in PRESETS.items():
    register_model(_name, _preset(_cfg, _name))
    # The same shape with its residual stream confined to a subspace (models/subspace.py).
    register_model(f"{_name}-subspace", _subspace(_cfg, f"{_name}-subspace"))
register_model("llama-300m", lambda: LlamaBench(LLAMA_300M, name="llama-300m"))  # GPU benchmark
