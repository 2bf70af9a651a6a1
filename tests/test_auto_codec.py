"""`auto` codec choice: the pure rule, the probe estimator against a fake clock, the probe
method's validation, the per-link choice object, and a real swarm with one slow link."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch

from ravnest_node.compression import CODECS
from ravnest_node.compression.auto import (
    AUTO,
    AUTO_LADDER,
    COARSE,
    COARSE_SHRINK,
    COMPACT,
    COMPACT_PRIOR_BITS,
    FINE,
    FINE_GROWTH,
    LINK_SHARE,
    choose_codec,
    compact_estimate,
    link_bound,
    payload_sizes,
    ranked,
)
from ravnest_node.compression.codecs import (
    BOTTLENECK_BLOCK,
    COARSE_CODES,
    COARSE_LABEL,
    FINE_LABEL,
    Role,
    encoder,
    variant_label,
)
from ravnest_node.compression.quant import BlockQuant
from ravnest_node.compression.transform import (
    CODER_COLUMNS,
    KLT,
    KLT_ACTIVATION,
    KLT_ACTIVATION_COARSE,
    KLT_ACTIVATION_FINE,
    KLT_GRADIENT,
    KLT_GRADIENT_COARSE,
    KLTBases,
    KLTState,
)
from ravnest_node.daemon.worker.links import LinkMeter
from ravnest_node.errors import ConfigError, PeerRefused
from ravnest_node.identity import NodeKey
from ravnest_node.models import get_model
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.transport.boundary import LinkCounters
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.options import TransportConfig
from ravnest_node.transport.probe import (
    DONE_KEY,
    MAX_PROBE_BYTES,
    MIN_SPREAD,
    PULL_KEY,
    SINGLE,
    LinkEstimate,
    ProbeBusy,
    ProbePlan,
    ProbeServer,
    ProbeTurns,
    Send,
    bandwidth_of,
    end_measurement,
    estimate_bandwidth_bps,
    measure_link,
    probe_sender,
)
from ravnest_node.transport.probe import PATH as PROBE_PATH
from ravnest_node.transport.proofs import EPOCH_KEY, NODE_ID_KEY, provers

from .conftest import demo_summary

MBIT = 1e6


def _bench_small_activation() -> list[tuple[str, int]]:
    """Payload sizes of one bench-small microbatch's activation (4 x 128 x 256 float32)."""
    spec = get_model("bench-small").output_spec(1, TrainConfig().microbatch_size)
    return payload_sizes("activation", spec.shape, spec.dtype)


# ---------------------------------------------------------------------------------- the rule


def test_payload_sizes_follow_the_ladder() -> None:
    sizes = dict(_bench_small_activation())
    numel = 4 * 128 * 256
    assert list(sizes) == list(AUTO_LADDER)
    assert sizes["none"] == numel * 4
    assert sizes["bf16"] == numel * 2
    assert sizes["int8-block"] == numel + 4 * numel // 512
    assert sizes["int4-block"] == numel // 2 + 4 * numel // 64
    grad = dict(payload_sizes("gradient", (4, 128, 256), torch.float32))
    assert grad == sizes  # stochastic rounding does not change the wire format


@pytest.mark.parametrize(
    ("bandwidth_mbit", "compute_ms", "expected"),
    [
        (1000, 40, "none"),  # LAN: 512 KiB in 4.2 ms, well inside 20 ms
        (50, 40, "int4-block"),  # home: int8 takes 21 ms, just over the budget
        (50, 70, "int8-block"),  # a slower stage leaves room for int8 (21 ms of 35)
        (200, 30, "bf16"),  # bf16 in 10.5 ms of 15; none would take 21 ms
        (10, 40, "int4-block"),  # internet: even int4 (59 ms) misses; take the smallest
        (10, 300, "int8-block"),  # ... unless the stage is very slow (106 ms of 150)
    ],
)
def test_rule_picks_the_most_faithful_codec_that_fits(
    bandwidth_mbit: float, compute_ms: float, expected: str
) -> None:
    got = choose_codec(
        _bench_small_activation(), bandwidth_bps=bandwidth_mbit * MBIT, compute_s=compute_ms / 1e3
    )
    assert got == expected


def test_rule_moves_to_a_more_faithful_codec_only_with_a_margin() -> None:
    sizes = [("none", 1000), ("int4-block", 150)]
    # none: 1000 bytes at 1 Mbit/s = 8 ms, inside the budget of 8.5 ms but not its 80%.
    fits_barely = {"bandwidth_bps": 1 * MBIT, "compute_s": 0.017}
    assert choose_codec(sizes, **fits_barely) == "none"
    assert choose_codec(sizes, **fits_barely, current="none") == "none"  # staying needs no margin
    assert choose_codec(sizes, **fits_barely, current="int4-block") == "int4-block"
    roomy = {"bandwidth_bps": 1 * MBIT, "compute_s": 0.030}
    assert choose_codec(sizes, **roomy, current="int4-block") == "none"


def test_deflate_is_for_links_that_even_the_smallest_codec_leaves_the_bottleneck() -> None:
    int4 = dict(_bench_small_activation())["int4-block"]  # 73,728 bytes: 59 ms at 10 Mbit/s
    assert link_bound(int4, bandwidth_bps=10 * MBIT, compute_s=0.040)  # internet: budget 20 ms
    assert not link_bound(int4, bandwidth_bps=50 * MBIT, compute_s=0.040)  # home: 11.8 of 20
    # Once on, it stays on until the transfer fits in 80% of the budget.
    edge = {"bandwidth_bps": 10 * MBIT, "compute_s": 0.130}  # budget 65 ms, 80% of it 52 ms
    assert not link_bound(int4, **edge) and link_bound(int4, **edge, was=True)
    assert not link_bound(int4, bandwidth_bps=10 * MBIT, compute_s=0.150, was=True)
    with pytest.raises(ValueError, match="must be > 0"):
        link_bound(int4, bandwidth_bps=0.0, compute_s=1.0)


def test_rule_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="at least one"):
        choose_codec([], bandwidth_bps=1.0, compute_s=1.0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="must be > 0"):
            choose_codec([("none", 1)], bandwidth_bps=bad, compute_s=1.0)
        with pytest.raises(ValueError, match="must be > 0"):
            choose_codec([("none", 1)], bandwidth_bps=1.0, compute_s=bad)


def test_klt_is_taken_where_it_costs_least_and_its_coding_counts() -> None:
    sizes = [*_bench_small_activation(), compact_estimate("activation", (4, 128, 256))]
    assert sizes[-1] == (COMPACT, 4 * 128 * 256 * COMPACT_PRIOR_BITS["activation"] // 8)
    link = {"bandwidth_bps": 10 * MBIT, "compute_s": 0.040}  # int4: 59 ms of a 20 ms budget
    assert choose_codec(sizes, **link) == COMPACT  # 26 ms: still over, but the least
    assert choose_codec(sizes, **link, coding_s={COMPACT: 0.010}) == COMPACT  # 36 ms < 59 ms
    # A coder slower than the bytes it saves: int4-block (59 ms) costs less than klt (26 + 40).
    assert choose_codec(sizes, **link, coding_s={COMPACT: 0.040}) == "int4-block"
    # ... and coding counts within the budget too: int8 fits on home unless its coding is slow.
    home = {"bandwidth_bps": 50 * MBIT, "compute_s": 0.070}  # int8 21 ms of 35
    assert choose_codec(sizes, **home) == "int8-block"
    assert choose_codec(sizes, **home, coding_s={"int8-block": 0.015}) == "int4-block"
    # Where none fits, another codec must cost HYSTERESIS less than the current one.
    near = [("int4-block", 1000), (COMPACT, 900)]
    slow = {"bandwidth_bps": 8000.0, "compute_s": 0.1}  # 1 s and 0.9 s against 50 ms
    assert choose_codec(near, **slow) == COMPACT
    assert choose_codec(near, **slow, current="int4-block") == "int4-block"
    assert choose_codec([("int4-block", 1000), (COMPACT, 700)], **slow, current="int4-block") == (
        COMPACT
    )
    # What klt's frames measured on the link replaces the prior.
    assert compact_estimate("gradient", (4, 128, 256), 5000.4) == (COMPACT, 5000)


# ------------------------------------------------------------------- the probe, on a fake clock


class FakeLink:
    """A link of `bandwidth_bps` and `rtt_s` that lets a `burst` of each probe's bytes pass at
    once (a shaper's token bucket): each probe advances the fake clock."""

    def __init__(self, bandwidth_bps: float, rtt_s: float, burst: int = 0) -> None:
        self.bandwidth_bps = bandwidth_bps
        self.rtt_s = rtt_s
        self.burst = burst
        self.now = 0.0
        self.sent: list[int] = []

    def clock(self) -> float:
        return self.now

    async def send(self, nbytes: int) -> None:
        self.sent.append(nbytes)
        self.now += self.rtt_s + max(0, nbytes - self.burst) * 8 / self.bandwidth_bps


@pytest.mark.parametrize(
    ("bandwidth_mbit", "rtt_ms", "burst", "last_probe"),
    [
        (10, 50, 0, 128 << 10),  # 128 KiB take 105 ms + RTT: stop there
        (10, 50, 64 << 10, 256 << 10),  # a 64 KiB bucket: 128 KiB take 52 ms, 256 KiB 157
        (2, 80, 0, 64 << 10),  # 32 KiB take 131 ms, but one probe is not enough
        (2, 80, 6056, 64 << 10),  # the bench's mobile bucket (4 frames)
        (50, 20, 0, 1 << 20),  # 1 MiB takes 168 ms
        (50, 20, 64 << 10, 1 << 20),
        (1000, 1, 0, 1 << 20),  # LAN: stops at the 1 MiB default cap (8 ms)
    ],
)
async def test_probe_estimates_bandwidth_and_rtt(
    bandwidth_mbit: float, rtt_ms: float, burst: int, last_probe: int
) -> None:
    link = FakeLink(bandwidth_mbit * MBIT, rtt_ms / 1e3, burst)
    estimate = await measure_link(link.send, ProbePlan(), clock=link.clock)
    assert estimate.bandwidth_bps == pytest.approx(bandwidth_mbit * MBIT, rel=1e-6)
    assert estimate.rtt_s == pytest.approx(rtt_ms / 1e3)
    assert link.sent[:3] == [0, 0, 0]
    assert link.sent[3] == 32 << 10 and link.sent[-1] == last_probe
    assert all(b == 2 * a for a, b in itertools.pairwise(link.sent[3:]))
    assert estimate.probe_bytes == sum(link.sent)


async def test_the_join_measurement_reads_the_last_probe_alone() -> None:
    # SINGLE (epoch 0): from 64 KiB, and a probe past the target ends it; a burst reads high.
    link = FakeLink(2 * MBIT, 0.08)
    estimate = await measure_link(link.send, SINGLE, clock=link.clock)
    assert link.sent == [0, 0, 0, 64 << 10]
    assert estimate.bandwidth_bps == pytest.approx(2 * MBIT, rel=1e-6)
    bucket = FakeLink(10 * MBIT, 0.1, burst=64 << 10)
    estimate = await measure_link(bucket.send, SINGLE, clock=bucket.clock)
    assert estimate.bandwidth_bps == pytest.approx(256 / 192 * 10 * MBIT, rel=1e-6)
    assert ProbePlan.within(1 << 30, differential=False) == SINGLE


def test_bandwidth_comes_from_two_probes_where_they_differ_enough() -> None:
    # A 64 KiB burst passes at once: the last probe alone reads 13.4 Mbit/s on a 10 Mbit/s
    # link, the difference of the last two reads 10.
    probes = [(128 << 10, 0.1 + 0.0524), (256 << 10, 0.1 + 0.1573)]
    assert bandwidth_of(probes, 0.1, 0.1) == pytest.approx(10 * MBIT, rel=1e-3)
    assert bandwidth_of(probes[1:], 0.1, 0.1) == pytest.approx(13.33 * MBIT, rel=1e-3)
    # Two probes closer in time than MIN_SPREAD x target: the last one alone.
    close = [(512 << 10, 0.0050), (1 << 20, 0.0050 + 0.9 * MIN_SPREAD * 0.1)]
    assert bandwidth_of(close, 0.001, 0.1) == pytest.approx(estimate_bandwidth_bps(1 << 20,
                                                                  close[1][1], 0.001))  # fmt: skip


async def test_probe_respects_a_small_message_limit() -> None:
    link = FakeLink(1000 * MBIT, 0.001)
    plan = ProbePlan.within(max_message_bytes=100_000)
    estimate = await measure_link(link.send, plan, clock=link.clock)
    assert max(link.sent) <= 50_000
    assert estimate.bandwidth_bps == pytest.approx(1000 * MBIT, rel=1e-6)
    with pytest.raises(ConfigError):
        ProbePlan(max_bytes=MAX_PROBE_BYTES + 1)


# ------------------------------------------------------------- the probe method, over gRPC


UP, STRANGER = NodeKey.generate(), NodeKey.generate()
"""The node that may probe, and one that may not (each proves its own id: proofs.py)."""


class _Check:
    """A worker's check: only node UP may probe, under epoch 3, 1 MiB at most in all."""

    def __init__(self) -> None:
        self.bytes = 0
        self.ended = 0
        """Probes that ended a measurement (DONE_KEY)."""

    async def __call__(self, peer: str, epoch: int, nbytes: int, done: bool) -> None:
        if peer != UP.node_id or epoch != 3:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"unknown peer {peer!r}")
        if self.bytes + nbytes > 1 << 20:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "probe budget spent")
        self.bytes += nbytes
        self.ended += done


@pytest_asyncio.fixture(loop_scope="module")
async def probe_server() -> AsyncIterator[tuple[str, _Check]]:
    check = _Check()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 8 << 20)])
    server.add_generic_rpc_handlers([ProbeServer(check).handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", check
    finally:
        await server.stop(0)


async def test_probe_method_checks_peer_size_and_budget(probe_server: tuple[str, _Check]) -> None:
    address, check = probe_server
    counters = LinkCounters()
    options = [("grpc.max_send_message_length", 8 << 20)]
    async with (
        grpc.aio.insecure_channel(address, options=options, interceptors=provers(UP)) as up,
        grpc.aio.insecure_channel(
            address, options=options, interceptors=provers(STRANGER)
        ) as stranger,  # fmt: skip
    ):

        def sender(key: NodeKey, epoch: int = 3, node_id: str = "") -> Send:
            return probe_sender(
                up if key is UP else stranger, peer="down", node_id=node_id or key.node_id,
                epoch=epoch, counters=counters, timeout_s=5,
            )  # fmt: skip

        estimate = await measure_link(sender(UP), ProbePlan(max_bytes=256 << 10))
        assert estimate.bandwidth_bps > 0
        assert counters.bytes_sent["down"] == estimate.probe_bytes == check.bytes
        for key, epoch in ((STRANGER, 3), (UP, 2)):
            with pytest.raises(PeerRefused, match="PERMISSION_DENIED"):
                await sender(key, epoch)(1)
        # A stranger claiming UP's id has no proof of it (its own key signs only its own id).
        with pytest.raises(PeerRefused, match=r"UNAUTHENTICATED.*must carry its proof"):
            await sender(STRANGER, node_id=UP.node_id)(1)
        with pytest.raises(PeerRefused, match=r"INVALID_ARGUMENT.*exceeds the limit"):
            await sender(UP)(MAX_PROBE_BYTES + 1)
        # The end of a measurement: an empty probe marked DONE_KEY, nothing else.
        await end_measurement(up, peer="down", node_id=UP.node_id, epoch=3, timeout_s=5)
        assert check.ended == 1
        call = up.unary_unary(PROBE_PATH)
        meta = ((NODE_ID_KEY, UP.node_id), (EPOCH_KEY, "3"), (DONE_KEY, "1"))
        for body, extra in ((b"x", ()), (b"", ((PULL_KEY, "1"),))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(body, metadata=(*meta, *extra), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert check.ended == 1
        with pytest.raises(PeerRefused, match="RESOURCE_EXHAUSTED"):
            await sender(UP)(1 << 20)
    assert counters.bytes_sent["down"] == check.bytes  # refused probes are not counted


async def test_pulled_probes_measure_the_way_back_within_the_same_checks() -> None:
    """A pulled probe asks for its bytes: the answer has exactly that many, the server counts
    them as sent and against the same budget, and a malformed request is refused."""
    check = _Check()
    answered = LinkCounters()
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 8 << 20)])
    server.add_generic_rpc_handlers([ProbeServer(check, answered).handler()])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    counters = LinkCounters()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             interceptors=provers(UP)) as channel:  # fmt: skip

            def puller(node_id: str = UP.node_id) -> Send:
                return probe_sender(channel, peer="down", node_id=node_id, epoch=3,
                                    counters=counters, timeout_s=5, pull=True)  # fmt: skip

            estimate = await measure_link(puller(), ProbePlan(max_bytes=256 << 10))
            assert estimate.bandwidth_bps > 0 and check.bytes == estimate.probe_bytes
            assert counters.total_bytes == 0  # the peer sent them, and counts them
            assert answered.bytes_sent == {UP.node_id: estimate.probe_bytes}
            with pytest.raises(PeerRefused, match="UNAUTHENTICATED"):  # (no proof for it)
                await puller(STRANGER.node_id)(1)
            with pytest.raises(PeerRefused, match="RESOURCE_EXHAUSTED"):
                await puller()(1 << 20)
            call = channel.unary_unary(PROBE_PATH)
            meta = ((NODE_ID_KEY, UP.node_id), (EPOCH_KEY, "3"))
            for body, pull in ((b"", "-1"), (b"", "1e3"), (b"x", "1"), (b"", str(8 << 20))):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(body, metadata=(*meta, (PULL_KEY, pull)), timeout=5)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await server.stop(0)
    assert check.bytes <= 1 << 20


def test_probe_turns_let_one_prober_measure_at_a_time() -> None:
    now = [0.0]
    turns = ProbeTurns(hold_s=2.0, clock=lambda: now[0])
    turns.take("a")
    now[0] = 1.5
    turns.take("a")  # its own next probe
    with pytest.raises(Refusal) as info:
        turns.take("b")  # a's measurement goes on
    assert info.value.code == grpc.StatusCode.ABORTED
    now[0] = 3.6  # a has been quiet for 2.1 s: b's turn
    turns.take("b")
    with pytest.raises(Refusal):
        turns.take("a")
    # b's measurement ends: the turn passes at once (a's end, not holding it, changes nothing).
    turns.admit("a", done=True)
    with pytest.raises(Refusal):
        turns.admit("a")
    turns.admit("b", done=True)
    turns.admit("a")
    with pytest.raises(Refusal):
        turns.admit("b")


def test_a_node_claims_its_own_turn_while_it_measures_its_links() -> None:
    now = [0.0]
    turns = ProbeTurns(hold_s=2.0, clock=lambda: now[0])
    assert turns.claim("me")
    now[0] = 100.0  # however long its measurement takes, neighbours wait for it
    with pytest.raises(Refusal):
        turns.admit("up")
    turns.admit("up", done=True)  # (a neighbour's end changes nothing it does not hold)
    turns.release("me")
    turns.admit("up")  # a neighbour measures this node: the node waits for it
    assert not turns.claim("me")
    turns.admit("up", done=True)
    assert turns.claim("me")


async def test_nodes_measure_their_links_while_no_neighbour_measures_them() -> None:
    """Three stages measure the links they send on at once, each taking probes from one
    neighbour at a time: with their own turns claimed no node is in two measurements at once
    (the middle node's probe bytes would hold up the acknowledgements of an end node's probe
    of it); without, the end node's measurement of the middle node runs during the middle
    node's own."""
    names = ("first", "middle", "last")

    async def measure_all(claim: bool) -> list[tuple[str, str]]:
        turns = {name: ProbeTurns() for name in names}
        active: list[tuple[str, str]] = []
        overlaps: list[tuple[str, str]] = []

        def meter(me: str) -> LinkMeter:
            meter = LinkMeter(node_id=me, transport=TransportConfig(), counters=LinkCounters())

            async def probe(address: str, peer: str, **_: object) -> LinkEstimate:
                try:
                    turns[peer].take(me)
                except Refusal as refusal:
                    raise ProbeBusy(str(refusal)) from None
                overlaps.extend(a for a in active if {me, peer} & set(a))
                active.append((me, peer))
                await asyncio.sleep(0.02)
                active.remove((me, peer))
                turns[peer].release(me)
                return LinkEstimate(rtt_s=0.01, bandwidth_bps=10 * MBIT, probe_bytes=1)

            meter.probe = probe  # type: ignore[method-assign]
            return meter

        def link(peer: str, role: Role) -> tuple[pb.StageAssignment, CodecChoice, float]:
            choice = CodecChoice(AUTO, role, compute_s=_Compute(), every=4, what=peer)
            return pb.StageAssignment(node_id=peer, address=f"{peer}:1"), choice, 0.0

        sends = {
            "first": [link("middle", "activation")],
            "middle": [link("last", "activation"), link("first", "gradient")],
            "last": [link("middle", "gradient")],
        }
        async with asyncio.timeout(20):
            await asyncio.gather(*(
                meter(me).codecs(1, links, own=turns[me] if claim else None)
                for me, links in sends.items()
            ))  # fmt: skip
        assert all(c.bandwidth_bps == 10 * MBIT for links in sends.values() for _, c, _ in links)
        return overlaps

    assert await measure_all(claim=False)  # (what the check catches)
    for _ in range(5):  # (random pauses: a few orders of turns)
        assert await measure_all(claim=True) == []


# ------------------------------------------------------------------ the per-link choice object


class _Compute:
    def __init__(self) -> None:
        self.s = 0.0

    def __call__(self) -> float:
        return self.s


def _send_steps(choice: CodecChoice, compute: _Compute, steps: int, per_mb_s: float) -> list[str]:
    tensor = torch.zeros(4, 32, 64)
    used = []
    for _ in range(steps * 4):
        used.append(choice.outgoing("hidden", tensor).codec.name)
        compute.s += per_mb_s
    return used


async def test_a_node_measures_its_links_one_at_a_time_and_shares_its_uplink_among_them() -> None:
    """LinkMeter.codecs: a middle stage's two links, measured one after the other (they leave
    from the same uplink), each given half of LINK_SHARE; an end stage's one link all of it."""
    meter = LinkMeter(node_id="me", transport=TransportConfig(), counters=LinkCounters())
    measuring: list[str] = []
    order: list[tuple[str, str]] = []

    async def probe(address: str, peer: str, **_: object) -> LinkEstimate:
        assert not measuring, f"{peer} measured while {measuring} was"
        measuring.append(peer)
        order.append(("start", peer))
        await asyncio.sleep(0.01)
        measuring.remove(peer)
        order.append(("end", peer))
        return LinkEstimate(rtt_s=0.01, bandwidth_bps=10 * MBIT, probe_bytes=1)

    meter.probe = probe  # type: ignore[method-assign]

    def link(peer: str, role: Role) -> tuple[pb.StageAssignment, CodecChoice, float]:
        choice = CodecChoice(AUTO, role, compute_s=_Compute(), every=4, what=peer)
        return pb.StageAssignment(node_id=peer, address=f"{peer}:1"), choice, 0.0

    middle = [link("down", "activation"), link("up", "gradient")]
    await meter.codecs(1, middle)
    assert order == [("start", "down"), ("end", "down"), ("start", "up"), ("end", "up")]
    assert [c.share for _, c, _ in middle] == [LINK_SHARE / 2] * 2
    assert all(c.bandwidth_bps == 10 * MBIT for _, c, _ in middle)
    end = [link("down", "activation")]
    await meter.codecs(1, end)
    assert end[0][1].share == LINK_SHARE
    # A neighbour not to be probed (behind NAT) still takes its part of the uplink.
    order.clear()
    behind_nat = [link("down", "activation"), (None, link("up", "gradient")[1], 0.0)]
    await meter.codecs(1, behind_nat)
    assert order == [("start", "down"), ("end", "down")]
    assert [c.share for _, c, _ in behind_nat] == [LINK_SHARE / 2] * 2
    assert behind_nat[1][1].bandwidth_bps is None


def test_a_smaller_share_of_the_budget_takes_a_lighter_codec() -> None:
    def used(share: float) -> list[str]:
        compute = _Compute()
        choice = CodecChoice(AUTO, "activation", compute_s=compute, every=4, what="test")
        choice.bandwidth_bps, choice.share = 20 * MBIT, share  # int8: 3.3 ms, int4: 1.8 ms
        return _send_steps(choice, compute, 3, per_mb_s=0.010)

    assert used(LINK_SHARE)[8:] == ["int8-block"] * 4  # fits 5 ms (4 ms to move to it)
    assert used(LINK_SHARE / 2)[8:] == ["int4-block"] * 4  # 2.5 ms: only int4-block fits


def test_auto_starts_small_then_follows_the_measurements() -> None:
    compute = _Compute()
    choice = CodecChoice(AUTO, "activation", compute_s=compute, every=4, what="test")
    choice.bandwidth_bps = 1000 * MBIT  # 32 KiB in 0.26 ms
    used = _send_steps(choice, compute, 3, per_mb_s=0.004)  # budget 2 ms
    # Step 0 has nothing measured, step 1's measurement is start-up: skipped.
    assert used == ["int4-block"] * 8 + ["none"] * 4
    assert choice.frames == {"int4-block": 8, "none": 4}
    assert choice.compute_per_microbatch_s == pytest.approx(0.004)
    choice.bandwidth_bps = 1 * MBIT  # 32 KiB in 262 ms; int4 in 37 ms: nothing fits
    assert _send_steps(choice, compute, 2, per_mb_s=0.004)[-4:] == ["int4-block"] * 4


def test_the_first_measured_decision_is_free_of_the_hysteresis() -> None:
    """The codec auto starts with was chosen blind: the first decision on measurements takes
    the most faithful codec that fits, margin or not (later ones keep the margin)."""
    compute = _Compute()
    choice = CodecChoice(AUTO, "activation", compute_s=compute, every=4, what="test")
    choice.peer_decodes_klt = True
    choice.bandwidth_bps = 8 * MBIT  # int4-block (4.6 kB) in 4.6 ms: within 5, not within 4
    assert _send_steps(choice, compute, 4, per_mb_s=0.010) == [COMPACT] * 8 + ["int4-block"] * 8


def test_auto_packs_with_deflate_only_while_the_link_is_the_bottleneck() -> None:
    def link(peer_unpacks_deflate: bool = True, packs: bool = True) -> tuple[CodecChoice, _Compute]:
        compute = _Compute()
        choice = CodecChoice(AUTO, "gradient", compute_s=compute, every=4, what="test",
                             packs=packs)  # fmt: skip
        choice.bandwidth_bps = 1 * MBIT  # int4 of 8,192 elements (4.6 kB) in 37 ms
        choice.peer_unpacks_deflate = peer_unpacks_deflate
        return choice, compute

    coarse: list[bool] = []

    def asked(choice: CodecChoice, compute: _Compute, steps: int) -> list[bool]:
        tensor = torch.zeros(4, 32, 64)
        out = []
        for _ in range(steps * 4):
            sent = choice.outgoing("grad", tensor)
            out.append(sent.deflate)
            coarse.append(isinstance(sent.codec, BlockQuant) and sent.codec.codes == COARSE_CODES)
            choice.sent("deflate" if sent.deflate else "")  # (as encode_frame would report it)
            compute.s += 0.004  # budget 2 ms
        return out

    # Nothing measured for two steps; then the link is the bottleneck, and the gradients go
    # with coarse codes (still int4-block on the wire) as long as they are deflated.
    choice, compute = link()
    assert asked(choice, compute, 3) == [False] * 8 + [True] * 4
    assert coarse == [False] * 8 + [True] * 4
    assert choice.deflated == 4 and choice.name == "int4-block"
    # A much faster link: int4 fits the budget, or a more faithful codec does: no deflate.
    choice.bandwidth_bps = 1000 * MBIT
    assert asked(choice, compute, 2) == [False] * 8
    assert choice.deflated == 4 and not any(coarse[12:])
    # Activations are deflated on the same link; they keep all 15 values, with one scale per
    # 256 elements.
    activations = CodecChoice(AUTO, "activation", compute_s=(a := _Compute()), every=4,
                              what="test")  # fmt: skip
    activations.bandwidth_bps, activations.peer_unpacks_deflate = 1 * MBIT, True
    sent = []
    for _ in range(12):
        sent.append(activations.outgoing("hidden", torch.zeros(4, 32, 64)))
        a.s += 0.004
    assert [o.deflate for o in sent] == [False] * 8 + [True] * 4
    kinds = [(o.codec.block, o.codec.codes) for o in sent if isinstance(o.codec, BlockQuant)]
    assert kinds == [(64, 0)] * 8 + [(BOTTLENECK_BLOCK, 0)] * 4
    # Never towards a peer that does not unpack it (an older node), nor with packing off.
    for choice, compute in (link(peer_unpacks_deflate=False), link(packs=False)):
        assert not any(asked(choice, compute, 4)) and choice.deflated == 0


def test_auto_sends_klt_only_to_a_peer_that_decodes_it_and_keeps_its_basis() -> None:
    def run(decodes: bool, steps: int = 6) -> tuple[CodecChoice, list[str]]:
        compute = _Compute()
        choice = CodecChoice(AUTO, "activation", compute_s=compute, every=4, what="test")
        choice.bandwidth_bps, choice.peer_decodes_klt = 1 * MBIT, decodes
        used = []
        for _ in range(steps * 4):
            sent = choice.outgoing("hidden", torch.randn(4, 32, 64))
            sent.codec.encode(sent.tensor, sent.state)  # (klt learns its basis as it encodes)
            used.append(sent.codec.name)
            nbytes = 9000 if 0 < used.count(COMPACT) <= 9 else 2000
            if choice.step == COARSE_LABEL:  # (the link sets the pace: klt's coarser step)
                nbytes = round(nbytes * COARSE_SHRINK["activation"])
            choice.sent("", nbytes=nbytes, coding_s=0.0005)
            compute.s += 0.004
        return choice, used

    choice, used = run(decodes=True)
    assert used == [COMPACT] * 24  # (from the first frame: the most compact it decodes)
    assert choice.frames == {COMPACT: 8, COARSE: 16}
    # Its first 9 frames (the identity basis, then the first two bases) do not count; those at
    # the coarser step count as the default step's.
    assert choice.frame_bytes[COMPACT] == pytest.approx(2000, abs=2)
    assert choice.coding_s[COMPACT] == pytest.approx(0.0005)
    # An older peer never gets klt.
    assert set(run(decodes=False)[1]) == {"int4-block"}
    # Away from klt and back: the same sender state, its learned basis with it.
    kept = choice.outgoing("hidden", torch.randn(4, 32, 64)).state
    choice.bandwidth_bps = 1e12
    for _ in range(8):
        choice.outgoing("hidden", torch.randn(4, 32, 64))
    assert choice.name == "none"
    choice.bandwidth_bps = 1 * MBIT
    for _ in range(8):
        back = choice.outgoing("hidden", torch.randn(4, 32, 64))
    assert back.codec.name == COMPACT and back.state is kept


def test_klt_comes_after_the_ladder_though_it_errs_less_than_int4_block() -> None:
    ladder = payload_sizes("activation", (4, 32, 64), torch.float32)
    assert [name for name, _ in ranked("activation", ladder, 2000)] == [
        "none", "bf16", "int8-block", "int4-block", FINE, COMPACT, COARSE,
    ]  # fmt: skip
    assert dict(ranked("activation", ladder, 2000))[FINE] == round(FINE_GROWTH * 2000)
    assert [name for name, _ in ranked("gradient", ladder, 2000)] == [
        "none", "bf16", "int8-block", "int4-block", COMPACT, COARSE,
    ]  # fmt: skip
    for role in ("activation", "gradient"):
        assert dict(ranked(role, ladder, 2000))[COARSE] == round(COARSE_SHRINK[role] * 2000)
    # Not for want of fidelity by the norm: on a boundary-like tensor (a few strong
    # directions) klt at its finer step, and klt's gradients, err less than int4-block; under
    # the pipeline's staleness klt's error costs more loss (the rank's docstring).
    torch.manual_seed(0)
    x = torch.randn(4, 32, 8) @ torch.randn(8, 64) + 0.05 * torch.randn(4, 32, 64)

    def error(name: str, role: Role, fine: bool = False) -> float:
        codec, bases = encoder(name, role, fine=fine), KLTBases()
        state = codec.new_state()
        for _ in range(9):  # (klt learns its basis over its first frames; all decoded in turn)
            params, payload = codec.encode(x, state)
            if isinstance(codec, KLT):
                back, commit = codec.decode_stream(bases, memoryview(payload), x.shape,
                                                   x.dtype, params)  # fmt: skip
                commit()
            else:
                back = codec.decode(memoryview(payload), x.shape, x.dtype, params)
        return float((back - x).norm() / x.norm())

    assert error(COMPACT, "activation", fine=True) < error("int4-block", "activation")
    assert error(COMPACT, "gradient") < error("int4-block", "gradient")


def test_auto_gives_klt_activations_the_finer_step_where_the_link_has_room() -> None:
    def run(role: str, bandwidth_bps: float, choice: CodecChoice | None = None,
            steps: int = 6) -> tuple[CodecChoice, list[object]]:  # fmt: skip
        compute = _Compute()
        if choice is None:
            choice = CodecChoice(AUTO, role, compute_s=compute, every=4, what="test")  # type: ignore[arg-type]
            choice.peer_decodes_klt = True
        else:
            compute = choice._compute_s  # type: ignore[assignment]
        choice.bandwidth_bps = bandwidth_bps
        codecs = []
        for _ in range(steps * 4):
            sent = choice.outgoing("hidden", torch.randn(4, 32, 64))
            sent.codec.encode(sent.tensor, sent.state)
            codecs.append(sent.codec)
            fine = sent.codec is KLT_ACTIVATION_FINE
            coarse = sent.codec is KLT_ACTIVATION_COARSE or sent.codec is KLT_GRADIENT_COARSE
            nbytes = 2700 if fine else 1500 if coarse else 2000
            choice.sent("", nbytes=nbytes, coding_s=0.00005)
            compute.s += 0.020  # budget 10 ms
        return choice, codecs

    # 3 Mbit/s: int4-block (4.6 kB, 12 ms) does not fit, klt at its finer step does (1.35 x
    # its frames). Its frames are klt on the wire, counted apart; their bytes enter klt's
    # mean as the default step's.
    choice, codecs = run("activation", 3 * MBIT)
    assert codecs[8:] == [KLT_ACTIVATION_FINE] * 16 and choice.fine
    assert KLT_ACTIVATION_FINE.name == COMPACT
    assert choice.frames == {COMPACT: 8, COMPACT + FINE_LABEL: 16}
    assert choice.frame_bytes[COMPACT] == pytest.approx(2000, abs=1)
    # 8 Mbit/s: int8-block fits (8.7 ms of 10) and is taken once measured, on both roles and
    # towards an older peer alike; klt is for links where the ladder does not fit.
    assert run("activation", 8 * MBIT)[0].frames == {COMPACT: 8, "int8-block": 16}
    assert run("gradient", 8 * MBIT)[0].frames == {COMPACT: 8, "int8-block": 16}
    older = CodecChoice(AUTO, "activation", compute_s=_Compute(), every=4, what="test")
    assert run("activation", 8 * MBIT, older)[0].frames == {"int4-block": 8, "int8-block": 16}
    # Gradients keep klt's own step where it fits (5.3 ms of 10).
    assert run("gradient", 3 * MBIT)[0].frames == {COMPACT: 24}
    # Where even klt sets the pace, both roles take its coarser step: fewer bytes, less time.
    slow, codecs = run("activation", 1 * MBIT)
    assert codecs[8:] == [KLT_ACTIVATION_COARSE] * 16 and slow.step == COARSE_LABEL
    assert slow.frames == {COMPACT: 8, COARSE: 16}
    assert slow.frame_bytes[COMPACT] == pytest.approx(1500 / COARSE_SHRINK["activation"], abs=1)
    slow, codecs = run("gradient", 1 * MBIT)
    assert codecs[:8] == [KLT_GRADIENT] * 8 and codecs[8:] == [KLT_GRADIENT_COARSE] * 16
    # The link slows down: to the coarser step, with the same sender state (basis).
    kept = choice.outgoing("hidden", torch.randn(4, 32, 64)).state
    choice, codecs = run("activation", 1 * MBIT, choice)
    assert codecs[-4:] == [KLT_ACTIVATION_COARSE] * 4 and not choice.fine
    assert choice.outgoing("hidden", torch.randn(4, 32, 64)).state is kept
    # And speeds up again: back to the finer step once it fits with the margin.
    choice, codecs = run("activation", 3 * MBIT, choice)
    assert codecs[-4:] == [KLT_ACTIVATION_FINE] * 4 and choice.fine


def _error_and_bytes(codec: KLT, x: torch.Tensor) -> tuple[float, int]:
    """(mean squared error, payload bytes) of one frame of `codec`, decoded by the registered
    klt decoder (a frame carries its step: every klt decoder reads every step)."""
    params, payload = codec.encode(x, codec.new_state())
    back = CODECS[COMPACT].decode(memoryview(payload), x.shape, x.dtype, params)
    return float((back - x).square().mean()), len(payload)


def test_the_finer_klt_step_is_read_by_every_klt_decoder_and_errs_less() -> None:
    x = torch.randn(4, 32, 64) * torch.linspace(0.1, 3.0, 64)
    assert encoder(COMPACT, "activation", fine=True) is KLT_ACTIVATION_FINE
    assert encoder(COMPACT, "gradient", fine=True) is not KLT_ACTIVATION_FINE
    (error, size), (fine_error, fine_size) = (
        _error_and_bytes(codec, x) for codec in (KLT_ACTIVATION, KLT_ACTIVATION_FINE)
    )
    assert fine_error < 0.6 * error and fine_size > size


def test_the_coarser_klt_step_is_read_by_every_klt_decoder_and_takes_fewer_bytes() -> None:
    assert encoder(COMPACT, "activation", coarse=True) is KLT_ACTIVATION_COARSE
    assert encoder(COMPACT, "gradient", coarse=True) is KLT_GRADIENT_COARSE
    assert encoder("int4-block", "gradient", coarse=True).name == "int4-block"
    for codec in (KLT_ACTIVATION_COARSE, KLT_GRADIENT_COARSE):
        assert variant_label(codec) == COARSE_LABEL
    torch.manual_seed(0)
    x = torch.randn(8, 64, 8) @ torch.randn(8, 64) + 0.3 * torch.randn(8, 64, 64)
    for default, coarse in ((KLT_ACTIVATION, KLT_ACTIVATION_COARSE),
                            (KLT_GRADIENT, KLT_GRADIENT_COARSE)):  # fmt: skip
        (error, size), (coarse_error, coarse_size) = (
            _error_and_bytes(codec, x) for codec in (default, coarse)
        )
        assert coarse_size < 0.9 * size and coarse_error > error


def test_auto_without_a_measured_link_keeps_the_most_compact_codec_its_peer_decodes() -> None:
    for decodes_klt, kept in ((False, "int4-block"), (True, COMPACT)):
        compute = _Compute()
        choice = CodecChoice(AUTO, "gradient", compute_s=compute, every=4, what="test")
        choice.peer_decodes_klt = decodes_klt
        assert set(_send_steps(choice, compute, 4, per_mb_s=0.01)) == {kept}


def test_a_named_codec_never_changes() -> None:
    compute = _Compute()
    choice = CodecChoice("bf16", "activation", compute_s=compute, every=4, what="test")
    choice.bandwidth_bps = 1.0
    assert set(_send_steps(choice, compute, 4, per_mb_s=0.01)) == {"bf16"}
    assert not choice.auto


# ------------------------------------------------------------------------------ configuration


def test_auto_is_accepted_wherever_a_codec_is_and_travels_in_the_run_spec() -> None:
    for kwargs in ({"codec": AUTO}, {"activation_codec": AUTO}, {"gradient_codec": AUTO}):
        TrainConfig(**kwargs)
    run = TrainConfig(codec=AUTO, gradient_codec="int8-block", fault_slow_link=0,
                      fault_link_kbps=500)  # fmt: skip
    back = TrainConfig.from_proto(run.to_proto(""))
    assert (back.activation, back.gradient) == (AUTO, "int8-block")
    assert back.link_pace_bps(0) == 500_000 and back.link_pace_bps(1) == 0
    assert AUTO not in CODECS  # never a wire codec
    with pytest.raises(ConfigError, match="or auto"):
        TrainConfig(codec="automatic")
    with pytest.raises(ConfigError, match="fault_link_kbps"):
        TrainConfig(fault_slow_link=0)


# ------------------------------------------------------------------------ a real swarm


def test_a_slow_link_gets_a_lighter_codec_than_a_fast_one(tmp_path: Path) -> None:
    """Three nodes on loopback, `--codec auto`; the link between stages 0 and 1 is paced to
    1 Mbit/s each way. Both directions of it settle on klt (every node decodes it, and it
    costs least where the link is the bottleneck); the loopback link between stages 1 and 2 on
    something more faithful; training works."""
    steps = 10
    s = demo_summary(
        tmp_path, "auto", "--model", "tiny", "--seed", "0", "--steps", str(steps),
        "--codec", "auto", "--fault-slow-link", "0", "--fault-link-kbps", "1000",
    )  # fmt: skip
    first, middle, last = s["stages"]
    assert (s["codec"], s["gradient_codec"]) == (AUTO, AUTO)
    candidates = {*AUTO_LADDER, COMPACT}
    frame_labels = {*candidates, FINE, COARSE}
    # Every link reports a registered codec per role, and what it measured.
    for stage, role in ((first, "activation"), (middle, "activation"), (middle, "gradient"),
                        (last, "gradient")):  # fmt: skip
        assert stage[f"{role}_codec"] in candidates
        assert sum(stage[f"{role}_codec_frames"].values()) == steps * 4
        assert set(stage[f"{role}_codec_frames"]) <= frame_labels
    assert first["gradient_codec"] == "" and last["activation_codec"] == ""
    # The slow link: measured near its pace; klt both ways from the first frame (while nothing
    # is measured, the most compact codec the peer decodes), at its coarser step from the
    # first decision on (even klt sets the pace there), never deflated (its payloads are
    # entropy-coded already).
    assert 0.5 * MBIT < first["downstream_bandwidth_bps"] < 1.1 * MBIT
    assert 0.5 * MBIT < middle["upstream_bandwidth_bps"] < 1.1 * MBIT
    assert first["activation_codec_frames"] == {COMPACT: 8, COARSE: steps * 4 - 8}
    assert middle["gradient_codec_frames"] == {COMPACT: 8, COARSE: steps * 4 - 8}
    assert first["activation_deflated_frames"] == 0 == middle["gradient_deflated_frames"]
    # The loopback link: far faster, and a more faithful codec once measured.
    assert middle["downstream_bandwidth_bps"] > 50 * MBIT
    assert middle["activation_codec_frames"][COMPACT] == 8
    rank = AUTO_LADDER.index
    assert rank(middle["activation_codec"]) < rank("int4-block")
    assert rank(last["gradient_codec"]) < rank("int4-block")
    assert s["final_loss"] < s["initial_loss"]


def test_a_fixed_klt_leaves_columns_out_towards_a_peer_whose_plan_entry_decodes_them() -> None:
    """A fixed `--codec klt` learns what its peer decodes from the plan as `auto` does: the
    coder with columns (fewer symbols to code) where the peer decodes it, all columns where
    it does not."""
    for coder, columns in ((CODER_COLUMNS, True), (CODER_COLUMNS - 1, False)):
        choice = CodecChoice("klt", "gradient", compute_s=_Compute(), every=4, what="test")
        choice.meet(unpacks_deflate=True, decodes_klt=True, klt_coder=coder)
        out = choice.outgoing("grad", torch.randn(4, 32, 64))
        assert isinstance(out.state, KLTState) and out.state.columns is columns
