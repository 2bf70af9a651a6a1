"""`ravnest-node bench`: real node processes over emulated links, against the alternatives.

For each scenario (a link: rate and one-way delay) the harness runs every system on the same
model, data, seed and number of samples, and writes one JSON object per run to the JSONL file:

- `compute-bound`: all stages in one node process, no network: the ceiling;
- `naive`: our stages, fp32 frames, one microbatch at a time through the pipeline, a flush every
  step (the "each layer waits for all others" pipeline);
- `ours`: the current defaults (GPipe-style overlap of a step's microbatches, synchronous steps);
- `torch-pipelining`: PyTorch's own `torch.distributed.pipelining` (1F1B, gloo), same stage cut;
- `hivemind`: data-parallel averaging; reported as skipped until ravnest-node has replica
  averaging to compare with (and unless it is installed).

Links, as root: each node in its own network namespace on a bridge, its link capped in both
directions by `tc tbf`, and a relay in front of each node's gRPC server adding the one-way delay
(the kernel here has no netem). Without root, relays on loopback do both rate and delay, per
connection rather than per host, and the output says so. Namespaces are removed afterwards, also
when a run fails or is interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import socket
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from ravnest_node.bench import torch_pipe
from ravnest_node.bench.links import (
    SCENARIOS,
    LinkSpec,
    NetnsSwarm,
    netns_available,
    remove_leftovers,
)
from ravnest_node.bench.report import markdown_table, plot
from ravnest_node.coordination.planner import partition
from ravnest_node.errors import ConfigError, RunFailed
from ravnest_node.launch.demo import Demo, DemoConfig, NodeSlot
from ravnest_node.launch.progress import ProgressBar
from ravnest_node.launch.signals import install_stop_handlers
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.credentials import create_swarm
from ravnest_node.transport.options import TransportConfig

SYSTEMS = ("compute-bound", "naive", "ours", "torch-pipelining", "hivemind", "ours-tls")
DEFAULT_SYSTEMS = SYSTEMS[:5]
"""`ours-tls` (ours in a protected swarm: mutual TLS and the TLS gate) runs when asked for."""
QUICK_STEPS = 10
NODES = 3
NODE_PORT = 7070
RELAY_PORT = 7071
TORCH_PORT = 29500
Record = dict[str, Any]


@dataclass(kw_only=True, frozen=True, slots=True)
class BenchConfig:
    """A benchmark run: scenarios x systems."""

    scenario: Literal["lan", "home", "internet", "all"] = "home"
    """Link to emulate: lan (1000 Mbit/s, 1 ms), home (50, 20), internet (10, 50), or all."""
    quick: bool = False
    """Shrink the run to 10 steps per system (about a minute per scenario); `bench codecs`
    also trains fewer codecs."""
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
        if self.compute_threads < 1:
            raise ConfigError("compute_threads must be at least 1")

    @property
    def system_list(self) -> list[str]:
        return [s.strip() for s in self.systems.split(",") if s.strip()]

    @property
    def scenario_names(self) -> list[str]:
        return list(SCENARIOS) if self.scenario == "all" else [self.scenario]

    @property
    def run_train(self) -> TrainConfig:
        return dataclasses.replace(self.train, steps=QUICK_STEPS) if self.quick else self.train


class _Interrupted(Exception):
    """A stop was requested (Ctrl-C, SIGTERM) while a system ran."""


def _bench_swarm(work_dir: Path) -> Path:
    """Credentials of a protected swarm for `ours-tls`, made once per bench work dir."""
    out = work_dir / "swarm-credentials"
    if not (out / "member.pem").exists():
        create_swarm("bench", out)
    return out


def _cores() -> int:
    return os.cpu_count() or 1


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FIXED_PORTS = (20_000, 32_768)
"""Where node ports picked ahead of their bind come from: below the system's ephemeral range,
so an outgoing connection of any process cannot take one between the pick and the bind (one did,
once in CI: "Address already in use")."""


def free_port() -> int:
    """A port on 127.0.0.1 free now, outside the ephemeral range (see FIXED_PORTS)."""
    low, high = FIXED_PORTS
    with contextlib.suppress(OSError, ValueError, IndexError):
        high = min(high, int(EPHEMERAL_RANGE.read_text().split()[0]))
    candidates = range(low, max(low, high))
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every one tried is taken: let the system choose
        s.bind(("127.0.0.1", 0))
        chosen: int = s.getsockname()[1]
        return chosen


def _steady_step_s(times: Sequence[float]) -> float:
    """Seconds per step after the first (which includes connecting and warm-up)."""
    if len(times) < 2:
        return times[-1] if times else math.nan
    return (times[-1] - times[0]) / (len(times) - 1)


class _Links:
    """The emulated network of one scenario: where each node runs and how it is reached."""

    def __init__(self, link: LinkSpec, mode: str, work_dir: Path) -> None:
        self.link = link
        self.mode = mode
        self.work_dir = work_dir
        self.netns: NetnsSwarm | None = None
        self.slots: list[NodeSlot] = []
        self._relays: list[asyncio.subprocess.Process] = []

    @property
    def description(self) -> str:
        if self.mode == "netns":
            return "network namespaces, tbf rate caps per host, relay delay"
        return "loopback relays for rate and delay (per connection, not per host: no root)"

    @contextlib.asynccontextmanager
    async def up(self) -> AsyncIterator[_Links]:
        stack = contextlib.AsyncExitStack()
        async with stack:
            if self.mode == "netns":
                self.netns = stack.enter_context(NetnsSwarm(NODES, self.link))
            stack.push_async_callback(self._stop_relays)
            for i in range(NODES):
                self.slots.append(await self._slot(i))
            yield self

    async def _slot(self, i: int) -> NodeSlot:
        if self.netns is not None:
            host = self.netns.hosts[i]
            await self._relay(
                self.netns.exec_prefix(i),
                f"{host.address}:{RELAY_PORT}",
                f"127.0.0.1:{NODE_PORT}",
                rate=False,
            )
            return NodeSlot(
                prefix=tuple(self.netns.exec_prefix(i)),
                listen=f"0.0.0.0:{NODE_PORT}",
                advertise=f"{host.address}:{RELAY_PORT}",
                reach=f"{host.address}:{NODE_PORT}",
            )
        node_port = free_port()
        relay_port = await self._relay([], "127.0.0.1:0", f"127.0.0.1:{node_port}", rate=True)
        return NodeSlot(
            listen=f"127.0.0.1:{node_port}",
            advertise=f"127.0.0.1:{relay_port}",
            reach=f"127.0.0.1:{node_port}",
        )

    async def _relay(self, prefix: list[str], listen: str, target: str, *, rate: bool) -> int:
        args = [*prefix, sys.executable, "-m", "ravnest_node.bench.relay", "--listen", listen,
                "--target", target, "--delay-ms", str(self.link.delay_ms)]  # fmt: skip
        if rate:
            args += ["--rate-mbit", str(self.link.rate_mbit)]
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
        )
        self._relays.append(proc)
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = await proc.stdout.readline()
        try:
            port = int(json.loads(line)["port"])
        except (ValueError, KeyError, TypeError):
            raise RunFailed(f"relay for {target} did not start: {line[:200]!r}") from None
        return port

    async def _stop_relays(self) -> None:
        for proc in self._relays:
            if proc.returncode is None:
                proc.terminate()
        for proc in self._relays:
            try:
                async with asyncio.timeout(5):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        self._relays.clear()

    def tx_bytes(self) -> list[int] | None:
        if self.netns is None:
            return None
        return [self.netns.tx_bytes(i) for i in range(NODES)]


class Bench:
    """Runs the configured scenarios and systems; `stop()` interrupts cleanly."""

    def __init__(self, cfg: BenchConfig, out: TextIO) -> None:
        self.cfg = cfg
        self.out = out
        self.train = cfg.run_train
        self.model = get_model(self.train.model)
        self.records: list[Record] = []
        self._stop = asyncio.Event()
        self._demo: Demo | None = None
        self.work_dir = cfg.work_dir or Path(tempfile.mkdtemp(prefix="ravnest-bench-"))

    def stop(self) -> None:
        self._stop.set()
        if self._demo is not None:
            self._demo.stop()

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    def _mode(self) -> str:
        if self.cfg.emulation == "relay":
            return "relay"
        ok, why = netns_available()
        if ok:
            return "netns"
        if self.cfg.emulation == "netns":
            raise RunFailed(f"--emulation netns is not possible here: {why}")
        self.say(f"note: {why}; emulating links with loopback relays only (rate is per connection)")
        return "relay"

    async def run(self) -> list[Record]:
        mode = self._mode()
        if mode == "netns":
            for leftover in remove_leftovers():
                self.say(f"removed {leftover}, left behind by an earlier run that was killed")
        self.cfg.jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.cfg.jsonl.write_text("")
        self.say(
            f"ravnest-node bench: {self.train.model}, {self.train.steps} steps of "
            f"{self.train.batch_size} samples per system; work dir {self.work_dir}"
        )
        for name in self.cfg.scenario_names:
            if self._stop.is_set():
                break
            link = SCENARIOS[name]
            links = _Links(link, mode, self.work_dir / name)
            async with links.up():
                self.say(f"scenario {name}: {link.rate_mbit:g} Mbit/s, {link.delay_ms:g} ms "
                         f"one way ({links.description})")  # fmt: skip
                scenario_records: list[Record] = []
                for system in self.cfg.system_list:
                    if self._stop.is_set():
                        break
                    try:
                        record = await self._run_system(system, name, links)
                    except _Interrupted:
                        break
                    scenario_records.append(record)
                    self._emit(record)
                _finish_scenario(scenario_records, self.model, self.train)
        self._rewrite_jsonl()
        return self.records

    def _emit(self, record: Record) -> None:
        self.records.append(record)
        with open(self.cfg.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
        if "skipped" in record:
            self.say(f"  {record['system']:<17} skipped: {record['skipped']}")
        else:
            self.say(
                f"  {record['system']:<17} {record['samples_per_s']:7.2f} samples/s  "
                f"{record['bytes_per_sample']:>10,.0f} B/sample  "
                f"loss {record['initial_loss']:.3f} -> {record['final_loss']:.3f}"
            )

    def _rewrite_jsonl(self) -> None:
        """Rewrite with the fields known only after a scenario (efficiency, equal samples)."""
        self.cfg.jsonl.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def _base(self, system: str, scenario: str, links: _Links | None) -> Record:
        t = self.train
        link = links.link if links else None
        return {
            "system": system,
            "scenario": scenario,
            "nodes": 1 if system == "compute-bound" else NODES,
            "link": (
                {
                    "rate_mbit": link.rate_mbit,
                    "delay_ms": link.delay_ms,
                    "emulation": links.mode if links else "none",
                }
                if link and system != "compute-bound"
                else None
            ),
            "model": t.model,
            "steps": t.steps,
            "batch_size": t.batch_size,
            "microbatches": t.microbatches,
            "samples": t.steps * t.batch_size,
            "codec": t.activation,
            "gradient_codec": t.gradient,
            "max_staleness": t.max_staleness,
            "staleness_warmup_steps": t.staleness_warmup_steps,
            "weight_prediction": t.weight_prediction,
            "replicas": 1,
            "seed": t.seed,
            "threads_per_node": _cores() if system == "compute-bound" else self.cfg.compute_threads,
        }

    async def _run_system(self, system: str, scenario: str, links: _Links) -> Record:
        base = self._base(system, scenario, links)
        if system == "hivemind":
            return base | {"skipped": "hivemind needs its p2pd daemon binary and its own torch "
                                      "pins; `bench replicas` compares our averaging traffic "
                                      "with its scheme"}  # fmt: skip
        if system == "torch-pipelining":
            if links.netns is None:
                why = "needs network namespaces (root): gloo links peer to peer, past any relay"
                return base | {"skipped": why}
            return base | await self._run_torch(system, links)
        # Pipelines of the workload's shape, one stage per node, whatever the planner would
        # make of the links (it may leave slow-linked nodes spare): what is compared is the
        # pipeline.
        per_pipeline = len(links.slots) // self.train.pipelines
        shaped = dataclasses.replace(self.train, stages=self.train.stages or per_pipeline)
        if system == "ours-tls":  # what protecting the swarm costs
            protected = dataclasses.replace(
                self.cfg.transport, swarm_dir=_bench_swarm(links.work_dir), token=None
            )
            threads = self.cfg.compute_threads
            return base | await self._run_ours(
                system, shaped, links.slots, links, threads, transport=protected
            )
        if system == "compute-bound":  # the ceiling: one process with every core
            alone = dataclasses.replace(self.train, stages=0)
            ceiling = await self._run_ours(system, alone, [NodeSlot()], links, _cores())
            return base | ceiling
        if system == "naive":  # fp32 frames, one microbatch at a time, whatever ours uses
            train = dataclasses.replace(
                shaped,
                schedule="sequential",
                max_staleness=0,
                codec="none",
                activation_codec="",
                gradient_codec="",
                lz4=False,
            )
            base |= {"codec": "none", "gradient_codec": "none", "max_staleness": 0}
        else:
            train = dataclasses.replace(shaped, schedule="gpipe")
        return base | await self._run_ours(
            system, train, links.slots, links, self.cfg.compute_threads
        )

    async def _run_ours(
        self,
        system: str,
        train: TrainConfig,
        slots: list[NodeSlot],
        links: _Links,
        threads: int,
        transport: TransportConfig | None = None,
    ) -> Record:
        run_dir = links.work_dir / system
        cfg = DemoConfig(
            nodes=len(slots),
            work_dir=run_dir,
            compute_threads=threads,
            train=train,
            transport=transport or self.cfg.transport,
        )
        log_path = run_dir / "progress.log"
        run_dir.mkdir(parents=True, exist_ok=True)
        log = await asyncio.to_thread(open, log_path, "w")
        with log:
            bar = ProgressBar(self.out, f"  {system:<17}", train.steps)
            demo = Demo(cfg, log, slots=slots, every=1, on_progress=lambda e: bar.update(e.step))
            self._demo = demo
            tx_before = links.tx_bytes() if len(slots) > 1 else None
            try:
                summary = await demo.run()
            finally:
                self._demo = None
                bar.clear()
            tx_after = links.tx_bytes() if len(slots) > 1 else None
        if summary is None:
            raise _Interrupted
        steps = [e for e in demo.events if not e.done]
        step_s = _steady_step_s([e.wall_s for e in steps])
        record: Record = {
            "wall_s": summary["wall_s"],
            "step_s": step_s,
            "samples_per_s": train.batch_size / step_s,
            "bytes_on_wire": summary["bytes_on_wire"],
            "bytes_per_sample": summary["bytes_per_sample"],
            # What the compression issue counts: the boundary tensors' frames, without the
            # link probes and control traffic that bytes_per_sample also holds.
            "activation_bytes_per_sample": summary["activation_bytes_per_sample"],
            "gradient_bytes_per_sample": summary["gradient_bytes_per_sample"],
            "bytes_source": "transport",
            "initial_loss": summary["initial_loss"],
            "final_loss": summary["final_loss"],
            "loss_history": summary["loss_history"],
            "final_params_l2": summary["final_params_l2"],
            "node_bytes_sent": [s["bytes_sent"] for s in summary["stages"]],
            "stage_compute_s": [s["compute_s"] for s in summary["stages"]],
            "curve": _curve(steps, train.batch_size),
            "log": str(run_dir),
        }
        if tx_before is not None and tx_after is not None:
            record["link_bytes"] = sum(tx_after) - sum(tx_before)
            record["node_link_bytes"] = [a - b for a, b in zip(tx_after, tx_before, strict=True)]
        return record

    async def _run_torch(self, system: str, links: _Links) -> Record:
        assert links.netns is not None
        t = self.train
        run_dir = links.work_dir / system
        run_dir.mkdir(parents=True, exist_ok=True)
        master = f"{links.netns.hosts[0].address}:{TORCH_PORT}"
        outs = [run_dir / f"rank{r}.jsonl" for r in range(NODES)]
        tx_before = links.tx_bytes()
        procs = []
        try:
            for r in range(NODES):
                host = links.netns.hosts[r]
                argv = torch_pipe.command(
                    r, NODES, master, model=t.model, steps=t.steps, batch_size=t.batch_size,
                    microbatches=t.microbatches, lr=t.lr, seed=t.seed,
                    threads=self.cfg.compute_threads, out=outs[r], ifname=host.ifname,
                )  # fmt: skip
                env = os.environ | {"GLOO_SOCKET_IFNAME": host.ifname}
                log = await asyncio.to_thread(open, run_dir / f"rank{r}.log", "wb")
                with log:
                    procs.append(
                        await asyncio.create_subprocess_exec(
                            *links.netns.exec_prefix(r),
                            *argv,
                            env=env,
                            stdout=log,
                            stderr=log,
                            stdin=asyncio.subprocess.DEVNULL,
                        )
                    )
            everyone: asyncio.Future[Any] = asyncio.ensure_future(
                asyncio.gather(*(p.wait() for p in procs))
            )
            stop: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait([everyone, stop], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
                everyone.cancel()
            if self._stop.is_set():
                raise _Interrupted
            codes = [p.returncode for p in procs]
            if any(codes):
                raise RunFailed(f"torch-pipelining ranks exited with {codes}; logs in {run_dir}")
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        tx_after = links.tx_bytes()
        assert tx_before is not None and tx_after is not None
        result = torch_pipe.read_results(outs)
        step_s = _steady_step_s(result["t_history"])
        link_bytes = sum(tx_after) - sum(tx_before)
        # Each rank counts its interface's bytes from the barrier before step 1.
        tx_hist = result["tx_bytes_history"] or [0] * t.steps
        curve = [
            [(i + 1) * t.batch_size, tt, tx, loss]
            for i, (tt, tx, loss) in enumerate(
                zip(result["t_history"], tx_hist, result["loss_history"], strict=True)
            )
        ]
        return {
            "wall_s": result["wall_s"],
            "step_s": step_s,
            "samples_per_s": t.batch_size / step_s,
            "bytes_on_wire": link_bytes,
            "bytes_per_sample": link_bytes / (t.steps * t.batch_size),
            "bytes_source": "interface counters (gloo is not ours to instrument; includes TCP/IP)",
            "link_bytes": link_bytes,
            "node_link_bytes": [a - b for a, b in zip(tx_after, tx_before, strict=True)],
            "initial_loss": result["loss_history"][0],
            "final_loss": result["loss_history"][-1],
            "loss_history": result["loss_history"],
            "curve": curve,
            "log": str(run_dir),
            "note": "rate caps apply; the delay relay cannot be placed on gloo's direct links",
        }


def _curve(events: Sequence[pb.Progress], batch_size: int) -> list[list[float]]:
    return [[e.step * batch_size, e.wall_s, e.bytes_on_wire, e.loss] for e in events]


def _finish_scenario(records: list[Record], model: Any, train: TrainConfig) -> None:
    """Fields that need the whole scenario: loss at equal samples and efficiency."""
    runs = [r for r in records if "skipped" not in r]
    if not runs:
        return
    equal = min(len(r["loss_history"]) for r in runs)
    for r in runs:
        r["loss_at_equal_samples"] = r["loss_history"][equal - 1]
    compute = next((r for r in runs if r["system"] == "compute-bound"), None)
    costs = model.block_costs()
    cuts = partition(costs, NODES)
    share = max(sum(costs[a:b]) for a, b in cuts) / sum(costs)
    if compute is not None:
        stage_s = compute["step_s"] * share
    else:  # measured on our nodes (the same stages; inflated when they share cores)
        measured = [max(r["stage_compute_s"]) for r in runs if r.get("stage_compute_s")]
        stage_s = min(measured) / train.steps if measured else math.nan
    for r in runs:
        if r["system"] == "compute-bound" or r.get("link") is None:
            continue
        if r["link"]["emulation"] != "netns":
            # Relays pace each connection, not each host: there is no per-host uplink to bound.
            r["efficiency"] = None
            continue
        # What each host's interface sent (headers included), the same measure for every system.
        egress = max(r["node_link_bytes"]) / train.steps
        transfer_s = egress * 8 / (r["link"]["rate_mbit"] * 1e6)
        bound = max(stage_s, transfer_s)
        r["lower_bound_step_s"] = bound
        r["slowest_stage_compute_s"] = stage_s
        r["busiest_uplink_transfer_s"] = transfer_s
        r["efficiency"] = bound / r["step_s"]
        # The same bound for this machine, where the stages share its cores: their measured
        # compute cannot take less than its sum over the cores.
        measured = [c / train.steps for c in r.get("stage_compute_s") or []]
        if measured:
            shared = max(sum(measured) / min(_cores(), len(measured)), max(measured))
            r["lower_bound_step_s_this_machine"] = max(shared, transfer_s)
            r["efficiency_this_machine"] = max(shared, transfer_s) / r["step_s"]


def run_bench(cfg: BenchConfig, out: TextIO = sys.stdout) -> int:
    """The `bench` command: run, then write the table and plot beside the JSONL."""

    async def main() -> list[Record]:
        bench = Bench(cfg, out)
        install_stop_handlers(asyncio.get_running_loop(), bench.stop)
        return await bench.run()

    started = time.monotonic()
    records = asyncio.run(main())
    if len(records) < len(cfg.scenario_names) * len(cfg.system_list):
        print(f"interrupted: {len(records)} run(s) finished", file=out)
    table = markdown_table(records)
    table_path = cfg.jsonl.with_suffix(".md")
    table_path.write_text(table)
    print(file=out)
    print(table, file=out)
    why_not = plot(records, cfg.jsonl.with_suffix(".png"))
    print(f"wrote {cfg.jsonl}, {table_path}"
          + (f"; no plot: {why_not}" if why_not else f", {cfg.jsonl.with_suffix('.png')}")
          + f" in {time.monotonic() - started:.0f} s", file=out, flush=True)  # fmt: skip
    return 0
