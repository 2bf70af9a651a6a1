"""Discovery: TXT records are hostile hints; mDNS on 127.0.0.1 finds a swarm and nothing else;
workers with no coordinator address find it over mDNS or through a bootstrap peer."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from zeroconf import DNSOutgoing, DNSQuestion, const
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from ravnest_node import settings
from ravnest_node.cli.main import _parser, main
from ravnest_node.coordination.locate import AskStatus, Found, locate_coordinator
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.discovery import (
    SERVICE_TYPE,
    Advertisement,
    Ignored,
    MdnsDiscovery,
    PeerRecord,
    Role,
    StaticDiscovery,
    TxtRecord,
    encode_txt,
    parse_txt,
    peer_addresses,
)
from ravnest_node.discovery.records import MAX_ADDRESSES
from ravnest_node.errors import ConfigError, PeerUnavailable
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL
from ravnest_node.transport.options import split_host_port

from .conftest import NODE_ENV, Procs, node_status, poll_until, progress_events, ravnest

SWARM = "lab"
LOOPBACK = ("--mdns", "--mdns-interface", "127.0.0.1")


def unique_swarm() -> str:
    """A swarm name no other test run on this machine uses (mDNS on 127.0.0.1 is shared)."""
    return f"test-{secrets.token_hex(6)}"


def txt(**changes: bytes | None) -> dict[bytes, bytes | None]:
    base: dict[bytes, bytes | None] = {
        b"swarm": SWARM.encode(),
        b"node": b"node-1",
        b"proto": PROTOCOL.encode(),
        b"role": b"coordinator",
    }
    for key, value in changes.items():
        if value is None and key.endswith("_absent"):
            base.pop(key.removesuffix("_absent").encode())
        else:
            base[key.encode()] = value
    return base


# ----- TXT records: pure -------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["coordinator", "worker"])
def test_txt_round_trips(role: Role) -> None:
    record = TxtRecord(swarm=SWARM, node_id="a1b2", protocol=PROTOCOL, role=role)
    wire = {k.encode(): v.encode() for k, v in encode_txt(record).items()}
    assert parse_txt(wire, swarm=SWARM, protocol=PROTOCOL) == record


@pytest.mark.parametrize(
    ("properties", "reason"),
    [
        (txt(role_absent=None), "missing: role"),
        (txt(node=b"\xff\xfe"), "not UTF-8"),
        (txt(swarm=None), "has no value"),
        (txt(node=b"x" * 300), "300 bytes"),
        (txt(**{f"k{i}": b"" for i in range(20)}), "TXT keys (at most"),
        (txt(proto=b"ravnest.v0"), "protocol 'ravnest.v0'"),
        (txt(swarm=b"other"), "another swarm ('other')"),
        (txt(node=b"../etc/passwd"), "node id"),
        (txt(role=b"king"), "role 'king'"),
        (txt(swarm=b"lab\n"), "control characters"),
        ([(b"swarm", b"lab")], "not a mapping"),
        ({"swarm": "lab"}, "not a short byte string"),
    ],
)
def test_hostile_txt_is_ignored_with_a_reason(properties: object, reason: str) -> None:
    result = parse_txt(properties, swarm=SWARM, protocol=PROTOCOL)
    assert isinstance(result, Ignored)
    assert reason in result.reason


def test_unknown_txt_keys_are_allowed() -> None:
    assert isinstance(parse_txt(txt(later=b"1"), swarm=SWARM, protocol=PROTOCOL), TxtRecord)


_any_txt = st.dictionaries(
    st.sampled_from([b"swarm", b"node", b"proto", b"role", b"ROLE"]) | st.binary(max_size=40),
    st.none() | st.sampled_from([SWARM.encode(), b"worker", PROTOCOL.encode()]) | st.binary(),
    max_size=24,
)


@given(_any_txt)
def test_any_txt_is_a_record_or_a_reason(properties: dict[bytes, bytes | None]) -> None:
    result = parse_txt(properties, swarm=SWARM, protocol=PROTOCOL)
    assert isinstance(result, TxtRecord | Ignored)
    if isinstance(result, TxtRecord):
        assert (result.swarm, result.protocol) == (SWARM, PROTOCOL)
        assert result.role in ("coordinator", "worker")


@given(
    st.lists(st.text(max_size=50) | st.ip_addresses().map(str) | st.integers(), max_size=40)
    | st.text()
    | st.none(),
    st.integers(-5, 70_000) | st.none() | st.text(max_size=5),
)
def test_any_addresses_are_addresses_or_a_reason(ips: object, port: object) -> None:
    result = peer_addresses(ips, port)
    if not isinstance(result, Ignored):
        assert 0 < len(result) <= MAX_ADDRESSES
        for address in result:
            split_host_port(address)


def test_addresses_put_ipv4_first_and_drop_unusable_ones() -> None:
    ips = ["::1", "127.0.0.1", "fe80::1", "0.0.0.0", "224.0.0.251", "bogus", "127.0.0.1"]
    assert peer_addresses(ips, 7070) == ("127.0.0.1:7070", "[::1]:7070")
    assert isinstance(peer_addresses(ips, 0), Ignored)
    assert isinstance(peer_addresses(["fe80::1"], 7070), Ignored)


# ----- config ------------------------------------------------------------------------------------
def test_peers_come_from_repeated_flags_the_environment_and_toml(tmp_path: Path) -> None:
    args = _parser().parse_args(["start", "--peer", "10.0.0.1:7070", "--peer", "[::1]:7071"])
    cfg = settings.load(NodeConfig, args=args, env={})
    assert cfg.discovery.peers == ("10.0.0.1:7070", "[::1]:7071")
    assert not cfg.discovery.is_coordinator and cfg.discovery.finds_coordinator
    env = settings.load(NodeConfig, env={"RAVNEST_PEERS": "10.0.0.1:7070, [::1]:7071"})
    assert env.discovery.peers == cfg.discovery.peers
    again = settings.load(NodeConfig, env=settings.to_env(cfg))
    assert again.discovery.peers == cfg.discovery.peers
    path = tmp_path / "node.toml"
    path.write_text('peers = ["10.0.0.1:7070"]\nmdns = true\njoin = "auto"\n')
    toml = settings.load(NodeConfig, env={}, toml_path=path)
    assert toml.discovery.peers == ("10.0.0.1:7070",) and toml.discovery.mdns
    assert toml.discovery.finds_coordinator
    plain = settings.load(NodeConfig, env={})
    assert plain.discovery.is_coordinator and not plain.discovery.mdns
    assert plain.discovery.peers == ()


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"join": "auto"}, "add --mdns (on a LAN) or --peer HOST:PORT"),
        ({"join": "elect"}, "among the nodes found over mDNS: add --mdns"),
        ({"peers": ("nowhere",)}, "is not HOST:PORT"),
        ({"peers": ("10.0.0.1:0",)}, "needs a real port"),
        ({"mdns": True, "mdns_interface": "eth0"}, "must be an IP address"),
        ({"swarm_name": ""}, "swarm_name=''"),
        ({"swarm_name": "a=b"}, "without '='"),
    ],
)
def test_bad_discovery_settings_say_what_is_wrong(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        settings.load(NodeConfig, env={}, overrides=changes)
    assert needle in str(info.value)


def test_status_of_a_bad_or_silent_address_fails_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["status", "nowhere"]) == 2
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["status", f"127.0.0.1:{port}", "--timeout-s", "0.5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "ravnest-node: error: 'nowhere' is not HOST:PORT (e.g. 127.0.0.1:7070, port 0 = any)",
        f"ravnest-node: status: no answer from 127.0.0.1:{port} (UNAVAILABLE); a protected "
        "swarm's node answers only with its credentials: --swarm-dir DIR",
    ]


# ----- locating the coordinator: fakes at the boundaries ----------------------------------------
def _record(node_id: str, role: Role, *addresses: str) -> PeerRecord:
    txt_record = TxtRecord(swarm=SWARM, node_id=node_id, protocol=PROTOCOL, role=role)
    return PeerRecord(txt=txt_record, addresses=addresses)


def _asker(nodes: Mapping[str, pb.NodeStatus]) -> AskStatus:
    async def ask(address: str, timeout_s: float) -> pb.NodeStatus:
        if address not in nodes:
            raise PeerUnavailable(f"UNAVAILABLE: nothing listens on {address}")
        return nodes[address]

    return ask


COORDINATOR = pb.NodeStatus(
    node_id="boss", swarm_name=SWARM, role=pb.NODE_ROLE_COORDINATOR, coordinator_address="c:1"
)


async def test_an_mdns_record_is_used_once_its_node_confirms_it() -> None:
    hints = StaticDiscovery(
        [_record("boss", "coordinator", "dead:9", "c:1"), _record("w", "worker", "w:1")]
    )
    found = await locate_coordinator(
        swarm=SWARM, discovery=hints, peers=[], ask=_asker({"c:1": COORDINATOR}), timeout_s=5
    )
    assert found == Found("c:1", pb.FOUND_VIA_MDNS, "boss", node_id="boss")


async def test_of_two_coordinators_the_one_of_the_higher_term_is_followed() -> None:
    """A deposed coordinator that came back still says it is one until it steps down."""
    stale = pb.NodeStatus(node_id="a", swarm_name=SWARM, role=pb.NODE_ROLE_COORDINATOR, term=1)
    new = pb.NodeStatus(node_id="b", swarm_name=SWARM, role=pb.NODE_ROLE_COORDINATOR, term=2)
    hints = StaticDiscovery(
        [_record("a", "coordinator", "a:1"), _record("b", "coordinator", "b:1")]
    )
    ask = _asker({"a:1": stale, "b:1": new})
    found = await locate_coordinator(swarm=SWARM, discovery=hints, peers=[], ask=ask, timeout_s=5)
    assert found == Found("b:1", pb.FOUND_VIA_MDNS, "b", term=2, node_id="b")


async def test_a_record_its_node_contradicts_is_not_used() -> None:
    impostor = pb.NodeStatus(node_id="boss", swarm_name=SWARM, role=pb.NODE_ROLE_WORKER)
    other = pb.NodeStatus(node_id="x", swarm_name=SWARM, role=pb.NODE_ROLE_COORDINATOR)
    hints = StaticDiscovery(
        [_record("boss", "coordinator", "c:1"), _record("y", "coordinator", "c:2")]
    )
    with pytest.raises(PeerUnavailable) as info:
        await locate_coordinator(
            swarm=SWARM, discovery=hints, peers=[], ask=_asker({"c:1": impostor, "c:2": other}),
            timeout_s=0.3,
        )  # fmt: skip
    message = str(info.value)
    assert "found no coordinator of swarm 'lab' within 0.3 s" in message
    assert "mDNS coordinator boss at c:1: it is not a coordinator" in message
    assert "it is node 'x', not 'y' as advertised" in message


async def test_a_worker_peer_names_the_coordinator() -> None:
    worker = pb.NodeStatus(
        node_id="w", swarm_name=SWARM, role=pb.NODE_ROLE_WORKER, coordinator_address="c:1"
    )
    ask = _asker({"w:1": worker, "c:1": COORDINATOR})
    found = await locate_coordinator(
        swarm=SWARM, discovery=None, peers=["gone:1", "w:1"], ask=ask, timeout_s=5
    )
    assert found == Found("c:1", pb.FOUND_VIA_PEER, "w:1", node_id="boss")
    direct = await locate_coordinator(
        swarm=SWARM, discovery=None, peers=["c:1"], ask=ask, timeout_s=5
    )
    assert direct == Found("c:1", pb.FOUND_VIA_PEER, "c:1", node_id="boss")


async def test_the_error_names_every_peer_tried() -> None:
    elsewhere = pb.NodeStatus(node_id="e", swarm_name="other", role=pb.NODE_ROLE_COORDINATOR)
    lost = pb.NodeStatus(node_id="l", swarm_name=SWARM, role=pb.NODE_ROLE_WORKER)
    with pytest.raises(PeerUnavailable) as info:
        await locate_coordinator(
            swarm=SWARM, discovery=StaticDiscovery(name="mDNS test"),
            peers=["gone:1", "e:1", "l:1"], ask=_asker({"e:1": elsewhere, "l:1": lost}),
            timeout_s=0.2,
        )  # fmt: skip
    message = str(info.value)
    for needle in (
        "mDNS test (0 records)",
        "peer gone:1: UNAVAILABLE: nothing listens on gone:1",
        "peer e:1: it is in swarm 'other', not 'lab'",
        "peer l:1: it knows no coordinator yet",
    ):
        assert needle in message


async def test_a_record_that_appears_later_ends_the_wait() -> None:
    hints = StaticDiscovery()
    ask = _asker({"c:1": COORDINATOR})
    search = asyncio.create_task(
        locate_coordinator(swarm=SWARM, discovery=hints, peers=[], ask=ask, timeout_s=60)
    )
    await asyncio.sleep(0)  # let the first round find nothing
    hints.add(_record("boss", "coordinator", "c:1"))
    found = await asyncio.wait_for(search, 10)
    assert found.via == pb.FOUND_VIA_MDNS


async def test_a_wait_cancelled_as_a_record_arrives_is_cancelled() -> None:
    """A node's stop cancels its loops just as its peers' goodbyes arrive: a wait for a newer
    record that returned normally then (Python 3.11's wait_for does) would keep the loop that
    called it running, and the node's stop would never end."""
    hints = StaticDiscovery()
    wait = asyncio.create_task(hints.wait_newer(hints.generation, 60))
    await asyncio.sleep(0)  # it waits now
    hints.add(_record("boss", "coordinator", "c:1"))
    wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await wait


# ----- real mDNS packets on 127.0.0.1, one process ------------------------------------------------
def _advertised(swarm: str, node_id: str, role: Role, port: int) -> MdnsDiscovery:
    record = TxtRecord(swarm=swarm, node_id=node_id, protocol=PROTOCOL, role=role)
    return MdnsDiscovery(
        swarm=swarm,
        protocol=PROTOCOL,
        interface="127.0.0.1",
        advertisement=Advertisement(txt=record, port=port, ips=("127.0.0.1",)),
    )


async def _poll(condition: Callable[[], bool], timeout_s: float) -> None:
    """Poll `condition` until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not true within {timeout_s} s"
        await asyncio.sleep(0.05)


async def test_mdns_on_loopback_finds_its_swarm_and_ignores_the_rest() -> None:
    swarm, other = unique_swarm(), unique_swarm()
    a = _advertised(swarm, "node-a", "coordinator", 7001)
    b = _advertised(swarm, "node-b", "worker", 7002)
    c = _advertised(other, "node-c", "coordinator", 7003)
    # Records of our swarm that a node must not take.
    hostile: list[dict[str, str] | dict[bytes, bytes]] = [
        {"swarm": swarm, "node": "evil-1", "proto": "ravnest.v0", "role": "coordinator"},
        {b"swarm": swarm.encode(), b"node": b"\xff\xfe", b"proto": PROTOCOL.encode(),
         b"role": b"coordinator"},
        {"swarm": swarm, "node": "evil-3", "proto": PROTOCOL},
    ]  # fmt: skip
    raw = AsyncZeroconf(interfaces=["127.0.0.1"])
    async with a, b, c:
        tasks = [asyncio.create_task(d.run()) for d in (a, b, c)]
        try:
            for i, properties in enumerate(hostile):
                info = AsyncServiceInfo(
                    SERVICE_TYPE, f"evil-{swarm}-{i}.{SERVICE_TYPE}", port=7100 + i,
                    properties=properties, parsed_addresses=["127.0.0.1"],
                )  # fmt: skip
                await raw.async_register_service(info)
            await _poll(lambda: len(a.records()) == 1 and a.ignored >= 4, 20)
            await _poll(lambda: len(b.records()) == 1, 20)
            (seen_by_a,) = a.records()
            assert seen_by_a == PeerRecord(
                txt=TxtRecord(swarm=swarm, node_id="node-b", protocol=PROTOCOL, role="worker"),
                addresses=("127.0.0.1:7002",),
            )
            assert [r.txt.node_id for r in b.records()] == ["node-a"]
            assert c.records() == []
            assert a.registered.is_set() and "1 worker records" in a.describe()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await raw.async_close()


async def test_nothing_of_a_stopping_nodes_record_goes_out_after_its_goodbye() -> None:
    """A multicast answer zeroconf holds back (20-120 ms after the query) when the node stops
    must not follow its goodbye: it would bring the record back at every listener, which drops
    the goodbye's repeats as duplicates of the first. A multicast query that lists no known
    answer gets such an answer queued (asked again every half second: a record multicast less
    than a second ago is not answered yet, RFC 6762 6.2); the node stops the moment one is. What
    the node sends is watched at zeroconf's send. (A browser's queries would not do: its second
    one lists the answer if the first's unicast reply reached it, which depends on which of the
    sockets sharing port 5353 the kernel hands that reply to.)"""
    a = _advertised(unique_swarm(), "node-a", "worker", 7001)
    asker: AsyncZeroconf | None = None  # opened after the announcement: it knows no answer
    sent: list[tuple[bool, list[tuple[str, int]]]] = []  # (zeroconf closed?, (name, ttl)s)
    try:
        async with a:
            task = asyncio.create_task(a.run())
            await asyncio.wait_for(a.registered.wait(), 20)
            assert a._aiozc is not None
            zc = a._aiozc.zeroconf
            real_send = zc.async_send

            def spy(out: Any, *args: Any, **kwargs: Any) -> None:
                records = [(getattr(r, "alias", r.name), r.ttl) for r, _ in out.answers]
                sent.append((zc.done, records))
                real_send(out, *args, **kwargs)

            zc.async_send = spy  # type: ignore[method-assign]
            asker = AsyncZeroconf(interfaces=["127.0.0.1"])
            await asker.zeroconf.async_wait_for_start()
            query = DNSOutgoing(const._FLAGS_QR_QUERY, multicast=True)
            query.add_question(DNSQuestion(SERVICE_TYPE, const._TYPE_PTR, const._CLASS_IN))
            deadline, asked = time.monotonic() + 10, -math.inf
            while not zc.out_queue.queue:  # the answer is due in 20-120 ms: look often
                assert time.monotonic() < deadline, "no answer was queued within 10 s"
                if time.monotonic() - asked >= 0.5:
                    asker.zeroconf.async_send(query)
                    asked = time.monotonic()
                await asyncio.sleep(0.001)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert zc.done
    finally:
        if asker is not None:
            await asker.async_close()
    ours = [[ttl for name, ttl in records if name.startswith("node-a.")]
            for closed, records in sent if not closed]  # fmt: skip
    goodbye = next(i for i, ttls in enumerate(ours) if ttls and not any(ttls))
    assert [ttls for ttls in ours[goodbye + 1 :] if any(ttls)] == []


# ----- real node processes ------------------------------------------------------------------------
def _trained_together(coordinator: str, node_ids: set[str]) -> None:
    done = [e for e in progress_events(coordinator) if e.done]
    assert len(done) == 1 and not done[0].error
    summary = json.loads(done[0].summary_json)
    assert {s["node_id"] for s in summary["stages"]} == node_ids
    assert math.isfinite(summary["final_loss"])


def test_workers_find_the_coordinator_over_mdns(procs: Procs, tmp_path: Path) -> None:
    swarm = ("--swarm-name", unique_swarm())
    _, ready = procs.start_node(
        tmp_path / "n0", *LOOPBACK, *swarm, "--swarm-size", "3", "--model", "tiny", "--steps", "3"
    )
    started = [
        procs.start_node(tmp_path / f"n{i}", *LOOPBACK, *swarm, "--join", "auto") for i in (1, 2)
    ]
    workers = [ready_event for _, ready_event in started]
    _trained_together(ready["address"], {ready["node_id"]} | {w["node_id"] for w in workers})
    for worker in workers:
        status = node_status(worker["address"])
        assert status.role == pb.NODE_ROLE_WORKER
        assert status.coordinator_address == ready["address"]
        assert status.coordinator_found_via == pb.FOUND_VIA_MDNS
        assert status.coordinator_found_from == ready["node_id"]
    shown = subprocess.run(
        ravnest("status", workers[0]["address"], "--json"), env=NODE_ENV, capture_output=True,
        text=True, timeout=60, stdin=subprocess.DEVNULL, check=True,
    ).stdout  # fmt: skip
    assert json.loads(shown)["coordinator_found_via"] == "mdns"
    human = subprocess.run(
        ravnest("status", workers[1]["address"]), env=NODE_ENV, capture_output=True, text=True,
        timeout=60, stdin=subprocess.DEVNULL, check=True,
    ).stdout  # fmt: skip
    assert f"found over mDNS (record of node {ready['node_id']})" in human
    # The whole swarm, found by its name alone.
    view = json.loads(subprocess.run(
        ravnest("status", "--swarm", swarm[1], "--mdns-interface", "127.0.0.1", "--json"),
        env=NODE_ENV, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        check=True,
    ).stdout)  # fmt: skip
    assert view["coordinator"]["address"] == ready["address"]
    assert view["coordinator"]["found_via"] == "mdns" and view["plan_epoch"] == 1
    assert view["done"] and view["step"] == 3 and view["samples_per_s"] > 0
    members = {m["node_id"]: m for m in view["members"]}
    assert set(members) == {ready["node_id"]} | {w["node_id"] for w in workers}
    assert sorted(m["stage"] for m in members.values()) == [0, 1, 2]
    assert all(m["reachable"] and m["version"] == 3 and m["speed"] > 0 for m in members.values())
    blocks = sorted(tuple(m["blocks"]) for m in members.values())
    assert blocks[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(blocks))
    # A node that stops says goodbye over mDNS: the others drop its record at once.
    poll_until(lambda: node_status(ready["address"]).mdns_peers == 2, 20)
    started[0][0].send_signal(signal.SIGTERM)
    assert started[0][0].wait(10) == 0
    poll_until(lambda: node_status(ready["address"]).mdns_peers == 1, 10)


def test_a_worker_finds_the_coordinator_through_a_bootstrap_peer(
    procs: Procs, tmp_path: Path
) -> None:
    swarm = ("--swarm-name", unique_swarm())
    _, ready = procs.start_node(
        tmp_path / "n0", *swarm, "--swarm-size", "3", "--model", "tiny", "--steps", "2"
    )
    first_proc, first = procs.start_node(tmp_path / "n1", *swarm, "--join", ready["address"])
    _, second = procs.start_node(tmp_path / "n2", *swarm, "--peer", first["address"])
    _trained_together(ready["address"], {ready["node_id"], first["node_id"], second["node_id"]})
    status = node_status(second["address"])
    assert status.coordinator_address == ready["address"]
    assert status.coordinator_found_via == pb.FOUND_VIA_PEER
    assert status.coordinator_found_from == first["address"]
    assert node_status(first["address"]).coordinator_found_via == pb.FOUND_VIA_CONFIG
    # A swarm that mDNS does not reach is found through a peer; a stopped member shows as such.
    first_proc.send_signal(signal.SIGTERM)
    assert first_proc.wait(10) == 0
    shown = subprocess.run(
        ravnest("status", "--swarm", swarm[1], "--peer", second["address"],
                "--mdns-interface", "127.0.0.1", "--timeout-s", "5"),
        env=NODE_ENV, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        check=True,
    ).stdout  # fmt: skip
    assert f"found via peer ({second['address']})" in shown
    assert f"{first['node_id']} {first['address']}: pipeline 0 stage 1" in shown
    assert "no answer" in shown and shown.count("version 2") == 2


def test_no_coordinator_is_a_clear_error(procs: Procs, tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    swarm = unique_swarm()
    proc, _ = procs.start_node(
        tmp_path / "n0", *LOOPBACK, "--swarm-name", swarm, "--join", "auto",
        "--peer", f"127.0.0.1:{port}", "--connect-timeout-s", "2",
    )  # fmt: skip
    assert proc.wait(60) == 1
    log = (tmp_path / "n0" / "node.log").read_text()
    assert f"found no coordinator of swarm '{swarm}' within 2 s" in log
    assert "mDNS on 127.0.0.1 (0 coordinator and 0 worker records" in log
    assert f"peer 127.0.0.1:{port}: UNAVAILABLE" in log


def test_an_mdns_interface_that_cannot_be_opened_stops_the_start(tmp_path: Path) -> None:
    result = subprocess.run(
        ravnest("start", "--mdns", "--mdns-interface", "192.0.2.1", "--join", "auto",
                "--state-dir", str(tmp_path)),
        env=NODE_ENV, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "ravnest-node: error: cannot start mDNS on 192.0.2.1: " in result.stderr
    assert not (tmp_path / "ready.json").exists()
