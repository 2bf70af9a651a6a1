"""What one coordinator holds: `python -m ravnest_node.bench.swarm_size [--members 100 300 1000]`.

For each size N: a real lab coordinator process (`ravnest-node coordinator`, on the first core
only) and N simulated members (bench/sim_member.py, in this process, on the other cores) of a
public swarm training llama-300m in N / 25 pipelines of 25 stages. Measured, in this order:

1. joins: all N (their block times 0.5x to 2x apart, as a public swarm's GPUs are) join at
   once (the worst case: a swarm forming, or every member coming back after a failover), then
   join again with capabilities; each call's latency;
2. the plan: from the last capabilities to every member holding the first plan (the planner
   and the announcement to N plan streams);
3. steady training for `--steady-s`: heartbeats every lease / 3 and a report per stage every
   `--step-s` (one optimizer step), their latencies, and the coordinator's CPU (share of its
   core) and memory;
4. a leave: one member with a stage leaves; from its Leave to every other member holding the
   new (pending) plan;
5. election and takeover: the coordinator killed, one member stands (`election.stand`, the
   real vote round over N - 1 members' `Election.Vote` servers), wins, and takes the run over
   in this process (`CoordinatorService.take_over`, served by gRPC); every member joins it
   again with its plan epoch, then sends a heartbeat: the time of each part.

Prints a table and, with `--json`, writes every figure. Benchmarks only: nothing here is
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from ravnest_node.bench.sim_member import Latencies, SimMember
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.coordination.election import stand
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.proofs import provers

CPUS = sorted(os.sched_getaffinity(0))
COORDINATOR_CPUS = set(CPUS[:1])
MEMBER_CPUS = set(CPUS[1:] or CPUS)
MODEL = "llama-300m"
STAGES = 25
SWARM = "bench"
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def _coordinator(state_dir: Path, members: int) -> tuple[subprocess.Popen[bytes], str, str]:
    """A lab coordinator for `members` members, on COORDINATOR_CPUS: (process, address, id)."""
    args = [sys.executable, "-m", "ravnest_node", "coordinator", "--state-dir", str(state_dir),
            "--listen", "127.0.0.1:0", "--swarm-size", str(members), "--swarm-name", SWARM,
            "--model", MODEL, "--pipelines", str(members // STAGES), "--stages", str(STAGES),
            "--steps", "1000000", "--log-level", "warning"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAVNEST_")}
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=open(state_dir / "node.log", "ab"),  # noqa: SIM115
        stdin=subprocess.DEVNULL, preexec_fn=lambda: os.sched_setaffinity(0, COORDINATOR_CPUS),
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the coordinator did not start: see {state_dir / 'node.log'}")
    ready = json.loads(line)
    return proc, ready["address"], ready["node_id"]


def _spread(seconds: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of `seconds`, in milliseconds."""
    if not seconds:
        return {"n": 0, "p50_ms": math.nan, "p99_ms": math.nan, "max_ms": math.nan}
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"n": len(ordered), "p50_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * p99,
            "max_ms": 1e3 * ordered[-1]}  # fmt: skip


async def _timed(what: Awaitable[Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = await what
    return time.perf_counter() - started, result


async def _wait_for(condition: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until `condition` holds (polled every 10 ms: it reads members' state that no
    event gathers); inf after `timeout_s`."""
    started = time.perf_counter()
    while not condition():
        if time.perf_counter() - started > timeout_s:
            return math.inf
        await asyncio.sleep(0.01)
    return time.perf_counter() - started


async def measure(members: int, steady_s: float, step_s: float) -> dict[str, Any]:
    """Every figure of one swarm size (see the module's docstring)."""
    blocks = get_model(MODEL).num_blocks()
    rng = random.Random(members)  # members of a public swarm differ: GPUs 0.5x to 2x apart
    latencies = Latencies()
    sims = [SimMember(SWARM, [0.05 * rng.uniform(0.5, 2.0)] * blocks, latencies, step_s)
            for _ in range(members)]  # fmt: skip
    out: dict[str, Any] = {"members": members, "pipelines": members // STAGES, "stages": STAGES}
    with tempfile.TemporaryDirectory(prefix="ravnest-swarm-size-") as tmp:
        proc, address, coordinator_id = _coordinator(Path(tmp), members)
        try:
            await asyncio.gather(*(m.start() for m in sims))
            for m in sims:
                m.connect(address)
            cpu0 = _cpu_s(proc.pid)
            out["join_s"], joined = await _timed(asyncio.gather(*(m.join() for m in sims)))
            out["tell_s"], told = await _timed(asyncio.gather(*(m.tell() for m in sims)))
            out["join_cpu_s"] = _cpu_s(proc.pid) - cpu0
            for m in sims:
                m.run()
            out["plan_s"] = await _wait_for(lambda: all(m.plan is not None for m in sims), 120)
            out["joined"], out["told"] = sum(joined), sum(told)
            out["join"] = _spread(latencies.seconds["join"])
            out["join_with_capabilities"] = _spread(latencies.seconds["join with capabilities"])
            out["join_failures"] = dict(latencies.failed)
            plan = next((m.plan for m in sims if m.plan is not None), None)
            if plan is None or not math.isfinite(out["plan_s"]):
                got = sum(1 for m in sims if m.plan is not None)
                log = (Path(tmp) / "node.log").read_text(errors="replace").splitlines()
                tail = "\n".join(log[-15:])
                out["broke"] = (f"the plan reached {got} of {members} members; {out}; the "
                                f"coordinator's log ends:\n{tail}")  # fmt: skip
                return out
            out["plan_epoch"], out["plan_bytes"] = plan.epoch, plan.ByteSize()
            out["spares"] = sum(1 for m in sims if m.stage() is None)

            latencies.clear()
            cpu0, wall0, own0 = _cpu_s(proc.pid), time.perf_counter(), _cpu_s(os.getpid())
            await asyncio.sleep(steady_s)  # the steady phase: a measuring window, not a wait
            wall = time.perf_counter() - wall0
            out["steady_cpu_share"] = (_cpu_s(proc.pid) - cpu0) / wall
            # (The members' process: near 1, its own core is what makes the tail latencies.)
            out["members_cpu_share"] = (_cpu_s(os.getpid()) - own0) / wall
            out["rss_mib"] = _rss_mib(proc.pid)
            out["heartbeat"] = _spread(latencies.seconds["heartbeat"])
            out["report"] = _spread(latencies.seconds["report"])
            out["steady_failures"] = dict(latencies.failed)
            out["reports_per_s"] = len(latencies.seconds["report"]) / steady_s

            leaver = next(m for m in sims if m.stage() is not None)
            others = [m for m in sims if m is not leaver]
            epoch = plan.epoch
            started = time.perf_counter()
            await leaver.leave()
            await _wait_for(lambda: all(m.newest_epoch > epoch for m in others), 300)
            out["replan_s"] = time.perf_counter() - started  # (from the Leave's start)
            out["leave"] = _spread(latencies.seconds["leave"])
            await leaver.halt()
            out.update(await _failover(others, plan, coordinator_id, proc))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait()
            await asyncio.gather(*(m.stop() for m in sims), return_exceptions=True)
    return out


async def _failover(
    sims: list[SimMember], plan: pb.Plan, coordinator_id: str, proc: subprocess.Popen[bytes]
) -> dict[str, Any]:
    """The coordinator killed; an election among the members and a takeover (the module's
    docstring, item 5)."""
    out: dict[str, Any] = {}
    await asyncio.gather(*(m.halt() for m in sims))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for m in sims:
        m.following = ""  # (each lost it: its plan stream broke)
    candidate, voters = sims[0], sims[1:]
    channels: dict[str, grpc.aio.Channel] = {}

    async def ask(address: str, request: pb.VoteRequest) -> pb.VoteReply:
        channel = channels.setdefault(address, grpc.aio.insecure_channel(
            address, interceptors=provers(candidate.key)))  # the candidate proves it asks
        reply: pb.VoteReply = await pb_grpc.ElectionStub(channel).Vote(request, timeout=30)
        return reply

    swarm_size = len(sims) + 1  # (the plan's members and the leaver)
    out["vote_s"], term = await _timed(stand(
        book=candidate.votes, own_id=candidate.node_id, swarm=SWARM, swarm_size=swarm_size,
        voters=[(m.node_id, m.address) for m in voters], ask=ask, plan_epoch=plan.epoch,
    ))  # fmt: skip
    await asyncio.gather(*(c.close() for c in channels.values()))
    out["vote_won"] = term is not None
    if term is None:
        return out
    train = TrainConfig.from_proto(plan.run)
    service = CoordinatorService(train=train, swarm_size=swarm_size, swarm_id=f"{SWARM}/{MODEL}",
                                 summary_path=None, epoch=term,
                                 node_id=candidate.node_id)  # fmt: skip
    started = time.perf_counter()
    service.take_over(plan, {coordinator_id}, term)
    out["take_over_call_s"] = time.perf_counter() - started
    server = grpc.aio.server()
    pb_grpc.add_CoordinatorServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        latencies = sims[0].latencies  # (all members share one)
        latencies.clear()
        for m in sims:
            m.connect(f"127.0.0.1:{port}")
        out["rejoin_s"], back = await _timed(asyncio.gather(
            *(m.tell("join again", plan_epoch=plan.epoch) for m in sims)))  # fmt: skip
        out["rejoined"] = sum(back)
        out["rejoin_heartbeat_s"], _ = await _timed(asyncio.gather(*(m.beat() for m in sims)))
        out["rejoin"] = _spread(latencies.seconds["join again"])
        out["rejoin_failures"] = dict(latencies.failed)
        parts = ("vote_s", "take_over_call_s", "rejoin_s", "rejoin_heartbeat_s")
        out["election_and_takeover_s"] = sum(out[p] for p in parts)
    finally:
        await asyncio.gather(*(m.halt() for m in sims))
        await server.stop(0)
    return out


def _row(r: dict[str, Any]) -> str:
    if "broke" in r:
        return f"{r['members']:>7} {r['broke']}"
    return (
        f"{r['members']:>7} {r['join']['p50_ms']:8.1f} {r['join']['p99_ms']:8.1f} "
        f"{r['join_s']:7.2f} {r['plan_s']:7.2f} {r['plan_bytes'] / 1e3:8.1f} "
        f"{r['heartbeat']['p50_ms']:7.1f} {r['heartbeat']['p99_ms']:7.1f} "
        f"{r['report']['p50_ms']:7.1f} {r['report']['p99_ms']:7.1f} {r['reports_per_s']:7.0f} "
        f"{r['steady_cpu_share']:5.2f} {r['members_cpu_share']:5.2f} {r['rss_mib']:6.0f} "
        f"{r['replan_s']:7.2f} "
        f"{r.get('vote_s', math.nan):6.2f} {r.get('election_and_takeover_s', math.nan):7.2f}"
    )


HEADER = (
    "members  join50ms join99ms  joins_s  plan_s  plan_kB   hb50ms  hb99ms  rep50ms rep99ms "
    "reports/s  cpu  simcpu rssMiB replan_s vote_s  e+t_s"
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ravnest_node.bench.swarm_size",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--members", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--steady-s", type=float, default=30.0)
    parser.add_argument("--step-s", type=float, default=2.0,
                        help="seconds of one optimizer step (each stage reports once a step)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    bad = [n for n in args.members if n % STAGES or not STAGES <= n <= 1024]
    if bad:
        parser.error(f"--members must be multiples of {STAGES} up to 1024: {bad}")
    os.sched_setaffinity(0, MEMBER_CPUS)
    logging.getLogger("ravnest_node").setLevel(logging.ERROR)  # (the takeover's own lines)
    results = []
    print(HEADER)
    for n in args.members:
        result = asyncio.run(measure(n, args.steady_s, args.step_s))
        results.append(result)
        print(_row(result), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
