"""Reverse tunnels through a relay, on loopback sockets: what a node that cannot accept
connections is reached through, and what the relay does with hostile input."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest

from ravnest_node import settings
from ravnest_node.bench.links import LinkSpec, NetnsSwarm
from ravnest_node.bench.scenario_links import free_port
from ravnest_node.daemon.config import NodeConfig
from ravnest_node.errors import ConfigError, PeerRefused
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.options import split_host_port
from ravnest_node.transport.relay import RelayServer
from ravnest_node.transport.tunnel import TunnelClient
from ravnest_node.transport.tunnel_wire import MAX_HEADER_BYTES, encode_header, read_header

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


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


@contextlib.asynccontextmanager
async def relayed(open_timeout_s: float = 10.0) -> AsyncIterator[tuple[RelayServer, TunnelClient]]:
    """An echo server reached only through a tunnel: (relay, the node's tunnel client)."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    local = f"127.0.0.1:{echo.sockets[0].getsockname()[1]}"
    relay = RelayServer("127.0.0.1:0", "127.0.0.1", open_timeout_s=open_timeout_s, max_tunnels=2)
    port = await relay.start()
    client = TunnelClient(f"127.0.0.1:{port}", "node-1", local, connect_timeout_s=5)
    await client.open()
    task = asyncio.create_task(client.run())
    try:
        yield relay, client
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await relay.close()
        echo.close()


async def _round_trip(address: str, payload: bytes) -> bytes:
    host, port = split_host_port(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(payload)
    writer.write_eof()
    echoed = await reader.read()
    writer.close()
    return echoed


async def test_connections_to_the_relayed_address_reach_the_node() -> None:
    async with relayed() as (relay, client):
        assert relay.tunnels() == {"node-1": client.address}
        payloads = [bytes([i]) * (100_000 * (i + 1)) for i in range(3)]
        echoed = await asyncio.gather(*(_round_trip(client.address, p) for p in payloads))
        assert echoed == payloads
        assert client.connections == 3


async def test_grpc_calls_ride_the_tunnel() -> None:
    """HTTP/2 through the relay: unary calls and a 4 MiB message each way."""
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 8 << 20),
                 ("grpc.max_send_message_length", 8 << 20)]
    )  # fmt: skip

    async def echo(request: bytes, context: object) -> bytes:
        return request[::-1]

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})])  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    relay = RelayServer("127.0.0.1:0", "127.0.0.1")
    client = TunnelClient(f"127.0.0.1:{await relay.start()}", "node-2", f"127.0.0.1:{port}")
    address = await client.open()
    task = asyncio.create_task(client.run())
    try:
        options = [("grpc.max_receive_message_length", 8 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            call = channel.unary_unary("/t.T/Echo")
            big = bytes(range(256)) * (4 << 12)
            assert await call(big, timeout=10) == big[::-1]
            assert await call(b"abc", timeout=10) == b"cba"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await relay.close()
        await server.stop(0)


async def test_a_lost_control_connection_is_made_again_for_the_same_address() -> None:
    async with relayed() as (relay, client):
        before = client.address
        assert client._control is not None
        client.registered.clear()
        client._control[1].close()  # as if the connection broke
        await asyncio.wait_for(client.registered.wait(), 10)
        assert client.address == before and relay.tunnels() == {"node-1": before}
        assert await _round_trip(before, b"again") == b"again"


async def test_the_old_tunnels_secret_takes_the_tunnel_over() -> None:
    """A node reconnecting before the relay has seen its old control connection die proves it
    owns the tunnel with the tunnel's secret and gets it back; here a second connection with
    the secret takes it over, the node's own connection ends, and the node takes it back."""
    async with relayed() as (relay, client):
        before = client.address
        port = split_host_port(relay.address)[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(encode_header({"op": "register", "node": "node-1", "port": 0,
                                    "secret": client._secret}))  # fmt: skip
        client.registered.clear()
        reply = await read_header(reader)
        assert reply["ok"] is True  # the old tunnel was closed for it
        writer.close()  # ... and the node reconnects with its secret
        await asyncio.wait_for(client.registered.wait(), 10)
        assert relay.tunnels() == {"node-1": before}
        assert await _round_trip(before, b"mine") == b"mine"


async def _raw(port: int, data: bytes) -> dict[str, object] | None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await read_header(reader)
    except asyncio.IncompleteReadError:
        return None
    finally:
        writer.close()


def _frame(header: object) -> bytes:
    body = msgpack.packb(header)
    return len(body).to_bytes(4, "big") + body


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ((10**9).to_bytes(4, "big") + b"x" * 64, "header of 1000000000 bytes"),
        ((MAX_HEADER_BYTES + 1).to_bytes(4, "big"), "at most 512"),
        ((3).to_bytes(4, "big") + b"\xc1\xc1\xc1", "not msgpack"),
        (_frame([1, 2]), "not a map"),
        (_frame({"cmd": "x"}), "no op"),
        (_frame({"op": "shell", "cmd": "rm"}), "unknown op 'shell'"),
        (_frame({"op": "register", "node": "../x", "port": 0}), "not a node id"),
        (_frame({"op": "register", "node": "n", "port": "80"}), "'port' is not a int"),
        (_frame({"op": "register", "node": "n", "port": 70000}), "out of range"),
        (_frame({"op": "data", "node": "node-1", "secret": "0" * 32, "id": 0}), "that secret"),
    ],
)
async def test_hostile_headers_are_refused_and_change_nothing(data: bytes, reason: str) -> None:
    async with relayed() as (relay, client):
        port = split_host_port(relay.address)[1]
        reply = await _raw(port, data)
        assert reply is not None and reply["ok"] is False and reason in str(reply["error"])
        assert relay.refused == 1 and relay.tunnels() == {"node-1": client.address}
        assert await _round_trip(client.address, b"still") == b"still"


async def test_a_second_tunnel_for_one_node_and_one_too_many_are_refused() -> None:
    async with relayed() as (relay, _):
        port = split_host_port(relay.address)[1]
        again = TunnelClient(f"127.0.0.1:{port}", "node-1", "127.0.0.1:1", connect_timeout_s=5)
        with pytest.raises(PeerRefused, match="already has a tunnel"):
            await again.open()
        second = TunnelClient(f"127.0.0.1:{port}", "node-2", "127.0.0.1:1", connect_timeout_s=5)
        await second.open()  # the relay's second and last
        third = TunnelClient(f"127.0.0.1:{port}", "node-3", "127.0.0.1:1", connect_timeout_s=5)
        with pytest.raises(PeerRefused, match="serves 2 tunnels"):
            await third.open()
        second.close()


async def _until_closed(relay: RelayServer, node_id: str) -> None:
    """Wait for the relay to close `node_id`'s tunnel (its control connection ended)."""
    tunnel = relay._tunnels.get(node_id)
    if tunnel is not None:
        await asyncio.wait_for(tunnel.closed.wait(), 5)


async def test_a_relay_with_a_port_range_opens_tunnels_only_there() -> None:
    """--relay-ports: each tunnel gets a free port of the range, in turn; when none is left,
    the next node is refused (and told why); a port asked for outside it is not given."""
    low = free_port()
    ports = range(low, low + 2)
    relay = RelayServer("127.0.0.1:0", "127.0.0.1", max_tunnels=4, ports=ports)
    relay_port = await relay.start()
    clients = [TunnelClient(f"127.0.0.1:{relay_port}", f"node-{i}", "127.0.0.1:1",
                            connect_timeout_s=5) for i in range(3)]  # fmt: skip
    try:
        opened = [split_host_port(await c.open())[1] for c in clients[:2]]
        assert sorted(opened) == list(ports)
        with pytest.raises(PeerRefused, match=f"no free port in {low}-{low + 1}"):
            await clients[2].open()
        clients[0].close()
        await _until_closed(relay, "node-0")
        # A node asking for a port outside the range gets the one that is free again.
        reader, writer = await asyncio.open_connection("127.0.0.1", relay_port)
        writer.write(encode_header({"op": "register", "node": "node-9", "port": 22}))
        reply = await read_header(reader)
        assert reply["ok"] is True
        assert split_host_port(str(reply["address"]))[1] == opened[0]
        writer.close()
    finally:
        for client in clients:
            client.close()
        await relay.close()


async def test_a_connection_the_node_does_not_answer_is_closed() -> None:
    """A registered node that never answers `open` (hung): the peer's connection is closed
    after the relay's timeout, not left waiting."""
    relay = RelayServer("127.0.0.1:0", "127.0.0.1", open_timeout_s=0.3)
    port = await relay.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(encode_header({"op": "register", "node": "mute", "port": 0}))
    reply = await read_header(reader)
    host, public = split_host_port(str(reply["address"]))
    peer_reader, peer_writer = await asyncio.open_connection(host, public)
    assert (await read_header(reader)) == {"op": "open", "id": 0}  # asked, never answered
    assert await asyncio.wait_for(peer_reader.read(), 5) == b""  # closed by the relay
    peer_writer.close()
    writer.close()
    await relay.close()


# ----- real node processes ------------------------------------------------------------------------
def test_a_node_reached_only_through_a_relay_trains_with_the_swarm(
    procs: Procs, tmp_path: Path
) -> None:
    """n1 and n2 are started as nodes behind NAT: n2 names its relay (--no-inbound --relay), n1
    takes the one the coordinator offers (--no-inbound). The address of each for the swarm is
    the port the relay opened for it, every connection to it comes through that relay (their
    boundary too: neither can accept one), and the three train the run to its end."""
    _, ready = procs.start_node(tmp_path / "n0", "--swarm-size", "3", "--model", "tiny",
                                "--steps", "20", "--relay-listen", "127.0.0.1:0")  # fmt: skip
    coordinator = ready["address"]
    relay = node_status(coordinator).relay_address
    assert relay
    _, chose = procs.start_node(tmp_path / "n1", "--join", coordinator, "--no-inbound")
    _, hidden = procs.start_node(
        tmp_path / "n2", "--join", coordinator, "--no-inbound", "--relay", relay
    )
    for node in (chose, hidden):
        status = node_status(node["address"])  # answered through the relay
        assert status.node_id == node["node_id"] and status.relay == relay
    assert dict(node_status(coordinator).relayed) == {
        node["node_id"]: node["address"] for node in (chose, hidden)
    }
    assert "relay chosen" in (tmp_path / "n1" / "node.log").read_text()
    done = [e for e in progress_events(coordinator) if e.done]
    assert len(done) == 1 and not done[0].error
    summary = json.loads(done[0].summary_json)
    for node in (chose, hidden):
        (stage,) = [s for s in summary["stages"] if s["node_id"] == node["node_id"]]
        assert stage["address"] == node["address"] and not stage.get("lost")
    command = ravnest("status", "--swarm", "default", "--peer", coordinator, "--json")
    view = json.loads(subprocess.run(
        command, env=NODE_ENV, capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL, check=True,
    ).stdout)  # fmt: skip
    relays = {m["node_id"]: m["relay"] for m in view["members"]}
    assert relays == {ready["node_id"]: "", chose["node_id"]: relay, hidden["node_id"]: relay}
    assert view["relays"] == [{"node_id": ready["node_id"], "address": relay}]
    # On one machine nobody measures a link to the coordinator: loopback is not a network.
    assert all(m["uplink_bps"] == 0 for m in view["members"])
    for proc in procs.started:
        proc.send_signal(signal.SIGTERM)
    assert [proc.wait(30) for proc in procs.started] == [0, 0, 0]


def _closed_port() -> int:
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        return int(unused.getsockname()[1])


def test_a_node_the_coordinator_cannot_reach_and_no_relay_is_refused_with_advice(
    procs: Procs, tmp_path: Path
) -> None:
    _, ready = procs.start_node(tmp_path / "n0", "--swarm-size", "2", "--model", "tiny")
    proc, _ = procs.start_node(tmp_path / "n1", "--join", ready["address"], "--advertise",
                               f"127.0.0.1:{_closed_port()}")  # fmt: skip
    assert proc.wait(60) == 1
    log = (tmp_path / "n1" / "node.log").read_text()
    assert "cannot reach node" in log and "--relay HOST:PORT" in log
    assert "offers no relay" in log


def test_a_node_the_coordinator_cannot_reach_goes_through_a_relay_it_offers(
    procs: Procs, tmp_path: Path
) -> None:
    """n1 advertises an address nobody answers at (as a node behind NAT advertises its private
    address): the coordinator's reachability check refuses its Join, so it takes the relay the
    coordinator offers, joins again at the port the relay opened for it, and trains."""
    _, ready = procs.start_node(tmp_path / "n0", "--swarm-size", "2", "--model", "tiny",
                                "--steps", "10", "--relay-listen", "127.0.0.1:0")  # fmt: skip
    coordinator = ready["address"]
    relay = node_status(coordinator).relay_address
    _, n1 = procs.start_node(tmp_path / "n1", "--join", coordinator, "--advertise",
                             f"127.0.0.1:{_closed_port()}")  # fmt: skip
    done = [e for e in progress_events(coordinator) if e.done]
    assert len(done) == 1 and not done[0].error
    log = (tmp_path / "n1" / "node.log").read_text()
    assert "cannot reach node" in log and "relay chosen" in log
    (address,) = dict(node_status(coordinator).relayed).values()
    status = node_status(address)  # answered through the relay
    assert status.node_id == n1["node_id"] and status.relay == relay
    summary = json.loads(done[0].summary_json)
    assert {s["node_id"]: s["address"] for s in summary["stages"]}[n1["node_id"]] == address
    for p in procs.started:
        p.send_signal(signal.SIGTERM)
    assert [p.wait(30) for p in procs.started] == [0, 0]


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"no_inbound": True}, "give --join HOST:PORT or --peer"),
        ({"no_inbound": True, "join": "c:1", "mdns": True}, "drop --mdns"),
        ({"no_inbound": True, "join": "c:1", "advertise": "a:1"}, "drop --advertise"),
        ({"relay": "r:1", "join": "c:1", "advertise": "a:1"}, "drop --advertise"),
        ({"relay": "r:1"}, "a coordinator must accept connections"),
        ({"relay": "r:1", "join": "auto", "mdns": True}, "drop --mdns"),
        ({"relay_listen": "0.0.0.0:7000"}, "give --advertise"),
        ({"relay_ports": "7100-7115"}, "add --relay-listen"),
        ({"relay_listen": "127.0.0.1:7000", "relay_ports": "7115-7100"}, "LOW <= HIGH"),
        ({"relay_listen": "127.0.0.1:7000", "relay_ports": "7100"}, "give LOW-HIGH"),
    ],
)
def test_bad_relay_settings_say_what_is_wrong(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        settings.load(NodeConfig, env={}, overrides=changes)


def test_a_node_in_a_namespace_nobody_can_reach_chooses_a_relay_and_trains(
    procs: Procs, tmp_path: Path
) -> None:
    """The same across network namespaces, where it is true: n2's server listens on its own
    namespace's loopback, so no other host can open a connection to it. Started with no relay
    setting at all, it is refused by the coordinator's reachability check, asks it for relays
    (n0 and n1 serve one) and takes the one with the lowest round trip; it reaches the others
    (and they it) only through that relay, over connections it opened. Before the plan it
    measures its links to n0 and n1 (its own connections, both ways)."""
    require_netns()
    with NetnsSwarm(3, LinkSpec(rate_mbit=1000, delay_ms=0), name="rvt") as net:
        hosts = [h.address for h in net.hosts]

        def start(i: int, *args: str) -> dict[str, Any]:
            return procs.start_node(tmp_path / f"n{i}", *args, prefix=net.exec_prefix(i))[1]

        coordinator = f"{hosts[0]}:7070"
        n0 = start(0, "--listen", coordinator, "--swarm-size", "3", "--model", "tiny", "--steps",
                   "10", "--relay-listen", f"{hosts[0]}:7071")  # fmt: skip
        n1 = start(1, "--listen", f"{hosts[1]}:7070", "--join", coordinator, "--relay-listen",
                   f"{hosts[1]}:7071")  # fmt: skip
        poll_until(lambda: len(swarm_view(coordinator).relays) == 2, 30)
        hidden = start(2, "--listen", "127.0.0.1:7070", "--join", coordinator)
        relays = {n0["node_id"]: f"{hosts[0]}:7071", n1["node_id"]: f"{hosts[1]}:7071"}
        assert {(r.node_id, r.address) for r in swarm_view(coordinator).relays} == set(
            relays.items()
        )

        # Its ready file has the address it listens on: the one nobody else can reach.
        def relayed() -> set[str]:
            return {a for r in (n0, n1) for a in node_status(r["address"]).relayed.values()}

        poll_until(lambda: len(relayed()) == 1, 60)
        (address,) = relayed()
        hidden["address"] = address
        chosen = node_status(address).relay  # answered through the relay
        assert chosen in relays.values()
        assert hidden["address"].startswith(f"{chosen.split(':')[0]}:")  # a port of its host
        log = (tmp_path / "n2" / "node.log").read_text()
        assert "cannot reach node" in log and "relay chosen" in log
        done = [e for e in progress_events(coordinator) if e.done]
        assert len(done) == 1 and not done[0].error
        summary = json.loads(done[0].summary_json)
        assert hidden["address"] in {s["address"] for s in summary["stages"]}
        # It is not the first stage: it opened the stream to its upstream itself, straight.
        (stage,) = [s for s in summary["stages"] if s["node_id"] == hidden["node_id"]]
        assert stage["index"] > 0 and stage["relayed"], summary["stages"]
        log = (tmp_path / "n2" / "node.log").read_text()
        assert "behind NAT: opening the stream to upstream" in log
        # Each worker measured its link to the coordinator before the plan (capped at 1 Gbit/s
        # here; the coordinator's own node has none), and n2 named its relay to the planner.
        with grpc.insecure_channel(coordinator) as channel:
            view = pb_grpc.CoordinatorStub(channel).Swarm(pb.SwarmRequest(), timeout=30)
        members = {m.node_id: m for m in view.members}
        assert members[n0["node_id"]].uplink_bps == 0
        for node in (n1, hidden):
            assert 1e6 < members[node["node_id"]].uplink_bps < 2e9
            assert members[node["node_id"]].rtt_s > 0
        (relay_id,) = [node for node, address in relays.items() if address == chosen]
        assert members[hidden["node_id"]].relay_node_id == relay_id
        measured = {p.node_id for p in members[hidden["node_id"]].peer_links}
        assert measured == {n0["node_id"], n1["node_id"]}
        # Its boundary traffic went straight: the relay carried a sliver of it (status calls,
        # the coordinator's reachability check).
        relay_node = {n0["node_id"]: n0, n1["node_id"]: n1}[relay_id]
        carried = node_status(relay_node["address"]).relayed_bytes[hidden["node_id"]]
        sent = node_status(hidden["address"]).bytes_sent
        print(f"relay carried {carried} bytes for the node behind NAT, which sent {sent}")
        assert 0 < carried < sent / 10
        for proc in procs.started:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(30) for proc in procs.started] == [0, 0, 0]
