"""Models that installed packages declare: the entry points of the group ``ravnest_node.models``.

A package that brings its own model declares, in its pyproject.toml,

    [project.entry-points."ravnest_node.models"]
    tiny-mlp = "ravnest_tiny_mlp.model:make_model"

(name = the model name, value = a callable taking no arguments that returns a `BlockModel`).
Every node builds the model from its own installation: the coordinator names a model, it
never ships code (docs/development.md, "Your own model"). Entry points are found once, on the
first lookup of a name that is not built in, and each one is imported only when its name is
asked for; what that import runs is the installed package's code, which the node's owner
installed on purpose.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points

from ravnest_node.errors import ConfigError
from ravnest_node.models.base import BlockModel

__all__ = ["ENTRY_POINT_GROUP", "Installed", "InstalledModels", "is_project_name", "lacking_model"]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ravnest_node.models"
"""The entry-point group a package declares its models under."""


@dataclass(frozen=True, slots=True)
class Installed:
    """One model an installed package declares: where it comes from, for messages and for
    `ravnest-node models`."""

    name: str
    """The model name (the entry point's name)."""
    value: str
    """What the entry point points at, ``package.module:factory``."""
    distribution: str
    """The distribution that declares it, with its version, e.g. ``ravnest-tiny-mlp 0.1.0``;
    the project name alone is `project`."""
    project: str
    """The distribution's name, what `pip install` takes (empty if unknown)."""

    @property
    def origin(self) -> str:
        """E.g. ``ravnest-tiny-mlp 0.1.0 (ravnest_tiny_mlp.model:make_model)``."""
        return f"{self.distribution} ({self.value})"


_PROJECT_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?")


def is_project_name(text: str) -> bool:
    """Whether `text` is a distribution name as PEP 508 allows one (at most 100 characters):
    the coordinator's `model_package` comes from the network and is quoted in a message only
    if it is one."""
    return _PROJECT_NAME.fullmatch(text) is not None


def lacking_model(name: str, project: str) -> str:
    """What a node that lacks the swarm's model `name`, which the distribution `project`
    provides on the coordinator, says: the node refuses to join rather than train without it."""
    return (
        f"the swarm trains model {name!r}, which the package {project!r} provides; it is not "
        f"installed on this node: install it here too (`pip install {project}`, or "
        f"`pip install -e DIR` of its source) and start the node again"
    )


def _describe(ep: EntryPoint) -> Installed:
    dist = ep.dist
    project = dist.name if dist is not None else ""
    version = f" {dist.version}" if dist is not None else ""
    return Installed(ep.name, ep.value, f"{project or 'an unknown distribution'}{version}", project)


class InstalledModels:
    """The models installed packages declare, found once (thread-safe: nodes look models up
    from their event loop and their compute threads), each factory imported once."""

    def __init__(self, find: Callable[[], Collection[EntryPoint]] | None = None) -> None:
        """`find`: the entry points of `ENTRY_POINT_GROUP` (default: importlib.metadata's, of
        the packages on sys.path when first asked)."""
        self._find = find or (lambda: entry_points(group=ENTRY_POINT_GROUP))
        self._lock = threading.Lock()
        self._found: dict[str, tuple[EntryPoint, Installed]] | None = None
        self._factories: dict[str, Callable[[], object]] = {}

    def reset(self) -> None:
        """Forget what was found and loaded: the next lookup looks again (for tests, which
        install a package into a process that has already looked)."""
        with self._lock:
            self._found = None
            self._factories.clear()

    def found(self, builtin: Collection[str]) -> dict[str, Installed]:
        """The installed models by name, without those a built-in name (`builtin`) hides; the
        first time, a warning for each hidden one and each name two packages declare."""
        return {n: info for n, info in self._all(builtin).items() if n not in builtin}

    def hidden(self, builtin: Collection[str]) -> dict[str, Installed]:
        """The installed models that a built-in name hides, by name."""
        return {n: info for n, info in self._all(builtin).items() if n in builtin}

    def _all(self, builtin: Collection[str]) -> dict[str, Installed]:
        with self._lock:
            if self._found is None:
                self._found = self._scan(builtin)
            return {name: info for name, (_, info) in self._found.items()}

    def _scan(self, builtin: Collection[str]) -> dict[str, tuple[EntryPoint, Installed]]:
        found: dict[str, tuple[EntryPoint, Installed]] = {}
        for ep in sorted(self._find(), key=lambda e: (e.name, e.value)):
            info = _describe(ep)
            if ep.name in found:
                log.warning("model %r of %s is ignored: %s declares it too", ep.name,
                            info.origin, found[ep.name][1].origin)  # fmt: skip
                continue
            if ep.name in builtin:
                log.warning("model %r of %s is ignored: a built-in model has that name",
                            ep.name, info.origin)  # fmt: skip
            found[ep.name] = (ep, info)
        return found

    def build(self, name: str, builtin: Collection[str]) -> BlockModel | None:
        """A fresh instance of the installed model `name`, None if no package declares it.
        ConfigError naming the entry point if it cannot be imported, its factory raises, or
        it returns something that is not a `BlockModel` named `name`."""
        info = self.found(builtin).get(name)
        if info is None:
            return None
        with self._lock:
            assert self._found is not None
            ep = self._found[name][0]
            factory = self._factories.get(name)
            if factory is None:
                try:
                    factory = ep.load()
                except Exception as exc:  # the package's import: any error is its own
                    raise ConfigError(
                        f"model {name!r}: cannot import entry point {info.origin}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                if not callable(factory):
                    raise ConfigError(
                        f"model {name!r}: entry point {info.origin} is a "
                        f"{type(factory).__name__}, not a callable that returns a BlockModel"
                    )
                self._factories[name] = factory
        try:
            model = factory()
        except Exception as exc:  # the package's factory: any error is its own
            raise ConfigError(
                f"model {name!r}: entry point {info.origin} raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(model, BlockModel):
            raise ConfigError(
                f"model {name!r}: entry point {info.origin} returned a "
                f"{type(model).__name__}, not a ravnest_node.models.BlockModel"
            )
        if model.name != name:  # summaries, checkpoints and plans name it by its entry point
            raise ConfigError(
                f"model {name!r}: entry point {info.origin} returned a model named "
                f"{model.name!r}; its name must be the entry point's, {name!r}"
            )
        return model
