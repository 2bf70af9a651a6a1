"""Electing a coordinator: the vote rules (pure), the candidate's round, and three real nodes
started alike that choose one among themselves over mDNS on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_node.bench.links import LinkSpec, NetnsSwarm, netns_available
from ravnest_node.coordination.election import (
    Ballot,
    VoteBook,
    VoteState,
    grant_vote,
    majority,
    stand,
)
from ravnest_node.errors import ConfigError, PeerRefused
from ravnest_node.proto import control_pb2 as pb

from .conftest import NODE_ENV, Procs, node_status, poll_until, progress_events, ravnest, read_line


def ballot(own: str = "b", seen: str = "ac", following: str = "") -> Ballot:
    return Ballot(own_id=own, seen=frozenset(seen), following=following)


@pytest.mark.parametrize(
    ("state", "term", "candidate", "voter", "granted", "reason"),
    [
        (VoteState(), 1, "a", ballot(), True, ""),
        (VoteState(1, "a"), 1, "a", ballot(), True, ""),  # the same vote again
        (VoteState(1, "a"), 2, "a", ballot(), True, ""),
        (VoteState(3), 2, "a", ballot(), False, "behind"),
        (VoteState(), 1, "a", ballot(following="x:1"), False, "follows coordinator"),
        (VoteState(), 1, "a", ballot(seen="c"), False, "does not see the candidate"),
        (VoteState(), 1, "c", ballot(), False, "smaller node id (a)"),
        (VoteState(1, "c"), 1, "a", ballot(), False, "voted for c in term 1"),
    ],
)
def test_vote_rules(
    state: VoteState, term: int, candidate: str, voter: Ballot, granted: bool, reason: str
) -> None:
    new, ok, why = grant_vote(state, term, candidate, voter)
    assert ok is granted and reason in why
    assert new == (VoteState(term, candidate) if ok else state)


def test_a_majority_is_more_than_half() -> None:
    assert [majority(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


@given(
    size=st.integers(2, 7),
    views=st.data(),
    order=st.randoms(use_true_random=False),
)
@settings(max_examples=200, deadline=None)
def test_two_candidates_never_both_win_one_term(size: int, views: st.DataObject, order) -> None:  # type: ignore[no-untyped-def]
    """Whatever each voter sees and whatever order the requests arrive in."""
    ids = [f"n{i}" for i in range(size)]
    seen = {
        v: frozenset(views.draw(st.sets(st.sampled_from([i for i in ids if i != v])))) for v in ids
    }
    states = {v: VoteState() for v in ids}
    a, b = ids[0], ids[1]
    votes = {a: 0, b: 0}
    for candidate in (a, b):  # each candidate votes for itself first
        states[candidate] = VoteState(1, candidate)
        votes[candidate] += 1
    requests = [(c, v) for c in (a, b) for v in ids if v != c]
    order.shuffle(requests)
    for candidate, voter in requests:
        states[voter], ok, _ = grant_vote(
            states[voter], 1, candidate, Ballot(voter, seen[voter], following="")
        )
        votes[candidate] += ok
    assert not (votes[a] >= majority(size) and votes[b] >= majority(size))


def test_the_vote_is_kept_on_disk_and_a_corrupt_record_is_refused(tmp_path: Path) -> None:
    book = VoteBook(tmp_path)
    book.record(VoteState(4, "abc"))
    assert VoteBook(tmp_path).state == VoteState(4, "abc")  # a restart votes no twice
    (tmp_path / "vote.json").write_text('{"term": "x"')
    with pytest.raises(ConfigError, match="not a vote record"):
        VoteBook(tmp_path)
    assert VoteBook(None).state == VoteState()


async def test_a_candidate_wins_only_with_a_majority_and_records_its_own_vote_first(
    tmp_path: Path,
) -> None:
    book = VoteBook(tmp_path)
    asked: list[tuple[str, int, VoteState]] = []

    def voter(granted: bool, term: int = 0):  # type: ignore[no-untyped-def]
        async def ask(address: str, request: pb.VoteRequest) -> pb.VoteReply:
            asked.append((address, request.term, VoteBook(tmp_path).state))
            return pb.VoteReply(term=term or request.term, granted=granted)

        return ask

    common = {"book": book, "own_id": "a", "swarm": "s", "swarm_size": 3}
    voters = [("b", "b:1"), ("c", "c:1")]
    assert await stand(**common, voters=voters, ask=voter(True)) == 1
    assert all(state == VoteState(1, "a") for _, _, state in asked)  # on disk before asking
    assert await stand(**common, voters=voters, ask=voter(False)) is None
    assert book.state == VoteState(2, "a")

    async def down(address: str, request: pb.VoteRequest) -> pb.VoteReply:
        raise PeerRefused("UNAVAILABLE")

    assert await stand(**common, voters=voters, ask=down) is None
    # A voter already in a later term: the candidate moves to it and does not win.
    assert await stand(**common, voters=voters, ask=voter(True, term=9)) is None
    assert book.state.term == 9


# ----- real node processes ------------------------------------------------------------------------
def test_three_nodes_started_alike_elect_one_coordinator_and_train(
    procs: Procs, tmp_path: Path
) -> None:
    swarm = f"elect-{os.getpid()}-{tmp_path.name}"
    same = ("--mdns", "--mdns-interface", "127.0.0.1", "--swarm-name", swarm, "--swarm-size",
            "3", "--join", "elect", "--model", "tiny", "--steps", "3")  # fmt: skip
    nodes = [procs.start_node(tmp_path / f"n{i}", *same) for i in range(3)]
    assert not any(ready["coordinator"] for _, ready in nodes)  # nobody was told

    def statuses() -> list[pb.NodeStatus]:
        return [node_status(ready["address"]) for _, ready in nodes]

    poll_until(lambda: all(s.plan_epoch for s in statuses()), 60)
    statuses_now = statuses()
    roles = [s.role for s in statuses_now]
    assert roles.count(pb.NODE_ROLE_COORDINATOR) == 1
    leader = statuses_now[roles.index(pb.NODE_ROLE_COORDINATOR)]
    assert leader.node_id == min(s.node_id for s in statuses_now)  # the smallest id stands
    assert leader.coordinator_found_via == pb.FOUND_VIA_ELECTION
    assert {s.coordinator_address for s in statuses_now} == {leader.address}
    assert {s.plan_epoch for s in statuses_now} == {leader.term}  # the plan carries the term
    done = [e for e in progress_events(leader.address) if e.done]
    assert len(done) == 1 and not done[0].error
    view = json.loads(subprocess.run(
        ravnest("status", "--swarm", swarm, "--mdns-interface", "127.0.0.1", "--json"),
        env=NODE_ENV, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        check=True,
    ).stdout)  # fmt: skip
    assert view["coordinator"]["address"] == leader.address
    assert sorted(m["stage"] for m in view["members"]) == [0, 1, 2]
    leader_dir = next(tmp_path / f"n{i}" for i, (_, r) in enumerate(nodes)
                      if r["node_id"] == leader.node_id)  # fmt: skip
    assert json.loads((leader_dir / "vote.json").read_text())["voted_for"] == leader.node_id
    for proc, _ in nodes:
        proc.send_signal(signal.SIGTERM)
    assert [proc.wait(10) for proc, _ in nodes] == [0, 0, 0]


def test_three_hosts_on_a_bridge_elect_over_multicast(procs: Procs, tmp_path: Path) -> None:
    """The same across network namespaces: each node in its own namespace, mDNS on its own
    interface, multicast crossing a real Linux bridge."""
    ok, reason = netns_available()
    if not ok:
        pytest.skip(reason)
    swarm = f"bridge-{os.getpid()}"
    with NetnsSwarm(3, LinkSpec(rate_mbit=1000, delay_ms=0), name="rve") as net:
        nodes = []
        for i, host in enumerate(net.hosts):
            state = tmp_path / f"n{i}"
            state.mkdir()
            log = open(state / "node.log", "ab")  # noqa: SIM115 - closed by the child's exit
            proc = procs.popen(
                net.exec_prefix(i) + ravnest(
                    "start", "--listen", f"{host.address}:7070", "--state-dir", str(state),
                    "--threads", "1", "--mdns", "--mdns-interface", host.address, "--swarm-name",
                    swarm, "--swarm-size", "3", "--join", "elect", "--model", "tiny",
                    "--steps", "2",
                ),
                stderr=log,
            )  # fmt: skip
            log.close()
            line = read_line(proc, 60)
            assert line, (state / "node.log").read_text()
            nodes.append((proc, json.loads(line)))

        def statuses() -> list[pb.NodeStatus]:
            return [node_status(ready["address"]) for _, ready in nodes]

        poll_until(lambda: all(s.plan_epoch for s in statuses()), 60)
        now = statuses()
        assert [s.role for s in now].count(pb.NODE_ROLE_COORDINATOR) == 1
        leader = next(s for s in now if s.role == pb.NODE_ROLE_COORDINATOR)
        assert all(s.mdns_peers == 2 for s in now)  # every node saw the other two over the bridge
        done = [e for e in progress_events(leader.address) if e.done]
        assert len(done) == 1 and not done[0].error
        for proc, _ in nodes:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(10) for proc, _ in nodes] == [0, 0, 0]
