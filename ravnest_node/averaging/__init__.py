"""Replica averaging: the members of a replica group average their parameters DiLoCo-style.

Nodes that own the same stage in different pipelines form a replica group. Every H optimizer
steps each member computes its delta (`OuterOptimizer.begin_round`), averages it with the
group's over gRPC in the background (`ReplicaAverager.average`), and applies the Nesterov outer
step to the mean while keeping the steps it took meanwhile (`OuterOptimizer.apply`). See
docs/averaging.md.
"""

from ravnest_node.averaging.config import DELTA_CODECS, AveragingConfig, delta_codec
from ravnest_node.averaging.exchange import ReplicaAverager
from ravnest_node.averaging.outer import OuterOptimizer
from ravnest_node.averaging.robust import BanList, Screening, screen_norms
from ravnest_node.averaging.rounds import RoundResult
from ravnest_node.averaging.topology import Topology, choose_topology, round_payload_bytes
from ravnest_node.averaging.wire import AveragingService, Replica

__all__ = [
    "DELTA_CODECS",
    "AveragingConfig",
    "AveragingService",
    "BanList",
    "OuterOptimizer",
    "Replica",
    "ReplicaAverager",
    "RoundResult",
    "Screening",
    "Topology",
    "choose_topology",
    "delta_codec",
    "round_payload_bytes",
    "screen_norms",
]
