"""The `torch-pipelining` baseline: PyTorch's own pipeline parallelism on our workload.

One process per rank, started by the benchmark harness (`command` builds its argv)::

    python -m ravnest_node.bench.torch_pipe --rank R --world-size N --master HOST:PORT \\
        --model bench-small --steps S --batch-size 16 --microbatches 4 --out PATH

Rank R trains stage R of ``partition(model.block_costs(), N)`` with
`torch.distributed.pipelining` (``Schedule1F1B`` or ``ScheduleGPipe``) over a gloo process
group, with the same model, data, seed and optimizer as our own pipeline, so that the two loss
histories agree and only the time and bytes differ. Gradient scaling: the loss function returns
each microbatch's mean loss and the schedule (``scale_grads=True``) divides the accumulated
gradients by the number of microbatches after the last backward, which is the gradient of the
mean microbatch loss, as our stages compute with ``loss / microbatches`` per microbatch.

Each rank appends one JSON line per step to its ``--out`` file::

    {"rank": R, "step": k, "t": seconds since the start barrier, "loss": float | null,
     "tx_bytes": int | null}

``step`` counts optimizer steps applied (1..S); ``loss`` is the mean microbatch loss, on the last
rank only; ``tx_bytes`` is what the host sent on ``--ifname`` since the start barrier (the
interface counter, so it includes TCP/IP headers and anything else the host sent). At the end a
rank prints ``{"event": "done", "rank", "steps", "wall_s", "tx_bytes"}`` on stdout and exits 0;
on failure it prints one line on stderr and exits 1. `read_results` merges the ranks' files.

gloo picks its network interface from ``GLOO_SOCKET_IFNAME``; the harness sets it when ranks run
in network namespaces. If it is unset and ``--ifname`` is given, that interface is used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from ravnest_node.coordination.planning.planner import partition
from ravnest_node.data import StdlibBytes
from ravnest_node.errors import ConfigError
from ravnest_node.models import BlockModel, get_model
from ravnest_node.pipeline.run import TrainConfig

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

__all__ = [
    "SCHEDULES",
    "RankConfig",
    "build_schedule",
    "command",
    "main",
    "read_results",
    "run_rank",
]

ScheduleName = Literal["1f1b", "gpipe"]
SCHEDULES: tuple[ScheduleName, ...] = ("1f1b", "gpipe")
"""Pipeline schedules this baseline runs."""

_MODULE = "ravnest_node.bench.torch_pipe"


@dataclass(kw_only=True, frozen=True, slots=True)
class RankConfig:
    """What one rank of the baseline runs."""

    rank: int
    """This process's rank, which is also the index of the stage it trains."""
    world_size: int
    """Number of ranks, which is also the number of pipeline stages."""
    master: str
    """HOST:PORT of rank 0's TCP rendezvous store (rank 0 listens there)."""
    train: TrainConfig
    """Model, steps, batch, microbatches, lr, weight decay and seed, as our own pipeline uses."""
    threads: int = 1
    """Torch intra-op threads of this process."""
    out: Path
    """JSONL file to append one line per step to."""
    ifname: str | None = None
    """Network interface whose tx byte counter to report (None: report null)."""
    schedule: ScheduleName = "1f1b"
    """Pipeline schedule."""
    timeout_s: float = 300.0
    """gloo timeout for the rendezvous and for every send or receive, in seconds."""

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ConfigError(f"world_size={self.world_size}: a pipeline needs at least 2 ranks")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank={self.rank}: must be in 0..{self.world_size - 1}")
        blocks = get_model(self.train.model).num_blocks()
        if self.world_size > blocks:
            raise ConfigError(
                f"world_size={self.world_size}: {self.train.model!r} has only {blocks} blocks, "
                f"so at most {blocks} stages"
            )
        host, sep, port = self.master.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"master={self.master!r}: expected HOST:PORT, e.g. 127.0.0.1:29500")
        if self.threads < 1:
            raise ConfigError(f"threads={self.threads}: must be at least 1")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule={self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.schedule == "1f1b" and self.train.microbatches < self.world_size:
            raise ConfigError(
                f"microbatches={self.train.microbatches}: Schedule1F1B needs at least as many "
                f"microbatches as stages ({self.world_size}); use more or --schedule gpipe"
            )
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s={self.timeout_s}: must be positive")
        if self.ifname is not None and not _tx_path(self.ifname).exists():
            raise ConfigError(
                f"ifname={self.ifname!r}: no {_tx_path(self.ifname)}; choose one of "
                f"{', '.join(sorted(p.name for p in Path('/sys/class/net').glob('*')))}"
            )


def command(
    rank: int,
    world_size: int,
    master: str,
    *,
    model: str,
    steps: int,
    batch_size: int,
    microbatches: int,
    lr: float,
    seed: int,
    threads: int,
    out: Path | str,
    ifname: str | None = None,
    schedule: ScheduleName = "1f1b",
) -> list[str]:
    """The argv that runs rank `rank` of the baseline in a process of its own."""
    argv = [
        sys.executable,
        "-m",
        _MODULE,
        "--rank", str(rank),
        "--world-size", str(world_size),
        "--master", master,
        "--model", model,
        "--steps", str(steps),
        "--batch-size", str(batch_size),
        "--microbatches", str(microbatches),
        "--lr", repr(lr),
        "--seed", str(seed),
        "--threads", str(threads),
        "--out", str(out),
        "--schedule", schedule,
    ]  # fmt: skip
    if ifname is not None:
        argv += ["--ifname", ifname]
    return argv


def read_results(out_paths: Sequence[Path]) -> dict[str, Any]:
    """Merge the per-rank JSONL files of one run into per-step histories.

    Returns ``{"loss_history": [...], "t_history": [...], "tx_bytes_history": [...] | None,
    "wall_s": float}``: the last rank's loss per step; per step the latest time over ranks (the
    step is done when every rank is done with it); per step the tx bytes summed over ranks (None
    if any rank reported none; the sum counts a shared interface once per rank on it); and the
    latest time over ranks of the last step. Raises ValueError if the files are not all of one
    complete run (a rank missing steps, no loss, an empty file).
    """
    if not out_paths:
        raise ValueError("no result files given")
    per_rank: list[list[dict[str, Any]]] = []
    for path in out_paths:
        lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{path}: no steps recorded")
        steps = [line["step"] for line in lines]
        if steps != list(range(1, len(steps) + 1)):
            raise ValueError(f"{path}: steps {steps} are not 1..{len(steps)} in order")
        per_rank.append(lines)
    num_steps = max(len(lines) for lines in per_rank)
    for path, lines in zip(out_paths, per_rank, strict=True):
        if len(lines) != num_steps:
            raise ValueError(f"{path}: {len(lines)} steps, but another rank has {num_steps}")
    with_loss = [lines for lines in per_rank if lines[0]["loss"] is not None]
    if len(with_loss) != 1:
        raise ValueError(f"expected exactly one rank with losses, found {len(with_loss)}")
    loss_history = [float(line["loss"]) for line in with_loss[0]]
    t_history = [max(float(lines[i]["t"]) for lines in per_rank) for i in range(num_steps)]
    tx_bytes_history: list[int] | None = None
    if all(line["tx_bytes"] is not None for lines in per_rank for line in lines):
        tx_bytes_history = [
            sum(int(lines[i]["tx_bytes"]) for lines in per_rank) for i in range(num_steps)
        ]
    return {
        "loss_history": loss_history,
        "t_history": t_history,
        "tx_bytes_history": tx_bytes_history,
        "wall_s": t_history[-1],
    }


def run_rank(config: RankConfig) -> dict[str, Any]:
    """Train this rank's stage for the run's steps; returns the summary (without "event").

    Blocks until every step is done; needs the other ranks running. Raises whatever torch or
    gloo raises (a peer gone, a timeout).
    """
    train = config.train
    torch.set_num_threads(config.threads)
    if config.ifname is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", config.ifname)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{config.master}",
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.timeout_s),
    )
    try:
        return _train(config, train)
    finally:
        dist.destroy_process_group()


def build_schedule(
    model: BlockModel, train: TrainConfig, rank: int, world_size: int, schedule: ScheduleName
) -> tuple[torch.nn.Sequential, PipelineScheduleSingle]:
    """Stage `rank` of `world_size` (its blocks of ``partition``) and the schedule that trains
    it, on the default process group, which must be initialised.

    The loss function returns each microbatch's mean loss, and the schedule
    (``scale_grads=True``) divides the accumulated gradients by the number of microbatches after
    the last backward: the gradient of the mean microbatch loss, as our stages compute it.
    """
    # Imported here: torch.distributed.pipelining pulls in torch._dynamo (about a second), and
    # every `ravnest-node` process imports this module (the bench command's parser).
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if model.carries_tokens:  # (torch's stages chain one tensor; ours carry the ids too)
        raise ConfigError(f"the torch baseline cannot run {model.name}: it carries token ids")
    start, stop = partition(model.block_costs(), world_size)[rank]
    module = torch.nn.Sequential(*model.build_stage(train.seed, start, stop))
    mb = train.microbatch_size
    # Example microbatch tensors, so that the stage needs no shape inference at run time. Their
    # requires_grad is metadata too: it says which tensors carry a gradient back.
    in_spec = model.input_spec(mb) if start == 0 else model.output_spec(start - 1, mb)
    out_spec = model.output_spec(stop - 1, mb)
    example_in = torch.zeros(in_spec.shape, dtype=in_spec.dtype, requires_grad=start > 0)
    example_out = torch.zeros(out_spec.shape, dtype=out_spec.dtype, requires_grad=True)
    stage = PipelineStage(
        module,
        rank,
        world_size,
        device=torch.device("cpu"),
        input_args=example_in,
        output_args=example_out,
    )
    schedule_cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    runner = schedule_cls(
        stage, n_microbatches=train.microbatches, loss_fn=model.loss, scale_grads=True
    )
    return module, runner


def _train(config: RankConfig, train: TrainConfig) -> dict[str, Any]:
    rank, n = config.rank, config.world_size
    model = get_model(train.model)
    module, schedule = build_schedule(model, train, rank, n, config.schedule)
    optimizer = torch.optim.AdamW(module.parameters(), lr=train.lr, weight_decay=train.weight_decay)
    is_first, is_last = rank == 0, rank == n - 1
    data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=train.seed)

    dist.barrier()
    t0 = time.perf_counter()
    tx0 = _tx_bytes(config.ifname)
    wall_s = 0.0
    tx_sent: int | None = None
    with config.out.open("a", encoding="utf-8") as out:
        for step in range(train.steps):
            losses: list[torch.Tensor] = []
            x, y = data.batch(step, train.batch_size)  # cheap; only the ends use it
            if is_first:
                schedule.step(x, return_outputs=False)
            elif is_last:
                schedule.step(target=y, losses=losses, return_outputs=False)
            else:
                schedule.step(return_outputs=False)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            wall_s = time.perf_counter() - t0
            tx_now = _tx_bytes(config.ifname)
            tx_sent = None if tx_now is None or tx0 is None else tx_now - tx0
            loss = math.fsum(v.item() for v in losses) / len(losses) if is_last else None
            record = {
                "rank": rank,
                "step": step + 1,
                "t": wall_s,
                "loss": loss,
                "tx_bytes": tx_sent,
            }
            out.write(json.dumps(record) + "\n")
            out.flush()
    return {"rank": rank, "steps": train.steps, "wall_s": wall_s, "tx_bytes": tx_sent}


def _tx_path(ifname: str) -> Path:
    return Path("/sys/class/net") / ifname / "statistics" / "tx_bytes"


def _tx_bytes(ifname: str | None) -> int | None:
    """Bytes the host has sent on `ifname` (None if no interface is given)."""
    if ifname is None:
        return None
    return int(_tx_path(ifname).read_text())


def _parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    p = argparse.ArgumentParser(
        prog=f"python -m {_MODULE}",
        description="One rank of the torch.distributed.pipelining baseline (gloo, CPU).",
    )
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's rendezvous")
    p.add_argument("--model", default=defaults.model)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--microbatches", type=int, default=defaults.microbatches)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ifname", default=None, help="interface whose tx bytes to report")
    p.add_argument("--out", type=Path, required=True, help="JSONL file to append steps to")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    p.add_argument("--timeout-s", type=float, default=300.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one rank from command-line arguments; 0 on success, 1 on failure (one line on
    stderr), 2 for a usage error (argparse)."""
    args = _parser().parse_args(argv)
    rank = args.rank
    try:
        config = RankConfig(
            rank=rank,
            world_size=args.world_size,
            master=args.master,
            train=TrainConfig(
                model=args.model,
                steps=args.steps,
                batch_size=args.batch_size,
                microbatches=args.microbatches,
                lr=args.lr,
                seed=args.seed,
            ),
            threads=args.threads,
            out=args.out,
            ifname=args.ifname,
            schedule=args.schedule,
            timeout_s=args.timeout_s,
        )
        summary = run_rank(config)
    except Exception as exc:
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"torch_pipe rank {rank}: {message}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"event": "done", **summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
