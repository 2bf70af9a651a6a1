"""ravnest-node: a peer-to-peer training daemon for models no single machine here can train.

The public API: configs, the node daemon, the block contract for models, and the errors. The
names load on first use (PEP 562), so that importing one module of the package (a codec, say)
imports only what that module needs, not the daemon and gRPC.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ravnest_node.version import __version__

if TYPE_CHECKING:
    from ravnest_node.daemon.config import NodeConfig
    from ravnest_node.daemon.node import NodeDaemon, NodeInfo
    from ravnest_node.errors import (
        ConfigError,
        FrameError,
        PeerError,
        PeerRefused,
        PeerUnavailable,
        RavnestError,
        RunFailed,
        StartupError,
        Unreachable,
    )
    from ravnest_node.models import BlockModel, TensorSpec, get_model, model_names
    from ravnest_node.pipeline.run import TrainConfig
    from ravnest_node.transport.options import TransportConfig

_WHERE = {
    "NodeConfig": "ravnest_node.daemon.config",
    "NodeDaemon": "ravnest_node.daemon.node",
    "NodeInfo": "ravnest_node.daemon.node",
    "ConfigError": "ravnest_node.errors",
    "FrameError": "ravnest_node.errors",
    "PeerError": "ravnest_node.errors",
    "PeerRefused": "ravnest_node.errors",
    "PeerUnavailable": "ravnest_node.errors",
    "RavnestError": "ravnest_node.errors",
    "RunFailed": "ravnest_node.errors",
    "StartupError": "ravnest_node.errors",
    "Unreachable": "ravnest_node.errors",
    "BlockModel": "ravnest_node.models",
    "TensorSpec": "ravnest_node.models",
    "get_model": "ravnest_node.models",
    "model_names": "ravnest_node.models",
    "TrainConfig": "ravnest_node.pipeline.run",
    "TransportConfig": "ravnest_node.transport.options",
}

__all__ = [
    "BlockModel",
    "ConfigError",
    "FrameError",
    "NodeConfig",
    "NodeDaemon",
    "NodeInfo",
    "PeerError",
    "PeerRefused",
    "PeerUnavailable",
    "RavnestError",
    "RunFailed",
    "StartupError",
    "TensorSpec",
    "TrainConfig",
    "TransportConfig",
    "Unreachable",
    "__version__",
    "get_model",
    "model_names",
]


def __getattr__(name: str) -> Any:
    """Load a public name from its module the first time it is asked for."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ravnest_node' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
