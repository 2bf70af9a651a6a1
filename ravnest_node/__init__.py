"""ravnest-node: a peer-to-peer training daemon for models no single machine here can train.

The public API: configs, the node daemon, the block contract for models, and the errors.
"""

__version__ = "0.1.0"

from ravnest_node.daemon.node import NodeConfig, NodeDaemon, NodeInfo
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
