"""What a `ravnest-node bench` run is: its settings (BenchConfig), the systems it compares, and
the shape of the swarm every system runs on."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ravnest_node.bench.links import SCENARIOS
from ravnest_node.devices import resolve_device
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.options import TransportConfig

SYSTEMS = ("compute-bound", "naive", "ours", "torch-pipelining", "hivemind", "ours-tls")
DEFAULT_SYSTEMS = SYSTEMS[:5]
"""`ours-tls` (ours in a protected swarm: mutual TLS and the TLS gate) runs when asked for."""
QUICK_STEPS = 10
NODES = 3


@dataclass(kw_only=True, frozen=True, slots=True)
class BenchConfig:
    """A benchmark run: scenarios x systems."""

    scenario: Literal["lan", "home", "internet", "mobile", "all"] = "home"
    """Link to emulate: lan (1000 Mbit/s, 1 ms), home (50, 20), internet (10, 50), mobile (2,
    80), or all. On links under 5 Mbit/s naive runs a few steps and its full run is estimated
    from them, and torch-pipelining is skipped."""
    gpu_like: float = 1.0
    """Emulate compute this many times faster relative to the link (>= 1; 1: off): every
    link's rate is divided by it and its delay multiplied by it, compute stays this machine's.
    The ratios to compute-bound are then those of a node that much faster on the real link."""
    quick: bool = False
    """Shrink the run to 10 steps per system (about a minute per scenario); `bench codecs`
    also trains fewer codecs."""
    rounds: int = 1
    """Run all scenarios this many times in turn (each record says its `round`): ours against
    compute-bound is then also told as the median and range over rounds, each round's systems
    side by side (these machines move 10-15% between runs; one round cannot settle a 5% or a
    1.5% question)."""
    held_out: int = 256
    """Held-out samples each run's final model is evaluated on once the run has ended (from its
    nodes' last checkpoints, in the bench's process: no time or bytes of the run;
    bench/held_out.py): the record's `held_out_loss`, compared at equal samples with
    compute-bound's (`held_out_gap`), where a run's training loss is one batch's. 0: none."""
    jsonl: Path = Path("bench.jsonl")
    """Where to write one JSON object per run; the table (.md) and plot (.png) go beside it."""
    systems: str = ",".join(DEFAULT_SYSTEMS)
    """Comma-separated systems to run: compute-bound, naive, ours, torch-pipelining, hivemind.

    Also `ours-tls`, ours in a protected swarm (mutual TLS through the TLS gate), not run unless
    named."""
    emulation: Literal["auto", "netns", "relay"] = "auto"
    """netns: namespaces, tbf, delay relays (root); relay: loopback relays; auto: netns if root."""
    work_dir: Path | None = None
    """Where node state and logs go (default: a new temporary directory)."""
    compute_threads: int = field(default=1, metadata={"flag": "--threads"})
    """Torch threads per node process."""
    device: str = "auto"
    """The device every node process and the compute-bound baseline compute on (their
    --device): auto, cpu, cuda, cuda:N or mps. The nodes of a run share it, as they share the
    CPU's cores without one. The torch-pipelining baseline runs on the CPU only (gloo)."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=40))
    """The training run every system performs (steps: 10 with --quick)."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Limits and timeouts of the gRPC transport."""

    def __post_init__(self) -> None:
        unknown = set(self.system_list) - set(SYSTEMS)
        if unknown or not self.system_list:
            raise ConfigError(
                f"systems={self.systems!r}: choose from {', '.join(SYSTEMS)} (comma-separated)"
            )
        if get_model(self.train.model).num_blocks() < NODES:
            raise ConfigError(f"model {self.train.model} has fewer than {NODES} blocks")
        if not self.gpu_like >= 1:
            raise ConfigError(f"gpu_like={self.gpu_like}: must be >= 1 (1: off)")
        if not 1 <= self.rounds <= 100:
            raise ConfigError(f"rounds={self.rounds}: must be 1 to 100")
        if not 0 <= self.held_out <= 100_000:
            raise ConfigError(f"held_out={self.held_out}: must be 0 to 100000")
        if self.compute_threads < 1:
            raise ConfigError("compute_threads must be at least 1")
        resolve_device(self.device)  # ConfigError naming the choices, before anything starts

    @property
    def system_list(self) -> list[str]:
        return [s.strip() for s in self.systems.split(",") if s.strip()]

    @property
    def scenario_names(self) -> list[str]:
        return list(SCENARIOS) if self.scenario == "all" else [self.scenario]

    @property
    def run_train(self) -> TrainConfig:
        return dataclasses.replace(self.train, steps=QUICK_STEPS) if self.quick else self.train


def cores() -> int:
    """This machine's cores: what the compute-bound ceiling runs with."""
    return os.cpu_count() or 1
