"""`ravnest-node demo`: a local swarm of node processes on 127.0.0.1, trained end to end.

The demo starts node 0 (the coordinator, which also trains stage 0), waits until it announces
its address, starts the other nodes with `--join` to it, then follows the coordinator's progress
stream, printing one line per step (or every few steps). When the run is done it stops every
node with SIGTERM, waits for them, prints the summary and (with `--summary-json`) writes it.
Ctrl-C or SIGTERM stops the whole swarm the same way. Node logs go to <work-dir>/node-<i>/node.log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import grpc

from ravnest_node.devices import resolve_device
from ravnest_node.errors import EXIT_BANNED, ConfigError, RunFailed
from ravnest_node.launch.signals import install_stop_handlers
from ravnest_node.logs import LogLevel
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig, check_frame_limit, check_swarm_shape
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.settings import to_env
from ravnest_node.state import write_atomic
from ravnest_node.transport.authority import member_identity
from ravnest_node.transport.options import TransportConfig, grpc_channel
from ravnest_node.units import rate_text


@dataclass(kw_only=True, frozen=True, slots=True)
class DemoConfig:
    """A local swarm: N node processes on this machine."""

    nodes: int = 3
    """Node processes to start (each trains one stage; 1 = the whole model in one process)."""
    work_dir: Path | None = None
    """Where node state and logs go (default: a new temporary directory)."""
    summary_json: Path | None = None
    """Write the run summary (JSON) here when training finishes."""
    compute_threads: int = field(default=0, metadata={"flag": "--threads"})
    """Torch threads per node (0 = this machine's cores divided among the nodes)."""
    device: str = "auto"
    """The device every node process computes on (their --device): auto, cpu, cuda, cuda:N
    or mps."""
    log_level: LogLevel = "info"
    """Log level of the node processes (their logs go to files in the work dir)."""
    resume: bool = False
    """Resume the run from the checkpoints the nodes of an earlier demo left in --work-dir
    (stopped with Ctrl-C, or run with fewer --steps): every node starts with --resume."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The training run."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """Limits and timeouts of the gRPC transport."""

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64:
            raise ConfigError(f"nodes={self.nodes}: must be between 1 and 64")
        check_swarm_shape(self.nodes, self.train)
        if self.compute_threads < 0:
            raise ConfigError(f"compute_threads={self.compute_threads}: must be >= 0")
        if self.resume and self.work_dir is None:
            raise ConfigError("resume: give the --work-dir of the demo to resume")
        check_frame_limit(self.train, self.transport.max_message_bytes)
        resolve_device(self.device)  # ConfigError before any node starts
        if self.nodes > 1 and member_identity(self.transport.swarm_dir) is not None:
            raise ConfigError(
                f"swarm_dir={self.transport.swarm_dir}: a member directory is one node's "
                "identity; give the demo the swarm's directory"
            )

    @property
    def threads_per_node(self) -> int:
        return self.compute_threads or max(1, (os.cpu_count() or 1) // self.nodes)


@dataclass(frozen=True, slots=True)
class NodeSlot:
    """Where and how one node of a local swarm runs."""

    prefix: tuple[str, ...] = ()
    """Command prefix, e.g. ("ip", "netns", "exec", "ns0") to run it in a network namespace."""
    listen: str = "127.0.0.1:0"
    """The node's --listen address."""
    advertise: str | None = None
    """The node's --advertise address (e.g. a relay in front of it)."""
    reach: str | None = None
    """How the launcher itself reaches the node (default: the address it announces)."""


@dataclass(slots=True)
class _Node:
    index: int
    state_dir: Path
    proc: asyncio.subprocess.Process
    log: Path
    exited: asyncio.Task[int]
    address: str = ""


class Demo:
    """Runs one demo; `run()` returns the summary, or None if stopped before the end."""

    def __init__(
        self,
        cfg: DemoConfig,
        out: TextIO,
        *,
        slots: Sequence[NodeSlot] | None = None,
        every: int | None = None,
        node_args: Sequence[str] = (),
        late_nodes: int = 0,
        late_at_step: int = 0,
        on_progress: Callable[[pb.Progress], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_progress = on_progress
        """Told of every progress event (a benchmark's progress bar)."""
        self.node_args = list(node_args)
        """Extra `ravnest-node start` arguments for every node."""
        self.late_nodes, self.late_at_step = late_nodes, late_at_step
        """Nodes that join the running swarm once it reports step `late_at_step`."""
        self.late_started_at: float | None = None
        """time.monotonic() when the first late node was started."""
        self.event_times: list[float] = []
        """time.monotonic() when each of `events` arrived."""
        self.out = out
        self.slots = list(slots) if slots is not None else [NodeSlot()] * cfg.nodes
        if len(self.slots) != cfg.nodes:
            raise ValueError(f"{len(self.slots)} slots for {cfg.nodes} nodes")
        self.every = every if every is not None else max(1, cfg.train.steps // 25)
        self.events: list[pb.Progress] = []
        self.nodes: list[_Node] = []
        self.banned: set[int] = set()
        """Nodes that stopped because the coordinator banned them (exit status EXIT_BANNED):
        the run goes on without them."""
        self._stop = asyncio.Event()
        if cfg.work_dir is not None:
            cfg.work_dir.mkdir(parents=True, exist_ok=True)
            self.work_dir = cfg.work_dir
        else:
            self.work_dir = Path(tempfile.mkdtemp(prefix="ravnest-demo-"))

    def stop(self) -> None:
        self._stop.set()

    def _print(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    async def run(self) -> dict[str, Any] | None:
        cfg = self.cfg
        model = get_model(cfg.train.model)
        self._print(
            f"ravnest-node demo: {cfg.nodes} node(s) training {cfg.train.model} "
            f"({model.num_parameters() / 1e6:.2f} M parameters) for {cfg.train.steps} steps "
            f"of {cfg.train.batch_size} samples; work dir {self.work_dir}"
        )
        try:
            coordinator = await self._spawn(0, join=None)
            if coordinator is None:
                return None
            for i in range(1, cfg.nodes):
                if await self._spawn(i, join=coordinator.address) is None:
                    return None
            return await self._follow(self.slots[0].reach or coordinator.address)
        finally:
            await self._shutdown()

    async def _spawn(self, index: int, join: str | None) -> _Node | None:
        cfg = self.cfg
        state_dir = self.work_dir / f"node-{index}"
        state_dir.mkdir(parents=True, exist_ok=True)
        log_path = state_dir / "node.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAVNEST_")}
        env |= to_env(cfg.train, ("train",)) | to_env(cfg.transport, ("transport",))
        env["PYTHONUNBUFFERED"] = "1"
        slot = self.slots[index] if index < len(self.slots) else NodeSlot()
        args = [
            "start",
            "--listen", slot.listen,
            "--state-dir", str(state_dir),
            "--threads", str(cfg.threads_per_node),
            "--device", cfg.device,
            "--log-level", cfg.log_level,
        ]  # fmt: skip
        args += ["--advertise", slot.advertise] if slot.advertise else []
        args += ["--join", join] if join else ["--swarm-size", str(cfg.nodes)]
        args += ["--resume"] if cfg.resume else []
        args += self.node_args
        log_file = await asyncio.to_thread(open, log_path, "ab")
        with log_file:
            proc = await asyncio.create_subprocess_exec(
                *slot.prefix, sys.executable, "-m", "ravnest_node", *args,
                stdout=asyncio.subprocess.PIPE, stderr=log_file, stdin=asyncio.subprocess.DEVNULL,
                env=env,
            )  # fmt: skip
        node = _Node(
            index=index,
            state_dir=state_dir,
            proc=proc,
            log=log_path,
            exited=asyncio.create_task(proc.wait()),  # awaited in _shutdown
        )
        self.nodes.append(node)
        ready = await self._until(self._read_ready(node))
        if ready is None:
            return None
        node.address = ready["address"]
        self._print(f"node {index} ready at {node.address} (pid {proc.pid})")
        return node

    async def _read_ready(self, node: _Node) -> dict[str, Any]:
        assert node.proc.stdout is not None
        line = await node.proc.stdout.readline()
        if not line:
            code = await node.proc.wait()
            raise RunFailed(
                f"node {node.index} exited ({code}) before it was ready{self._tail(node)}"
            )
        try:
            event: dict[str, Any] = json.loads(line)
            str(event["address"])
        except (ValueError, KeyError, TypeError):
            raise RunFailed(
                f"node {node.index} announced {line[:200]!r}, not a ready event"
            ) from None
        return event

    async def _until(self, work: Any) -> Any:
        """Await `work` unless a stop is requested or a node dies first (then RunFailed)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        try:
            while True:
                deaths = [n.exited for n in self.nodes if n.index not in self.banned]
                done, _ = await asyncio.wait([task, stop, *deaths],
                                             return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if task in done:
                    return task.result()
                if stop in done:
                    return None
                dead = next(n for n in self.nodes if n.exited in done)
                if dead.proc.returncode != EXIT_BANNED:
                    break
                # Banned for failing audits: the swarm trains on without it.
                self.banned.add(dead.index)
                self._print(f"node {dead.index} was banned from the swarm and stopped")
            raise RunFailed(
                f"node {dead.index} exited with status {dead.proc.returncode} during the run"
                f"{self._tail(dead)}"
            )
        finally:
            task.cancel()
            stop.cancel()

    async def _follow(self, coordinator: str) -> dict[str, Any] | None:
        async with grpc_channel(coordinator, self.cfg.transport) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            call = stub.WatchProgress(pb.WatchProgressRequest())
            try:
                while True:
                    event = await self._until(call.read())
                    if event is None:
                        return None
                    if event is grpc.aio.EOF:
                        raise RunFailed("the coordinator ended the progress stream early")
                    assert isinstance(event, pb.Progress)
                    self.events.append(event)
                    self.event_times.append(time.monotonic())
                    if self.on_progress is not None:
                        self.on_progress(event)
                    if (
                        self.late_nodes
                        and self.late_started_at is None
                        and (event.step >= self.late_at_step)
                    ):
                        self.late_started_at = time.monotonic()
                        for i in range(self.late_nodes):
                            self._print(f"step {event.step}: a node joins the running swarm")
                            if await self._spawn(self.cfg.nodes + i, join=coordinator) is None:
                                return None
                    if event.done:
                        summary: dict[str, Any] = json.loads(event.summary_json)
                        return summary
                    if event.step % self.every == 0 or event.step == 1:
                        self._print(_progress_line(event))
            except grpc.aio.AioRpcError as exc:
                if self._stop.is_set():
                    return None
                await self._explain_death(self.nodes[0])
                raise RunFailed(f"lost the coordinator: {exc.details()}") from None
            finally:
                call.cancel()

    async def _explain_death(self, node: _Node) -> None:
        """If `node` is exiting, wait for it and raise RunFailed with its status and log."""
        try:
            async with asyncio.timeout(self.cfg.transport.stop_grace_s + 5):
                code = await asyncio.shield(node.exited)
        except TimeoutError:
            return
        raise RunFailed(f"node {node.index} exited with status {code}{self._tail(node)}")

    async def _shutdown(self) -> None:
        """SIGTERM every node still running, wait for it; SIGKILL what outlives the grace."""
        for node in self.nodes:
            if node.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    node.proc.send_signal(signal.SIGTERM)
        grace = self.cfg.transport.stop_grace_s + 5.0
        if self.nodes:
            _, late = await asyncio.wait([n.exited for n in self.nodes], timeout=grace)
            for node in self.nodes:
                if node.exited in late:
                    self._print(f"node {node.index} did not stop within {grace:g} s; killing it")
                    node.proc.kill()
            await asyncio.gather(*(n.exited for n in self.nodes))
        for node in self.nodes:
            if node.proc.stdout is not None:
                await node.proc.stdout.read()

    def _tail(self, node: _Node, lines: int = 8) -> str:
        try:
            text = node.log.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return "; last log lines:\n  " + "\n  ".join(text) if text else ""


def _progress_line(event: pb.Progress) -> str:
    rate = event.samples / event.wall_s if event.wall_s > 0 else 0.0
    evaluation = (f"  eval {event.eval_loss:7.4f} (step {event.eval_step})"
                  if event.eval_step else "")  # fmt: skip
    return (
        f"step {event.step:>5}/{event.steps}  loss {event.loss:7.4f}{evaluation}  "
        f"{rate:6.1f} samples/s  sent {_human_bytes(event.bytes_on_wire)}"
    )


def _human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    raise AssertionError("unreachable")


def summary_lines(s: dict[str, Any]) -> list[str]:
    """The summary as a person reads it."""
    initial = s["initial_loss"] or math.nan
    drop = (initial - s["final_loss"]) / initial * 100
    lines = [
        f"trained {s['model']} ({s['num_params'] / 1e6:.2f} M parameters) on {s['nodes']} "
        f"node(s): {s['steps']} steps, {s['samples']} samples in {s['wall_s']:.1f} s "
        f"({s['samples_per_s']:.1f} samples/s)",
        f"loss {s['initial_loss']:.4f} -> {s['final_loss']:.4f} ({-drop:+.1f}%)",
        f"bytes on wire {_human_bytes(s['bytes_on_wire'])} "
        f"({s['bytes_per_sample']:,.0f} per sample; codecs {s['codec']} forward, "
        f"{s['gradient_codec']} back)",
        f"final parameter L2 norm {s['final_params_l2']:.6f}",
    ]
    several = s.get("pipelines", 1) > 1
    lines += [
        ("  " + (f"pipeline {st['pipeline']} " if several else ""))
        + f"stage {st['index']}: blocks [{st['blocks'][0]}, {st['blocks'][1]}) "
        f"on {st['address']} (node {st['node_id']})" + _auto_choices(st)
        for st in s["stages"]
    ]
    return lines


def _auto_choices(stage: dict[str, Any]) -> str:
    """What `auto` chose on a stage's links (empty where it measured nothing)."""
    parts = [
        f"{role}s {stage.get(f'{role}_codec', '')} at {rate_text(stage.get(key, 0.0))}"
        for role, key in (
            ("activation", "downstream_bandwidth_bps"),
            ("gradient", "upstream_bandwidth_bps"),
        )
        if stage.get(key, 0.0) > 0
    ]
    return "; " + ", ".join(parts) if parts else ""


def run_demo(cfg: DemoConfig, out: TextIO = sys.stdout) -> int:
    """Run the demo in a fresh event loop; the exit status for the CLI."""

    async def main() -> dict[str, Any] | None:
        demo = Demo(cfg, out)
        install_stop_handlers(asyncio.get_running_loop(), demo.stop)
        return await demo.run()

    started = time.monotonic()
    summary = asyncio.run(main())
    if summary is None:
        print(f"demo stopped after {time.monotonic() - started:.1f} s", file=out, flush=True)
        return 0
    for line in summary_lines(summary):
        print(line, file=out)
    if cfg.summary_json is not None:
        write_atomic(cfg.summary_json, json.dumps(summary, indent=2).encode())
        print(f"summary written to {cfg.summary_json}", file=out)
    out.flush()
    return 0


def train_quietly(cfg: DemoConfig) -> dict[str, Any] | None:
    """Run the demo `cfg` to the end with its progress in `cfg.work_dir`/progress.log (for the
    benchmark suites); its summary, or None if it was stopped."""
    assert cfg.work_dir is not None
    cfg.work_dir.mkdir(parents=True, exist_ok=True)
    with open(cfg.work_dir / "progress.log", "w") as log:
        return asyncio.run(Demo(cfg, log).run())
