"""What every `ravnest-node bench SUITE` command (codecs, replicas, replan) runs with."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.options import TransportConfig


@dataclass(frozen=True, slots=True)
class Suite:
    """A suite's settings, from `bench`'s own (BenchConfig)."""

    train: TrainConfig
    """The training run the suite starts from (each suite shrinks or varies it)."""
    jsonl: Path
    """Where its records go, one JSON object per line."""
    work_dir: Path
    """Where its swarms keep their state and logs."""
    quick: bool = False
    """Fewer and shorter runs."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """The swarms' transport: --swarm-dir protects them."""
    out: TextIO = field(default=sys.stdout)
    """Where the tables are printed."""
