"""Electing a coordinator: the vote rules (pure), the candidate's round, and three real nodes
started alike that choose one among themselves over mDNS on loopback."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_node.bench.links import LinkSpec, NetnsSwarm
from ravnest_node.coordination.election import (
    Ballot,
    VoteBook,
    VoteState,
    grant_vote,
    majority,
    stand,
)
from ravnest_node.daemon.failover import electorate
from ravnest_node.errors import ConfigError, PeerRefused
from ravnest_node.proto import control_pb2 as pb

from .conftest import (
    NODE_ENV,
    Procs,
    node_status,
    poll_until,
    progress_events,
    ravnest,
    require_netns,
    swarm_view,
)


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


def after_plan(following: str = "") -> Ballot:
    """A voter of a failover: it trained plan epoch 3 and lost coordinator a; it sees nobody
    over mDNS (its cache may still hold a's record: it does not count)."""
    return Ballot(own_id="b", seen=frozenset(), following=following, plan_epoch=3,
                  lost=frozenset("a"))  # fmt: skip


@pytest.mark.parametrize(
    ("candidate", "epoch", "voter", "granted", "reason"),
    [
        ("c", 3, after_plan(), True, ""),  # neither seen over mDNS nor the smallest id
        ("c", 4, after_plan(), True, ""),
        ("c", 2, after_plan(), False, "knows plan epoch 2, this node 3"),
        ("c", 0, after_plan(), False, "knows plan epoch 0"),  # restarted, knows no plan
        ("a", 9, after_plan(), False, "the coordinator this node lost"),
        ("c", 3, after_plan(following="x:1"), False, "follows coordinator"),
    ],
)
def test_failover_vote_rules(
    candidate: str, epoch: int, voter: Ballot, granted: bool, reason: str
) -> None:
    new, ok, why = grant_vote(VoteState(1, "a"), 2, candidate, voter, epoch)
    assert ok is granted and reason in why
    assert new == (VoteState(2, candidate) if ok else VoteState(1, "a"))


def test_a_failovers_electorate_is_the_plans_members_less_the_lost_coordinator() -> None:
    plan = pb.Plan(epoch=4)
    for node_id, address in [("c", "c:1"), ("a", "a:1"), ("d", "d:1"), ("a", "a:1"), ("b", "x:9")]:
        plan.stages.add(node_id=node_id, address=address)
    # Lost: "b" by its node id, and "d", which holds the lost coordinator's address.
    e = electorate(plan, own_id="c", lost_id="b", lost_address="d:1")
    assert e.lost == {"b", "d"} and e.members == {"a": "a:1", "c": "c:1"}
    assert e.size == 4  # the majority counts the lost members too
    assert e.voters == (("a", "a:1"),) and e.rank == 1  # "a" stands first
    spare = electorate(plan, own_id="s", lost_id="b", lost_address="")
    assert spare.rank == len(spare.members) == 3 and len(spare.voters) == 3


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
    require_netns()
    swarm = f"bridge-{os.getpid()}"
    with NetnsSwarm(3, LinkSpec(rate_mbit=1000, delay_ms=0), name="rve") as net:
        nodes = [
            procs.start_node(
                tmp_path / f"n{i}", "--listen", f"{host.address}:7070", "--mdns",
                "--mdns-interface", host.address, "--swarm-name", swarm, "--swarm-size", "3",
                "--join", "elect", "--model", "tiny", "--steps", "2", prefix=net.exec_prefix(i),
            )
            for i, host in enumerate(net.hosts)
        ]  # fmt: skip

        def statuses() -> list[pb.NodeStatus]:
            return [node_status(ready["address"]) for _, ready in nodes]

        poll_until(lambda: all(s.plan_epoch for s in statuses()), 60)
        now = statuses()
        assert [s.role for s in now].count(pb.NODE_ROLE_COORDINATOR) == 1
        leader = next(s for s in now if s.role == pb.NODE_ROLE_COORDINATOR)
        assert all(s.mdns_peers == 2 for s in now)  # every node saw the other two over the bridge
        # Each pair of hosts measured its link once, both ways, before the plan.
        view = swarm_view(leader.address)
        pairs = [frozenset((m.node_id, p.node_id)) for m in view.members for p in m.peer_links]
        assert len(pairs) == len(set(pairs)) == 3
        assert all(p.to_bps > 1e6 and p.from_bps > 1e6 for m in view.members for p in m.peer_links)
        done = [e for e in progress_events(leader.address) if e.done]
        assert len(done) == 1 and not done[0].error
        for proc, _ in nodes:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(10) for proc, _ in nodes] == [0, 0, 0]


def test_the_elected_coordinator_killed_mid_run_is_replaced_by_a_new_election(
    procs: Procs, tmp_path: Path
) -> None:
    """Three nodes started alike elect a coordinator, which also trains a stage. Killed with
    SIGKILL mid-run, the other two elect one of themselves in a later term; it takes the run
    over from the plan they trained (a plan epoch above every earlier one), restores the lost
    stage from the copy of its checkpoint, and the run trains to its end."""
    swarm = f"failover-{os.getpid()}-{tmp_path.name}"
    same = ("--mdns", "--mdns-interface", "127.0.0.1", "--swarm-name", swarm, "--swarm-size",
            "3", "--join", "elect", "--model", "tiny", "--steps", "100", "--seed", "0",
            "--checkpoint-every", "10")  # fmt: skip
    nodes = [procs.start_node(tmp_path / f"n{i}", *same) for i in range(3)]
    by_id = {ready["node_id"]: (proc, ready) for proc, ready in nodes}
    poll_until(lambda: all(node_status(r["address"]).plan_epoch for _, r in nodes), 60)
    old = next(s for s in (node_status(r["address"]) for _, r in nodes)
               if s.role == pb.NODE_ROLE_COORDINATOR)  # fmt: skip
    old_epoch = old.plan_epoch
    for event in progress_events(old.address, timeout_s=300):
        if event.step >= 35:
            break
    by_id[old.node_id][0].send_signal(signal.SIGKILL)
    survivors = [r["address"] for n, (_, r) in by_id.items() if n != old.node_id]

    def leader() -> pb.NodeStatus | None:
        statuses = [node_status(a) for a in survivors]
        leaders = [s for s in statuses if s.role == pb.NODE_ROLE_COORDINATOR]
        return leaders[0] if len(leaders) == 1 else None

    poll_until(lambda: leader() is not None, 90)
    new = leader()
    assert new is not None and new.term > old.term
    assert new.coordinator_found_via == pb.FOUND_VIA_ELECTION
    poll_until(lambda: all(node_status(a).coordinator_address == new.address
                           for a in survivors), 30)  # fmt: skip
    done = [e for e in progress_events(new.address, timeout_s=300) if e.done]
    assert len(done) == 1 and not done[0].error
    summary = json.loads(done[0].summary_json)
    assert summary["takeover"] == {"term": new.term, "plan_epoch": old_epoch,
                                   "lost_coordinator": [old.node_id]}  # fmt: skip
    (restore,) = summary["restores"]
    # Killed after step 35 with a checkpoint every 10 steps: restored at 30 or later.
    assert 30 <= restore["restored_step"] == summary["resumed_at"] < 100
    assert [c["node_id"] for c in summary["crashes"]] == [old.node_id]
    assert all(p["epoch"] > old_epoch for p in summary["plans"][1:])
    assert old.node_id not in summary["plans"][-1]["stages"].__repr__()
    losses = summary["loss_history"]
    assert len(losses) == 100 - restore["restored_step"] and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 3.5  # still learning after the takeover (tiny starts near ln 256)
    print(f"term {old.term} -> {new.term}; restored at step {restore['restored_step']} in plan "
          f"epoch {restore['plan_epoch']}; final loss {losses[-1]:.3f}")  # fmt: skip
    for address in survivors:
        proc, _ = next(v for v in by_id.values() if v[1]["address"] == address)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_a_stale_coordinator_that_comes_back_steps_down(procs: Procs, tmp_path: Path) -> None:
    """The elected coordinator is paused (SIGSTOP: its sockets stay open, it answers nothing)
    until the others have elected a successor, then resumed. It still holds its term's plan
    and calls itself the coordinator; nobody follows it, it learns of the higher term from
    the members and steps down (exit status 1, saying so), and the run ends under the new
    coordinator."""
    swarm = f"stale-{os.getpid()}-{tmp_path.name}"
    # A lease of 3 s: the hang is noticed after 6 s of failed heartbeats, not 12.
    same = ("--mdns", "--mdns-interface", "127.0.0.1", "--swarm-name", swarm, "--swarm-size",
            "3", "--join", "elect", "--model", "tiny", "--steps", "120", "--seed", "0",
            "--checkpoint-every", "10", "--lease-s", "3")  # fmt: skip
    nodes = [procs.start_node(tmp_path / f"n{i}", *same) for i in range(3)]
    poll_until(lambda: all(node_status(r["address"]).plan_epoch for _, r in nodes), 60)
    old = next(s for s in (node_status(r["address"]) for _, r in nodes)
               if s.role == pb.NODE_ROLE_COORDINATOR)  # fmt: skip
    for event in progress_events(old.address, timeout_s=300):
        if event.step >= 25:
            break
    index = next(i for i, (_, r) in enumerate(nodes) if r["node_id"] == old.node_id)
    stale = nodes[index][0]
    survivors = [r["address"] for i, (_, r) in enumerate(nodes) if i != index]
    stale.send_signal(signal.SIGSTOP)
    try:
        poll_until(lambda: any(node_status(a).role == pb.NODE_ROLE_COORDINATOR
                               for a in survivors), 120)  # fmt: skip
    finally:
        stale.send_signal(signal.SIGCONT)
    new = next(s for s in map(node_status, survivors) if s.role == pb.NODE_ROLE_COORDINATOR)
    assert new.term > old.term
    assert stale.wait(60) == 1
    log = (tmp_path / f"n{index}" / "node.log").read_text()
    assert f"this node led term {old.term} as coordinator" in log and "steps down" in log
    done = [e for e in progress_events(new.address, timeout_s=300) if e.done]
    assert len(done) == 1 and not done[0].error
    summary = json.loads(done[0].summary_json)
    assert summary["takeover"]["lost_coordinator"] == [old.node_id]
    assert old.node_id not in {s[4] for p in summary["plans"][1:] for s in p["stages"]}
    assert all(node_status(a).coordinator_address == new.address for a in survivors)
    for i, (proc, _) in enumerate(nodes):
        if i != index:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0
