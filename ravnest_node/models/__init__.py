"""Models as ordered lists of blocks (the contract in `base`), and the registry of presets."""

from ravnest_node.models.base import BlockModel, TensorSpec, run_blocks
from ravnest_node.models.bytelm import ByteLM, ByteLMConfig
from ravnest_node.models.installed import is_project_name, lacking_model
from ravnest_node.models.registry import (
    MODEL_PRESETS,
    get_model,
    installed_models,
    model_names,
    register_model,
)

__all__ = [
    "MODEL_PRESETS",
    "BlockModel",
    "ByteLM",
    "ByteLMConfig",
    "TensorSpec",
    "get_model",
    "installed_models",
    "is_project_name",
    "lacking_model",
    "model_names",
    "register_model",
    "run_blocks",
]
