"""`ravnest-node bench flaps`: home networks flap (issue #34); what a dropped link costs a run.

Each scenario is one run of three daemons, each in its own network namespace on a 50 Mbit/s
link (`links.NetnsSwarm`), coordinator plus two `--join`, with a fixed codec so that losses
compare. Once the node that owns the middle stage reaches step `CUT_STEP` the fault starts:

  clean      no fault: the reference every other scenario is compared with
  flapN      the middle node's link down N s (3, 10, 60, 300), then up again
  loss5      the middle node drops 5% of its packets each way, at random, from the cut step
             to the end of the run (iptables' statistic match)
  coord10    the coordinator's own link down 10 s

What each promises to measure, per scenario (one JSON line each, and a table; see
`flaps_report`): the coordinator's training wall time, the outage as it happened (seconds
between the link going down and coming up), the longest time without a new step (Node.Status
polled every `POLL_S` from the root namespace), the plans, redone microbatches, samples against
steps x batch, final loss, samples/s, and whether every daemon was still running once the run
had ended and the fault was over (then each is stopped with SIGTERM, its exit code recorded).

Needs root, namespaces and iptables; without them it prints why and measures nothing (exit 0).
It cleans up what it made: the namespaces (NetnsSwarm's teardown) and the processes it
started, by pid.
"""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc

from ravnest_node.bench import flaps_report
from ravnest_node.bench.links import LinkSpec, NetnsSwarm, iptables_available, remove_leftovers
from ravnest_node.bench.suite import Suite
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc

RATE_MBIT = 50.0
MODEL = "small"
STEPS = 600
QUICK_STEPS = 200
CUT_STEP = 40
CODEC = "int8-block"
"""Fixed (not `auto`, which picks by measured bandwidth, and so would differ with the fault)."""
CHECKPOINT_EVERY = 10
PORT = 7070
NET_NAME = "rvbflap"
POLL_S = 0.5
READY_TIMEOUT_S = 120.0
SETTLE_S = 3.0
"""After the run ended and the fault is over: how long a daemon has to exit if it is going to,
before 'still running' is recorded."""
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Scenario:
    """One run of the matrix: which node the fault hits, what it is, and for how long."""

    name: str
    fault: str
    """none, flap (link down then up) or loss (random packet loss)."""
    target: str = "middle"
    """middle (the node with stage 1 in the first plan) or coordinator."""
    seconds: float = 0.0
    """How long a flap keeps the link down (loss lasts to the run's end)."""
    loss_share: float = 0.0
    quick: bool = True
    """Also run by --quick."""


SCENARIOS = (
    Scenario("clean", "none"),
    Scenario("flap3", "flap", seconds=3),
    Scenario("flap10", "flap", seconds=10),
    Scenario("flap60", "flap", seconds=60),
    Scenario("flap300", "flap", seconds=300, quick=False),
    Scenario("loss5", "loss", loss_share=0.05),
    Scenario("coord10", "flap", target="coordinator", seconds=10),
)
BY_NAME = {s.name: s for s in SCENARIOS}


@dataclass(frozen=True, slots=True)
class RunSettings:
    """The training run every scenario of one suite run performs."""

    model: str = MODEL
    steps: int = STEPS
    batch_size: int = 16
    cut_step: int = CUT_STEP
    timeout_s: float = 1800.0
    """The whole scenario, fault included; then its daemons are stopped and it is recorded
    as unfinished."""

    def node_args(self) -> list[str]:
        return [
            "--model",
            self.model,
            "--steps",
            str(self.steps),
            "--batch-size",
            str(self.batch_size),
            "--checkpoint-every",
            str(CHECKPOINT_EVERY),
            "--seed",
            "0",
            "--codec",
            CODEC,
        ]


def _status(address: str, timeout_s: float) -> pb.NodeStatus | None:
    """The node's status, or None if it does not answer in time (cut off, or gone)."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply: pb.NodeStatus = pb_grpc.NodeStub(channel).Status(  # type: ignore[no-untyped-call]
                pb.StatusRequest(), timeout=timeout_s
            )
            return reply
    except grpc.RpcError:
        return None


def _ready_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the daemon printed its ready line within `timeout_s` (False: it exited first)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return False
    return bool(proc.stdout.readline())


class _Swarm:
    """Three daemons of one scenario in `net`'s namespaces, their state under `work_dir`."""

    def __init__(self, net: NetnsSwarm, work_dir: Path, run: RunSettings) -> None:
        self.net, self.work_dir, self.run = net, work_dir, run
        self.addresses = [f"{h.address}:{PORT}" for h in net.hosts]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.progress: list[tuple[float, int]] = []
        """(monotonic s, version) of every status answer: the stall figure's input."""

    def start(self) -> None:
        for i, address in enumerate(self.addresses):
            state = self.work_dir / f"n{i}"
            state.mkdir(parents=True, exist_ok=True)
            role = (
                ["--swarm-size", "3", *self.run.node_args()]
                if i == 0
                else ["--join", self.addresses[0]]
            )
            argv = [
                *self.net.exec_prefix(i),
                sys.executable,
                "-m",
                "ravnest_node",
                "start",
                "--listen",
                address,
                "--state-dir",
                str(state),
                "--threads",
                "1",
                *role,
            ]
            with open(state / "node.log", "ab") as log:
                proc = subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL
                )
            self.procs.append(proc)
            if not _ready_line(proc, READY_TIMEOUT_S):
                raise RuntimeError(
                    f"node {i} was not ready: {(state / 'node.log').read_text()[-2000:]}"
                )

    def poll(self) -> list[pb.NodeStatus | None]:
        out = []
        for address in self.addresses:
            s = _status(address, POLL_S)
            if s is not None and s.plan_epoch:
                self.progress.append((time.monotonic(), s.version))
            out.append(s)
        return out

    def running(self) -> list[bool]:
        return [p.poll() is None for p in self.procs]

    def stop(self) -> list[int | None]:
        """SIGTERM to each daemon still running, then its exit code (None: it had to be killed)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes: list[int | None] = []
        for p in self.procs:
            try:
                codes.append(p.wait(STOP_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
                codes.append(None)
        return codes


class _Fault:
    """The scenario's fault on host `target`: begins with `start`, ends with `end` (idempotent)."""

    def __init__(self, scenario: Scenario, net: NetnsSwarm, target: int) -> None:
        self.scenario, self.net, self.target = scenario, net, target
        self.down_at: float | None = None
        self.up_at: float | None = None
        self.run_ended_during = False
        """The run ended while the link was still down: the cut node could not rejoin it (a
        run too short for the outage, or one that went on without the node)."""

    def start(self) -> None:
        if self.scenario.fault == "flap":
            self.net.link_down(self.target)
        elif self.scenario.fault == "loss":
            self.net.lossy(self.target, self.scenario.loss_share)
        self.down_at = time.monotonic()

    def due(self, run_ended: bool) -> bool:
        """Whether it should end now: a flap after its seconds, loss once the run ended."""
        if self.down_at is None or self.up_at is not None:
            return False
        if self.scenario.fault == "flap":
            return time.monotonic() - self.down_at >= self.scenario.seconds
        return run_ended

    def end(self) -> None:
        if self.down_at is None or self.up_at is not None:
            return
        if self.scenario.fault == "flap":
            self.net.link_up(self.target)
        elif self.scenario.fault == "loss":
            self.net.clear_loss(self.target)
        self.up_at = time.monotonic()

    @property
    def outage_s(self) -> float:
        """Seconds the link was down, as it happened (0 for no fault and for packet loss)."""
        if self.scenario.fault != "flap" or self.down_at is None:
            return 0.0
        return (self.up_at or time.monotonic()) - self.down_at


def _target(swarm: _Swarm, scenario: Scenario, deadline: float) -> int:
    """The host the fault hits: the coordinator's (0), or the one with stage 1 in a plan."""
    if scenario.target == "coordinator":
        return 0
    while time.monotonic() < deadline and all(swarm.running()):
        for i, s in enumerate(swarm.poll()):
            if s is not None and s.plan_epoch and s.stage == 1:
                return i
        time.sleep(POLL_S)
    raise RuntimeError("no plan gave a node stage 1")


def _drive(swarm: _Swarm, scenario: Scenario, fault: _Fault | None, deadline: float) -> bool:
    """Poll until the run has ended (the coordinator's summary) and the fault is over, a daemon
    has exited with the run unfinished for good, or the deadline; the fault is started once its
    target's stage reaches the cut step. Returns whether the run ended."""
    summary = swarm.work_dir / "n0" / "summary.json"
    while time.monotonic() < deadline:
        statuses = swarm.poll()
        ended = summary.exists()
        if fault is not None and fault.down_at is None and not ended:
            s = statuses[fault.target]
            if s is not None and s.version >= swarm.run.cut_step:
                fault.start()
        if fault is not None and fault.due(ended):
            fault.end()
        if fault is not None and ended and fault.down_at is not None and fault.up_at is None:
            fault.run_ended_during = scenario.fault == "flap"
        fault_over = fault is None or fault.up_at is not None or (ended and fault.down_at is None)
        if ended and fault_over:
            return True
        if not swarm.running()[0] and not ended:
            return False  # the coordinator is gone: no summary is coming
        time.sleep(POLL_S)
    return summary.exists()


def run_scenario(
    scenario: Scenario, run: RunSettings, work_dir: Path, net_name: str | None = None
) -> dict[str, Any]:
    """One scenario, start to cleanup; its record (without the figures against clean). Its
    namespaces are named after `net_name` (NET_NAME by default)."""
    net_name = net_name or NET_NAME
    remove_leftovers(net_name)  # of a run killed before its teardown
    work_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    deadline = started + run.timeout_s + scenario.seconds
    with NetnsSwarm(3, LinkSpec(RATE_MBIT, 0), name=net_name) as net:
        swarm = _Swarm(net, work_dir, run)
        fault: _Fault | None = None
        try:
            swarm.start()
            if scenario.fault != "none":
                fault = _Fault(scenario, net, _target(swarm, scenario, deadline))
            finished = _drive(swarm, scenario, fault, deadline)
            time.sleep(SETTLE_S)
            running = swarm.running()
            before_stop = [p.poll() for p in swarm.procs]
        finally:
            if fault is not None:
                fault.end()
            exit_codes = swarm.stop()
    summary_path = work_dir / "n0" / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    logs = [(work_dir / f"n{i}" / "node.log") for i in range(3)]
    record: dict[str, Any] = {
        "scenario": scenario.name,
        "model": run.model,
        "steps": run.steps,
        "rate_mbit": RATE_MBIT,
        "codec": CODEC,
        "fault": scenario.fault,
        "target": scenario.target,
        "target_host": fault.target if fault else None,
        "fault_started": fault is not None and fault.down_at is not None,
        "outage_s": fault.outage_s if fault else 0.0,
        "run_ended_during_outage": fault.run_ended_during if fault else False,
        "loss_share": scenario.loss_share,
        "run_finished": finished,
        "harness_s": time.monotonic() - started,
        "longest_stall_s": flaps_report.longest_stall_s(swarm.progress),
        "running_at_end": running,
        "exit_codes_before_stop": before_stop,
        "exit_codes": exit_codes,
        "warning_lines": [flaps_report.warning_lines(p.read_text(errors="replace")) for p in logs],
        "work_dir": str(work_dir),
    }
    record.update(flaps_report.summary_figures(summary, run.steps, run.batch_size))
    return record


def chosen(only: str, quick: bool) -> list[Scenario]:
    """The scenarios `--only` names (comma-separated; all if empty, less flap300 with quick),
    clean first when it is among them (the others are compared with it)."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(
            f"bench flaps --only {only!r}: no scenario {', '.join(unknown)} "
            f"(choose from {', '.join(BY_NAME)})"
        )
    picked = (
        [BY_NAME[n] for n in names] if names else [s for s in SCENARIOS if s.quick or not quick]
    )
    return sorted(picked, key=lambda s: s.name != "clean")


def run_flaps_bench(
    suite: Suite, only: str = "", model: str | None = None, steps: int | None = None
) -> int:
    """The `bench flaps` command: the scenarios `only` names (all by default), `model` (small)
    for `steps` (600, 200 with --quick) each; records to suite.jsonl, the table beside it."""
    out: TextIO = suite.out
    try:
        scenarios = chosen(only, suite.quick)
    except ValueError as exc:
        print(f"ravnest-node: {exc}", file=sys.stderr)
        return 2
    ok, why = iptables_available()
    if not ok:
        print(f"flaps: nothing measured: {why}", file=out, flush=True)
        return 0
    run = RunSettings(
        model=model or MODEL,
        steps=steps or (QUICK_STEPS if suite.quick else STEPS),
        batch_size=suite.train.batch_size,
    )
    print(
        f"flaps: {run.model}, {run.steps} steps, 3 nodes on {RATE_MBIT:g} Mbit/s links, codec "
        f"{CODEC}, fault at the target's step {run.cut_step}: "
        f"{', '.join(s.name for s in scenarios)}",
        file=out,
        flush=True,
    )
    records = _measure(scenarios, run, suite.work_dir, out)
    text = flaps_report.table(records)
    print(text, file=out, flush=True)
    suite.jsonl.parent.mkdir(parents=True, exist_ok=True)
    suite.jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    suite.jsonl.with_suffix(".md").write_text(text + "\n")
    print(f"wrote {suite.jsonl} and {suite.jsonl.with_suffix('.md')}", file=out, flush=True)
    return 0


def _measure(
    scenarios: Sequence[Scenario], run: RunSettings, work_dir: Path, out: TextIO
) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    clean: dict[str, Any] | None = None
    for scenario in scenarios:
        print(f"  {scenario.name} ...", file=out, flush=True)
        r = run_scenario(scenario, run, work_dir / scenario.name)
        if scenario.name == "clean" and r["run_finished"]:
            clean = r
        r.update(flaps_report.against_clean(r, clean))
        print(
            f"  {scenario.name}: finished {r['run_finished']}, outage {r['outage_s']:.1f} s, "
            f"daemons running at the end {r['running_at_end']}",
            file=out,
            flush=True,
        )
        records.append(r)
    return records
