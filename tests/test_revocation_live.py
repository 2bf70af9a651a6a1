"""Shutting one member of a protected swarm out, across real processes (issue #35, item 2):
`init-swarm --members 4` certifies four node keys; four node processes started from their
member directories train two pipelines over mutual TLS; a node started from the authority's
own directory (the swarm's TLS credentials, no node certificate) is refused. Mid-run,
`ravnest-node revoke ID --coordinator` shuts one member out: the coordinator bans it and
re-plans, the revoked daemon stops (exit status 3), every other node receives the signed list
with the plan and refuses the revoked member's calls from then on, and the run finishes on the
three others. Unit tests: tests/test_revocation.py."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import grpc

from ravnest_node.identity import NodeKey
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.membership import REVOKED, REVOKED_FILE
from ravnest_node.transport.options import TransportConfig, grpc_sync_channel
from ravnest_node.transport.proofs import request_digest

from .conftest import NODE_ENV, Procs, poll_until, progress_events, ravnest

STEPS = 300


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(ravnest(*args), env=NODE_ENV, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip


def _as_revoked(member_dir: Path, address: str, coordinator: bool) -> tuple[str, str]:
    """A call the revoked member makes with its own key, certificate and TLS credentials:
    its status code and details."""
    key = NodeKey.load_or_create(member_dir)
    cfg = TransportConfig(swarm_dir=member_dir)
    with grpc_sync_channel(address, cfg) as channel:
        try:
            if coordinator:
                request = pb.HeartbeatRequest(node_id=key.node_id)
                method = "/ravnest.v1.Coordinator/Heartbeat"
                proof = key.prove(method, request_digest(request))
                pb_grpc.CoordinatorStub(channel).Heartbeat(
                    request, metadata=(("ravnest-node-proof", proof),), timeout=30
                )
            else:
                block = pb.BlockRequest(node_id=key.node_id, plan_epoch=1, block=0)
                proof = key.prove("/ravnest.v1.Node/FetchBlock", request_digest(block))
                list(pb_grpc.NodeStub(channel).FetchBlock(
                    block, metadata=(("ravnest-node-proof", proof),), timeout=30))  # fmt: skip
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
    return "OK", ""


def test_a_revoked_member_is_banned_and_refused_by_every_node(
    procs: Procs, tmp_path: Path
) -> None:
    authority = tmp_path / "lab"
    made = _cli("init-swarm", "lab", "--out", str(authority), "--members", "4")
    assert made.returncode == 0, made.stderr
    members = sorted((authority / "members").iterdir())
    assert len(members) == 4
    run = ("--model", "tiny", "--steps", str(STEPS), "--pipelines", "2", "--seed", "0",
           "--fault-block-ms", "4")  # fmt: skip
    nodes = {}
    proc, ready = procs.start_node(tmp_path / "n0", "--swarm-dir", str(members[0]),
                                   "--swarm-size", "4", *run)  # fmt: skip
    coordinator = ready["address"]
    nodes[ready["node_id"]] = (proc, ready, tmp_path / "n0")
    assert ready["node_id"] == members[0].name  # the member directory's key is its identity
    # The swarm's TLS credentials without a node certificate: refused at its Join.
    stray, _ = procs.start_node(tmp_path / "stray", "--swarm-dir", str(authority), "--join",
                                coordinator)  # fmt: skip
    for i, home in enumerate(members[1:], start=1):
        proc, ready = procs.start_node(tmp_path / f"n{i}", "--swarm-dir", str(home), "--join",
                                       coordinator)  # fmt: skip
        nodes[ready["node_id"]] = (proc, ready, tmp_path / f"n{i}")
    assert stray.wait(120) != 0
    stray_log = (tmp_path / "stray" / "node.log").read_text()
    assert "PERMISSION_DENIED" in stray_log and "no node certificate" in stray_log, stray_log

    transport = TransportConfig(swarm_dir=members[0])
    events = progress_events(coordinator, timeout_s=300, transport=transport)
    next(e for e in events if e.step >= 10)  # training, all four planned
    revoked_id = members[3].name
    revoked_proc, _, _ = nodes[revoked_id]
    told = _cli("revoke", revoked_id, "--swarm-dir", str(authority), "--coordinator", coordinator)
    assert told.returncode == 0, told.stderr
    assert f"banned: {revoked_id}" in told.stdout
    assert revoked_proc.wait(120) == 3  # it saw itself banned in the plan, and stopped

    others = {n: v for n, v in nodes.items() if n != revoked_id}
    for _, _, state_dir in others.values():  # the signed list came with the plan
        poll_until(lambda d=state_dir: (d / REVOKED_FILE).exists(), 60)
        assert (state_dir / REVOKED_FILE).read_bytes() == (authority / REVOKED_FILE).read_bytes()
    for node_id, (_, ready, _) in others.items():
        code, details = _as_revoked(members[3], ready["address"], node_id == members[0].name)
        assert code == "PERMISSION_DENIED" and REVOKED in details, (node_id, code, details)
        log = (tmp_path / f"n{members.index(next(m for m in members if m.name == node_id))}"
               / "node.log").read_text()  # fmt: skip
        assert f"refused a call from revoked node {revoked_id}" in log

    done = next(e for e in events if e.done)
    assert not done.error
    summary = json.loads(done.summary_json)
    assert summary["steps"] == STEPS
    [ban] = summary["banned"]
    assert ban["node_id"] == revoked_id and "revoked by the swarm's authority" in ban["reason"]
    assert all(revoked_id not in [s[4] for s in p["stages"]] for p in summary["plans"][1:])
    for proc, _, _ in others.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    assert [proc.wait(60) for proc, _, _ in others.values()] == [0, 0, 0]
