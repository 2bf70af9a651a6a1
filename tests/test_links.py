"""Link emulation: a tbf-capped namespace link holds its rate, the relay adds its delay and rate.

Figures seen on a 2-core machine like ours (kernel 6.18, loaded by nothing else):
- tbf 50 Mbit/s, plain TCP between two host namespaces: 47.4-47.8 Mbit/s goodput, i.e. the cap
  less TCP/IP/Ethernet headers (1448 payload bytes per 1514-byte frame: 47.8 Mbit/s expected).
- relay 20 ms each way: round trip 40.6-41.6 ms (median of 10).
- relay paced at 20 Mbit/s, no delay: 19.9-20.0 Mbit/s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager

import pytest

from ravnest_node.bench import links
from ravnest_node.bench.links import SCENARIOS, LinkSpec, NetnsSwarm
from ravnest_node.bench.relay import (
    MIN_BUFFER_BYTES,
    PACING_BURST_S,
    Relay,
    buffer_limit_bytes,
    chunk_limit_bytes,
    write_time,
)

from .conftest import Procs, read_line, require_netns

MB = 1_000_000
# Share of a full-size frame's bytes that is TCP payload: 1448 of 1514 (timestamps option on).
PAYLOAD_SHARE = 1448 / 1514
TEST_NAME = "rvtl"  # namespace/link prefix of this module's swarms


# ----------------------------------------------------------------------------------- pure parts


def test_scenarios_match_benchmarks_md() -> None:
    expected = {
        "lan": LinkSpec(1000, 1),
        "home": LinkSpec(50, 20),
        "internet": LinkSpec(10, 50),
        "mobile": LinkSpec(2, 80),
    }
    assert expected == SCENARIOS
    assert SCENARIOS["home"].rate_bps == 50e6
    assert SCENARIOS["home"].delay_s == pytest.approx(0.02)


@pytest.mark.parametrize(("rate", "delay"), [(0, 1), (-5, 1), (10, -1), (float("nan"), 1)])
def test_linkspec_rejects_nonsense(rate: float, delay: float) -> None:
    with pytest.raises(ValueError, match="LinkSpec"):
        LinkSpec(rate, delay)


def test_tbf_burst_holds_a_gso_packet_and_scales_with_rate() -> None:
    for spec in SCENARIOS.values():
        if links.segmented(spec.rate_mbit):  # mobile: no GSO there, see the test below
            continue
        args = links.tbf_args(spec.rate_mbit)
        burst = int(args[args.index("burst") + 1])
        assert burst >= 64 * 1024
    assert links.tbf_args(50)[:3] == ["tbf", "rate", "50000kbit"]
    lan = links.tbf_args(1000)
    assert int(lan[lan.index("burst") + 1]) >= 1000e6 / 8 * links.TBF_BURST_S


@pytest.mark.parametrize("rate_mbit", [2, 1, 0.2, 0.05])
def test_tbf_on_slow_links_passes_full_frames_and_queues_some(rate_mbit: float) -> None:
    """A slow link sends packets of one MTU: its bucket holds a few frames, not 64 KiB (seconds
    of such a link), and its queue (burst + latency x rate) at least 16 of them."""
    assert links.segmented(rate_mbit)
    args = links.tbf_args(rate_mbit)
    burst = int(args[args.index("burst") + 1])
    latency_s = int(args[args.index("latency") + 1].removesuffix("ms")) / 1e3
    assert links.FRAME_BYTES <= burst <= 8 * links.FRAME_BYTES
    assert burst + latency_s * rate_mbit * 1e6 / 8 >= 16 * links.FRAME_BYTES
    assert latency_s >= links.TBF_LATENCY_MS / 1e3
    assert not links.segmented(SCENARIOS["internet"].rate_mbit)


def test_dilation_stretches_every_link_time_by_its_factor() -> None:
    mobile = SCENARIOS["mobile"]
    slow = links.dilate(mobile, 10)
    assert slow == LinkSpec(0.2, 800)
    # A transfer of B bytes plus a one-way trip takes 10x as long on the dilated link.
    nbytes = 100_000
    assert nbytes * 8 / slow.rate_bps + slow.delay_s == pytest.approx(
        10 * (nbytes * 8 / mobile.rate_bps + mobile.delay_s)
    )
    assert links.dilate(mobile, 1) == mobile
    with pytest.raises(ValueError, match=">= 1"):
        links.dilate(mobile, 0.5)


@pytest.mark.parametrize("name", ["", "rvb1", "RVB", "toolongname", "a-b"])
def test_swarm_rejects_names_that_break_interface_names(name: str) -> None:
    with pytest.raises(ValueError, match="lowercase letters"):
        NetnsSwarm(2, SCENARIOS["home"], name=name)


def test_write_time_unpaced_is_read_time_plus_delay() -> None:
    at = write_time(
        read_at=10.0, size_bytes=10**6, delay_s=0.02, rate_bps=None, prev_done_at=11, now=12
    )
    assert at == pytest.approx(10.02)


def test_write_time_paced_is_a_link_of_that_rate_and_delay() -> None:
    rate = 8e6  # 1 byte per microsecond
    # An idle link: propagation, then this chunk's serialisation.
    first = write_time(
        read_at=0.0, size_bytes=1000, delay_s=0.01, rate_bps=rate, prev_done_at=-1.0, now=0.0
    )
    assert first == pytest.approx(0.01 + 0.001)
    # Back to back: the next chunk (read at once) follows the first at the rate, even if the
    # writer only gets to it a little late (it catches up).
    second = write_time(
        read_at=0.0, size_bytes=1000, delay_s=0.01, rate_bps=rate, prev_done_at=first, now=0.015
    )
    assert second == pytest.approx(first + 0.001)


def test_write_time_paced_catches_up_at_most_one_burst() -> None:
    # The writer was held up for a second (a stalled reader): it may send PACING_BURST_S of
    # link time at once, then the rate applies again.
    at = write_time(
        read_at=0.0, size_bytes=1000, delay_s=0.01, rate_bps=8e6, prev_done_at=0.02, now=1.0
    )
    assert at == pytest.approx(1.0 - PACING_BURST_S + 0.001)


def test_buffer_limit_is_4mib_or_twice_the_bdp() -> None:
    assert buffer_limit_bytes(0.02, None) == MIN_BUFFER_BYTES
    assert buffer_limit_bytes(0.02, 50e6) == MIN_BUFFER_BYTES
    assert buffer_limit_bytes(0.1, 1e9) == 2 * 12_500_000
    assert chunk_limit_bytes(None) == 256 * 1024
    assert chunk_limit_bytes(20e6) == 5000


def test_relay_rejects_nonsense() -> None:
    def relay(target_port: int = 1, delay_s: float = 0, rate_bps: float | None = None) -> Relay:
        return Relay(
            listen_host="127.0.0.1",
            listen_port=0,
            target_host="127.0.0.1",
            target_port=target_port,
            delay_s=delay_s,
            rate_bps=rate_bps,
        )

    with pytest.raises(ValueError, match="delay_s"):
        relay(delay_s=-1)
    with pytest.raises(ValueError, match="rate_bps"):
        relay(rate_bps=0)
    with pytest.raises(ValueError, match="target_port"):
        relay(target_port=0)


# -------------------------------------------------------------------------- relay, on loopback


async def until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Waits until `predicate()` holds, checking every few ms; fails after `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.005)


@asynccontextmanager
async def serving(
    handler: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def relaying(
    target_port: int, delay_s: float, rate_bps: float | None = None
) -> AsyncIterator[tuple[Relay, int]]:
    relay = Relay(
        listen_host="127.0.0.1",
        listen_port=0,
        target_host="127.0.0.1",
        target_port=target_port,
        delay_s=delay_s,
        rate_bps=rate_bps,
    )
    port = await relay.start()
    try:
        yield relay, port
    finally:
        await relay.close()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


async def test_relay_adds_its_delay_each_way() -> None:
    async with serving(echo) as echo_port, relaying(echo_port, delay_s=0.020) as (relay, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        loop = asyncio.get_running_loop()
        rtts = []
        for i in range(11):  # the first is a warm-up
            t0 = loop.time()
            writer.write(b"ping %2d\n" % i)
            assert await asyncio.wait_for(reader.readline(), 2) == b"ping %2d\n" % i
            rtts.append(loop.time() - t0)
        writer.close()
        await writer.wait_closed()
        rtt = statistics.median(rtts[1:])
        print(f"relay 20 ms each way: median RTT {rtt * 1e3:.1f} ms")
        assert rtt == pytest.approx(0.040, rel=0.20)
        assert relay.bytes_forwarded == 2 * 11 * 8


async def test_relay_paces_to_its_rate() -> None:
    received = 0
    done = asyncio.Event()
    last_byte_at = 0.0

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received, last_byte_at
        while data := await reader.read(65536):
            received += len(data)
            last_byte_at = asyncio.get_running_loop().time()
        writer.close()
        done.set()

    size = 2 * MB
    async with serving(sink) as sink_port, relaying(sink_port, 0.0, rate_bps=20e6) as (_, port):
        loop = asyncio.get_running_loop()
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = loop.time()
        writer.write(bytes(size))
        await writer.drain()
        writer.close()
        await asyncio.wait_for(done.wait(), 10)
        goodput_bps = received * 8 / (last_byte_at - t0)
        print(f"relay paced at 20 Mbit/s: {goodput_bps / 1e6:.2f} Mbit/s")
        assert received == size
        # The relay's promise is the cap: never faster than the rate. Below it, a loaded
        # 2-core machine adds its own delays (15.8 Mbit/s seen while a suite ran beside it),
        # so the lower bound only catches a relay that paces far too slowly.
        assert 0.5 * 20e6 <= goodput_bps <= 1.15 * 20e6


async def test_relay_closes_the_other_side_when_one_closes() -> None:
    target_eof = asyncio.Event()
    target_writers: list[asyncio.StreamWriter] = []

    async def target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target_writers.append(writer)
        while await reader.read(65536):
            pass
        target_eof.set()
        writer.close()

    async with serving(target) as target_port, relaying(target_port, 0.005) as (relay, port):
        # The client closes: the target's connection ends, and the relay lets go of both.
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        writer.close()
        await asyncio.wait_for(target_eof.wait(), 5)
        await until(lambda: relay.connections == 0, 5, "relay dropped the connection")

        # The target closes: the client's connection ends.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await until(lambda: len(target_writers) == 2, 5, "target accepted the second connection")
        target_writers[1].close()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await until(lambda: relay.connections == 0, 5, "relay dropped the connection")


async def test_relay_closes_the_client_when_the_target_is_unreachable() -> None:
    with socket.socket() as bound_not_listening:
        bound_not_listening.bind(("127.0.0.1", 0))
        target_port = bound_not_listening.getsockname()[1]
        async with relaying(target_port, 0.001) as (relay, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            await until(lambda: relay.connections == 0, 5, "relay dropped the connection")


async def test_relay_applies_backpressure_and_delivers_everything() -> None:
    may_read = asyncio.Event()
    got = bytearray()
    done = asyncio.Event()

    async def slow_target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await may_read.wait()
        while data := await reader.read(1 << 20):
            got.extend(data)
        writer.close()
        done.set()

    payload = bytes(range(256)) * (24 * MB // 256)
    async with serving(slow_target) as target_port, relaying(target_port, 0.001) as (relay, port):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(payload)  # far more than the relay and the kernel buffers hold
        sending = asyncio.create_task(writer.drain())
        full = relay.buffer_limit_bytes - 64 * 1024
        await until(lambda: relay.buffered_bytes >= full, 10, "relay buffer filled up")
        assert relay.buffered_bytes <= relay.buffer_limit_bytes
        assert not sending.done(), "the sender was not slowed down"
        may_read.set()
        await asyncio.wait_for(sending, 10)
        writer.close()
        await asyncio.wait_for(done.wait(), 10)
        assert got == payload


def test_relay_process_reports_ready_and_stops_on_sigterm(procs: Procs) -> None:
    proc = procs.popen(
        [sys.executable, "-m", "ravnest_node.bench.relay", "--listen", "127.0.0.1:0",
         "--target", "127.0.0.1:9", "--delay-ms", "20", "--rate-mbit", "10"],
        stderr=subprocess.PIPE,
    )  # fmt: skip
    event = json.loads(read_line(proc, 20))
    assert event["event"] == "ready"
    assert event["port"] > 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


# ------------------------------------------------------------------- namespaces (root only)

RECEIVER = """
import json, socket, sys, time
skip = int(sys.argv[1])
server = socket.create_server((sys.argv[2], 0))
print(json.dumps({"port": server.getsockname()[1]}), flush=True)
conn, _ = server.accept()
buf = bytearray(1 << 16)
total, t0, at0 = 0, None, 0
while n := conn.recv_into(buf):
    total += n
    if t0 is None and total >= skip:
        t0, at0 = time.monotonic(), total
t1 = time.monotonic()
print(json.dumps({"bytes": total, "goodput_bps": (total - at0) * 8 / (t1 - t0)}), flush=True)
"""

SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30) as s:
    s.sendall(bytes(int(sys.argv[3])))
"""


@pytest.fixture
def netns() -> Iterator[None]:
    require_netns()
    links.remove_leftovers(TEST_NAME)
    yield
    links.remove_leftovers(TEST_NAME)


def assert_gone(namespaces: list[str], control_ifname: str) -> None:
    ns_now = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links_now = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(ns in ns_now.split() for ns in namespaces), ns_now
    assert f" {control_ifname}@" not in links_now, links_now
    assert f"-{TEST_NAME}" not in ns_now
    assert not [line for line in ns_now.splitlines() if line.startswith(TEST_NAME)]
    assert f": {TEST_NAME}" not in links_now


@pytest.mark.usefixtures("netns")
@pytest.mark.parametrize(
    ("rate", "size", "skip"),
    [
        (SCENARIOS["home"], 6 * MB, MB),
        # Segmented links (one MTU per packet, a bucket of a few frames): mobile, and mobile
        # dilated 10x (`bench --gpu-like 10`). The first bytes go out of a full bucket.
        (SCENARIOS["mobile"], 1_200_000, 100_000),
        (links.dilate(SCENARIOS["mobile"], 10), 200_000, 30_000),
    ],
    ids=["home", "mobile", "mobile-x10"],
)
def test_tbf_link_holds_its_rate(procs: Procs, rate: LinkSpec, size: int, skip: int) -> None:
    with NetnsSwarm(2, rate, name=TEST_NAME) as swarm:
        namespaces, control_if = swarm.namespaces, swarm.control_ifname
        h0, h1 = swarm.hosts
        assert len({h0.address, h1.address, swarm.control_address}) == 3
        receiver = procs.popen(
            [*swarm.exec_prefix(1), sys.executable, "-c", RECEIVER, str(skip), h1.address]
        )
        port = json.loads(read_line(receiver, 20))["port"]
        tx_before = swarm.tx_bytes(0)
        subprocess.run(
            [*swarm.exec_prefix(0), sys.executable, "-c", SENDER, h1.address, str(port), str(size)],
            check=True,
            timeout=30,
        )
        result = json.loads(read_line(receiver, 20))
        assert receiver.wait(10) == 0
        sent_on_link = swarm.tx_bytes(0) - tx_before
    print(f"tbf {rate.rate_mbit} Mbit/s: goodput {result['goodput_bps'] / 1e6:.2f} Mbit/s")
    assert result["bytes"] == size
    assert sent_on_link >= size
    # Goodput is the cap less headers; 15% either side of that.
    assert result["goodput_bps"] == pytest.approx(rate.rate_bps * PAYLOAD_SHARE, rel=0.15)
    assert_gone(namespaces, control_if)


@pytest.mark.usefixtures("netns")
def test_control_address_reaches_every_host(procs: Procs) -> None:
    with NetnsSwarm(3, SCENARIOS["lan"], name=TEST_NAME) as swarm:
        for i, host in enumerate(swarm.hosts):
            listener = procs.popen(
                [*swarm.exec_prefix(i), sys.executable, "-c", RECEIVER, "0", host.address]
            )
            port = json.loads(read_line(listener, 20))["port"]
            with socket.create_connection((host.address, port), timeout=5) as sock:
                assert sock.getsockname()[0] == swarm.control_address
                sock.sendall(b"x" * 1000)
            assert json.loads(read_line(listener, 20))["bytes"] == 1000
        lo = subprocess.run(
            [*swarm.exec_prefix(0), "ip", "-o", "link", "show", "lo"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "UP" in lo


@pytest.mark.usefixtures("netns")
def test_remove_leftovers_cleans_up_after_a_killed_run(procs: Procs) -> None:
    # links.py needs only the standard library: load it by path, skipping the package's imports
    # (torch), which take seconds.
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('links', {links.__file__!r})\n"
        "links = importlib.util.module_from_spec(spec)\n"
        "sys.modules['links'] = links\n"
        "spec.loader.exec_module(links)\n"
        f"swarm = links.NetnsSwarm(2, links.SCENARIOS['home'], name={TEST_NAME!r}).__enter__()\n"
        "print(' '.join([*swarm.namespaces, swarm.control_ifname]), flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = procs.popen([sys.executable, "-c", script], stdin=subprocess.PIPE)
    *namespaces, control_if = read_line(proc, 20).decode().split()
    # While its owner lives, a swarm is not a leftover.
    assert links.remove_leftovers(TEST_NAME) == []
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    removed = links.remove_leftovers(TEST_NAME)
    assert sorted(removed) == sorted([*namespaces, f"link:{control_if}"])
    assert_gone(namespaces, control_if)
