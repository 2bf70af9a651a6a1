"""Home networks flap (issue #34), across real processes in network namespaces: a link that
drops costs time, never the run, and no daemon exits because of it. Three nodes on capped links
(bench/links.py NetnsSwarm), one pipeline without replicas; the fault hits the node that owns
the middle stage once its stage reaches a step."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc

from ravnest_node.bench import links
from ravnest_node.bench.links import LinkSpec, NetnsSwarm
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc

from .conftest import Procs, poll_until, require_netns

TEST_NAME = "rvflaps"
PORT = 7070
BATCH = 16
STEPS = 800
CUT_STEP = 40
"""The fault hits at this step of the middle stage, after its checkpoint copies of steps 10 to 30
had their time (they go at a fifth of the measured link: checkpoint_copies.COPY_SHARE)."""
DOWN_S = 60.0
RUN = ("--model", "tiny", "--steps", str(STEPS), "--checkpoint-every", "10", "--seed", "0",
       "--batch-size", str(BATCH))  # fmt: skip
FAULT_BLOCK_MS = 10
"""The run is slowed (a sleep a block and microbatch: not CPU-bound) so that it is still going
when the link comes back."""
MINUTE_FAULT_BLOCK_MS = 25
"""The same for the minute-long cut: at 10 ms the two nodes left finished the run during the
outage (CI, 2026-12-04)."""


def status(address: str) -> pb.NodeStatus | None:
    """The node's status, or None if it does not answer within a second (cut off)."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply: pb.NodeStatus = pb_grpc.NodeStub(channel).Status(pb.StatusRequest(), timeout=1)
            return reply
    except grpc.RpcError:
        return None


def start_swarm(
    procs: Procs, net: NetnsSwarm, tmp_path: Path, fault_block_ms: int = FAULT_BLOCK_MS
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    addresses = [f"{h.address}:{PORT}" for h in net.hosts]
    nodes = []
    for i in range(3):
        run = (*RUN, "--fault-block-ms", str(fault_block_ms))
        role = ("--swarm-size", "3", *run) if i == 0 else ("--join", addresses[0])
        proc, _ = procs.start_node(tmp_path / f"n{i}", "--listen", addresses[i], *role,
                                   prefix=net.exec_prefix(i))  # fmt: skip
        nodes.append(proc)
    return nodes, addresses


def middle_at_cut_step(addresses: list[str]) -> int:
    """Which node owns the middle stage of the first plan, once that stage reaches CUT_STEP."""
    middle: list[int] = []

    def reached() -> bool:
        for i, address in enumerate(addresses):
            s = status(address)
            if s is not None and s.plan_epoch == 1 and s.stage == 1:
                middle[:] = [i]
                return s.version >= CUT_STEP
        return False

    poll_until(reached, 120)
    return middle[0]


def test_a_middle_node_cut_off_for_a_minute_comes_back_and_the_run_finishes(
    procs: Procs, tmp_path: Path
) -> None:
    """The middle node's link is down for 60 s: its neighbours' streams break, the coordinator
    counts it lost and restores the run from checkpoints on the two others; the cut node waits
    (no exit), and once its link is back it is heard again and gets a stage in a later plan.
    The run reaches its last step with every sample counted once, and every daemon is still
    running at the end (a SIGTERM then stops each, exit 0)."""
    require_netns()
    links.remove_leftovers(TEST_NAME)  # of a run killed before its teardown
    with NetnsSwarm(3, LinkSpec(50, 0), name=TEST_NAME) as net:
        nodes, addresses = start_swarm(procs, net, tmp_path, MINUTE_FAULT_BLOCK_MS)
        cut = middle_at_cut_step(addresses)
        net.link_down(cut)
        down_at = time.monotonic()
        try:
            poll_until(
                lambda: time.monotonic() - down_at >= DOWN_S or nodes[cut].poll() is not None,
                DOWN_S + 5,
            )
            assert nodes[cut].poll() is None, "the cut node exited during the outage"
        finally:
            net.link_up(cut)
        summary_path = tmp_path / "n0" / "summary.json"
        assert not summary_path.exists(), "the run ended during the outage: slow it further"
        poll_until(lambda: summary_path.exists() or any(p.poll() is not None for p in nodes), 300)
        exits = [p.poll() for p in nodes]
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        assert exits == [None, None, None], (exits, _log_tails(tmp_path))
        for proc in nodes:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(60) for proc in nodes] == [0, 0, 0]
    assert summary["steps"] == STEPS
    assert summary["samples"] == STEPS * BATCH
    plans = [(p["epoch"], p["start_step"], p["nodes"]) for p in summary["plans"]]
    print(f"plans (epoch, start step, nodes): {plans}; redone microbatches "
          f"{summary['redone_microbatches']}")  # fmt: skip
    assert plans[0][2] == 3 and plans[1][2] == 2  # the restore without the cut node
    assert [r["restored_step"] for r in summary["restores"]][:1] == [plans[1][1]]
    assert plans[-1][2] == 3, "the cut node never trained again"


def _log_tails(tmp_path: Path) -> str:
    return "\n".join(
        f"--- n{i}:\n" + (tmp_path / f"n{i}" / "node.log").read_text()[-3000:] for i in range(3)
    )


def test_a_middle_node_cut_off_for_ten_seconds_resumes_its_streams(
    procs: Procs, tmp_path: Path
) -> None:
    """The middle node's link is down for 10 s, shorter than the hold window (two leases): the
    boundary streams break (TCP gives up after 10 s of unacknowledged data) and are resumed
    when the link is back, each side sending again what the other lacks. Nobody is counted
    lost: the run finishes under its first plan, nothing redone, every sample counted once,
    and the stages report the resumes and the frames sent again."""
    require_netns()
    links.remove_leftovers(TEST_NAME)
    with NetnsSwarm(3, LinkSpec(50, 0), name=TEST_NAME) as net:
        nodes, addresses = start_swarm(procs, net, tmp_path)
        cut = middle_at_cut_step(addresses)
        net.flap(cut, 10.0)
        summary_path = tmp_path / "n0" / "summary.json"
        poll_until(lambda: summary_path.exists() or any(p.poll() is not None for p in nodes), 150)
        exits = [p.poll() for p in nodes]
        assert exits == [None, None, None], (exits, _log_tails(tmp_path))
        summary: dict[str, Any] = json.loads(summary_path.read_text())
        for proc in nodes:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(60) for proc in nodes] == [0, 0, 0]
    assert summary["steps"] == STEPS and summary["samples"] == STEPS * BATCH
    plans = [(p["epoch"], p["start_step"], p["nodes"]) for p in summary["plans"]]
    assert plans == [(1, 0, 3)], (plans, _log_tails(tmp_path))
    assert summary["redone_microbatches"] == 0
    stages = summary["stages"]
    print("resumes and frames sent again per stage:",
          [(s["stream_resumes"], s["frames_resent"]) for s in stages])  # fmt: skip
    assert sum(s["stream_resumes"] for s in stages) >= 2  # both of the middle node's streams
