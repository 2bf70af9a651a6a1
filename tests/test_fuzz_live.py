"""A live, training swarm under a storm of random and mutated messages at every method it serves,
then a flood of streams from one peer: no handler fails, hostile frames reach the frame checks
of training nodes and are refused with INVALID_ARGUMENT, every node trains to the end, and the
run ends exactly as a plain PyTorch loop trains it: nothing refused changed a parameter.

A stage's real upstream holds its stream slot for the whole run (another stream claiming to be
it is refused before a frame is read, ALREADY_EXISTS), and a frame refused on that stream ends
it and the plan with it. So the nodes run with --fault-fuzz-upstream FUZZER: a stream claiming
to come from FUZZER is checked frame by frame as the upstream's is, against the stage as it
trains (the plan's shapes, the microbatch the stage expects next, its window, the payload
decoded), and nothing of it is admitted. FUZZER has a key of its own and proves its id on
every call (identity.py); a call claiming another node's id without that node's key is refused
UNAUTHENTICATED before anything else (the storm's "upstream", "stranger" and "none" claims;
`_impersonate`, a stranger with a key of its own, names the middle stage on every member call
and on a boundary stream)."""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ravnest_node.averaging import wire
from ravnest_node.compression import get_codec
from ravnest_node.identity import PROOF_METADATA, NodeKey
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import PROTOCOL
from ravnest_node.transport import boundary, probe, proofs
from ravnest_node.transport.frames import MAGIC, FrameKind, Outgoing, encode_frame
from ravnest_node.transport.options import TransportConfig
from ravnest_node.transport.proofs import request_digest

from .conftest import Procs, node_status, poll_until, progress_events, swarm_view
from .training import assert_same_training, plain_training, trained_run

STEPS = 400
TRAIN = ("--model", "tiny", "--steps", str(STEPS), "--seed", "0", "--max-staleness", "0",
         "--codec", "none")  # fmt: skip
FUZZER_KEY = NodeKey.generate()
FUZZER = FUZZER_KEY.node_id
EXAMPLES = 1000
FUZZED = 500
FLOOD = 100
PEER_MAX_CALLS = TransportConfig().peer_max_calls
COORDINATOR = "/ravnest.v1.Coordinator/"
ENTRIES = [
    *((f"{COORDINATOR}{m}", "unary")
      for m in ("Join", "Report", "Swarm", "Heartbeat", "Leave", "Drain", "Suspect")),
    (f"{COORDINATOR}WatchPlan", "server-stream"),
    (f"{COORDINATOR}WatchProgress", "server-stream"),
    ("/ravnest.v1.Node/Status", "unary"),
    ("/ravnest.v1.Node/FetchBlock", "server-stream"),
    ("/ravnest.v1.Node/FetchCheckpoint", "server-stream"),
    (probe.PATH, "unary"),
    (wire.PATH, "unary"),
    (boundary.PATH, "frames"),
    (boundary.BACK_PATH, "frames"),
]  # fmt: skip
"""Every method a node serves to peers (Election only runs with --join elect), and how it is
called: random bytes as the request (a server stream: up to its first answer), or random and
mutated frames on a stream."""
CODECS = ("none", "bf16", "fp16", "int8-block", "int4-block")
"""Codecs a frame may come in (a sender with codec auto picks one per frame)."""
SHAPES = ((4, 32, 64), (4, 32, 63), (2, 32, 64), (4, 2048), (1, 4, 32, 64))
"""The activation's shape in the plan, and others."""
REFUSED_BY = {
    "the plan": re.compile(r"does not match the plan's|carries tensors"),
    "the schedule": re.compile(r"forward seq|weight version|in flight|last microbatch"),
    "the payload": re.compile(r"unpack|bad lz4|bad deflate|wrong size|codec \S+: |not finite"),
}
"""What refused a frame, from the INVALID_ARGUMENT's details (otherwise: the parser, which
checks a frame's structure and sizes before anything is allocated)."""


def _frame(seq: int, rng: random.Random) -> bytes:
    """A well-formed activation frame of tiny's first boundary, for microbatch `seq` of a run
    at staleness 0, in a random codec; now and then of a shape the plan does not have."""
    shape = rng.choice(SHAPES) if rng.random() < 0.1 else SHAPES[0]
    # Zeros pack (lz4, or deflate where asked), so that mutations reach the unpacking too.
    values = torch.zeros(shape) if rng.random() < 0.3 else torch.randn(shape)
    hidden = Outgoing("hidden", values, get_codec(rng.choice(CODECS)), deflate=rng.random() < 0.5)
    targets = torch.zeros(4, 32, dtype=torch.uint8)
    return encode_frame(FrameKind.FORWARD, seq, seq // 4,
                        [hidden, ("targets", targets, get_codec("none"))])  # fmt: skip


def _mutate(frame: bytes, rng: random.Random) -> bytes:
    """A frame with a few random changes: bytes flipped (half the time only in its payloads,
    which leaves a frame that parses), cut or inserted."""
    out = bytearray(frame)
    payloads = len(MAGIC) + 4 + int.from_bytes(frame[len(MAGIC) : len(MAGIC) + 4], "little")
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 8)):
            out[rng.randrange(payloads, len(out))] = rng.randrange(256)
        return bytes(out)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(3)
        if op == 0 and out:  # flip a byte
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif op == 1:  # cut
            del out[rng.randrange(len(out) + 1) :]
        else:  # insert
            at = rng.randrange(len(out) + 1)
            out[at:at] = rng.randbytes(rng.randint(1, 32))
    return bytes(out)


class Storm:
    """One hostile peer's calls at the swarm, and what they were answered."""

    def __init__(self, nodes: list[dict[str, Any]], stages: dict[str, int], epoch: int,
                 upstream: str) -> None:  # fmt: skip
        self.nodes, self.stages, self.epoch, self.upstream = nodes, stages, epoch, upstream
        self.channels = [grpc.insecure_channel(n["address"]) for n in nodes]
        self.codes: Counter[str] = Counter()
        self.hits: Counter[str] = Counter()
        self.fuzzed: Counter[str] = Counter()
        """Outcomes of FUZZER's streams at a training stage under its plan: OK (every frame
        passed every check), what refused a frame, or another status code."""
        self.expected: dict[int, int] = {}
        """Per target: the microbatch its stage last said it expects next."""

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    def frames(self, target: int, rng: random.Random, seq: int, payload: bytes) -> list[bytes]:
        """One to three messages: raw bytes, or frames (near the microbatch the target expects
        next, if known), most of them mutated."""
        out = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.2:
                out.append(payload)
                continue
            near = self.expected.get(target)  # (the stage moves on meanwhile)
            at = near + rng.randrange(3) if near is not None and rng.random() < 0.9 else seq
            frame = _frame(at % 2**31, rng)
            out.append(_mutate(frame, rng) if rng.random() < 0.6 else frame)
        return out

    def claim(
        self, claimed: str, rng: random.Random, seq: int
    ) -> tuple[int, list[tuple[str, str]]]:
        """The plan epoch and metadata a call claims: the plan's epoch, an old one, nonsense, or
        one far ahead (refused at once: one just ahead waits for its plan, as a neighbour's may,
        which would slow the storm down); FUZZER mostly claims the plan's."""
        claims = [self.epoch, self.epoch - 1, -abs(seq) - 1, abs(seq) + 2**41]
        claim = self.epoch if claimed == FUZZER and rng.random() < 0.8 else rng.choice(claims)
        metadata = [(proofs.EPOCH_KEY, str(claim))]
        if claimed != "none":
            ids = {"upstream": self.upstream, "stranger": "x1", FUZZER: FUZZER}
            metadata.append((proofs.NODE_ID_KEY, ids[claimed]))
        return claim, metadata

    def call(self, target: int, entry: tuple[str, str], payload: bytes, seed: int, claimed: str,
             seq: int, messages: list[bytes] | None = None) -> None:  # fmt: skip
        """One hostile call (`messages`: the frames to send, instead of random ones)."""
        path, how = entry
        if path.startswith(COORDINATOR):
            target = 0  # only the coordinator serves those
        rng = random.Random(seed)
        claim, metadata = (
            (self.epoch, [(proofs.EPOCH_KEY, str(self.epoch)), (proofs.NODE_ID_KEY, FUZZER)])
            if messages is not None else self.claim(claimed, rng, seq)
        )  # fmt: skip
        if (proofs.NODE_ID_KEY, FUZZER) in metadata:  # FUZZER proves its id (proofs.py)
            metadata.append((PROOF_METADATA, FUZZER_KEY.prove(path, str(claim), "")))
        channel = self.channels[target]
        fuzzed = (path == boundary.PATH and claimed == FUZZER and claim == self.epoch
                  and self.stages[self.nodes[target]["node_id"]] > 0)  # fmt: skip
        try:
            if how == "unary":
                channel.unary_unary(path)(payload, metadata=metadata, timeout=1)
            elif how == "server-stream":
                call = channel.unary_stream(path)(payload, metadata=metadata, timeout=1)
                next(call, None)  # its first answer (WatchPlan's: the plan) or its refusal
                call.cancel()
            else:
                messages = messages or self.frames(target, rng, seq, payload)
                list(channel.stream_stream(path)(iter(messages), metadata=metadata, timeout=1))
            self.codes["OK"] += 1
            if fuzzed:
                self.fuzzed["OK"] += 1
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            code, details = exc.code(), exc.details() or ""
            # UNKNOWN is a handler that raised: a bug (bytes that are not the request's
            # protobuf are refused INVALID_ARGUMENT, transport/malformed.py).
            assert code != grpc.StatusCode.UNKNOWN, (path, details)
            self.codes[code.name] += 1
            if fuzzed:
                self.fuzzed[self._refused_by(code, details, target)] += 1
        self.hits[path] += 1

    def learn(self, target: int) -> None:
        """Ask the stage of `target` which microbatch it expects next: it says so when it
        refuses a frame of another (one hostile stream more)."""
        frame = _frame(0, random.Random(0))
        self.call(target, (boundary.PATH, "frames"), frame, 0, FUZZER, 0, [frame])

    def _refused_by(self, code: grpc.StatusCode, details: str, target: int) -> str:
        if code != grpc.StatusCode.INVALID_ARGUMENT:
            return code.name
        assert details.startswith("frame refused: "), details
        if found := re.search(r"forward seq \d+, expected (\d+)", details):
            self.expected[target] = int(found[1])
        return next((what for what, reason in REFUSED_BY.items() if reason.search(details)),
                    "the parser")  # fmt: skip


def _run_storm(storm: Storm, training: list[int]) -> None:
    """The storm: EXAMPLES random calls at every method, then FUZZED streams of FUZZER's frames
    at the `training` stages (those that take frames from upstream), each after asking the
    stage which microbatch it expects next."""

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    @given(
        target=st.integers(0, 2),
        entry=st.sampled_from(ENTRIES),
        payload=st.binary(max_size=512),
        seed=st.integers(0, 2**32 - 1),
        claimed=st.sampled_from(["upstream", FUZZER, "stranger", "none"]),
        seq=st.integers(-(2**40), 2**40),
    )
    def storm_once(target: int, entry: tuple[str, str], payload: bytes, seed: int, claimed: str,
                   seq: int) -> None:  # fmt: skip
        storm.call(target, entry, payload, seed, claimed, seq)

    @settings(max_examples=FUZZED, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
    @given(target=st.sampled_from(training), payload=st.binary(max_size=512),
           seed=st.integers(0, 2**32 - 1), seq=st.integers(0, 4 * STEPS))  # fmt: skip
    def fuzz_once(target: int, payload: bytes, seed: int, seq: int) -> None:
        storm.learn(target)
        storm.call(target, (boundary.PATH, "frames"), payload, seed, FUZZER, seq)

    storm_once()
    fuzz_once()


def _swarm(procs: Procs, tmp_path: Path) -> list[dict[str, Any]]:
    """Three nodes training TRAIN (n0 the coordinator), each checking FUZZER's streams: their
    ready events."""
    fuzz = ("--fault-fuzz-upstream", FUZZER)
    _, first = procs.start_node(tmp_path / "n0", "--swarm-size", "3", *TRAIN, *fuzz)
    return [first] + [
        procs.start_node(tmp_path / f"n{i}", "--join", first["address"], *fuzz)[1] for i in (1, 2)
    ]


def test_a_training_swarm_shrugs_off_thousands_of_hostile_messages(
    procs: Procs, tmp_path: Path
) -> None:
    nodes = _swarm(procs, tmp_path)
    coordinator = nodes[0]["address"]
    poll_until(lambda: len(swarm_view(coordinator).plan.stages) == 3, 60)
    plan = swarm_view(coordinator).plan
    stages = {s.node_id: s.index for s in plan.stages}
    middle = next(n["address"] for n in nodes if stages[n["node_id"]] == 1)
    poll_until(lambda: node_status(middle).stage == 1, 60)
    storm = Storm(nodes, stages, plan.epoch, node_status(middle).upstream_node_id)
    refused_before = sum(node_status(n["address"]).frames_refused for n in nodes)

    started = time.monotonic()
    _run_storm(storm, [i for i, n in enumerate(nodes) if stages[n["node_id"]] > 0])
    during = not node_status(middle).run_done
    storm.close()
    print(
        f"{sum(storm.hits.values())} hostile messages in {time.monotonic() - started:.1f} s: "
        f"{dict(storm.codes)}; FUZZER's streams at training stages: {dict(storm.fuzzed)}"
    )
    assert sum(storm.hits.values()) == EXAMPLES + 2 * FUZZED and during, "the swarm should train on"
    assert set(storm.hits) == {path for path, _ in ENTRIES} and min(storm.hits.values()) >= 20
    for refusal in ("FAILED_PRECONDITION", "UNAUTHENTICATED", "PERMISSION_DENIED",
                    "INVALID_ARGUMENT"):
        assert storm.codes[refusal] >= 10, storm.codes
    # FUZZER's frames reached every check of a stage as it trained: each stream ended refused
    # by one with INVALID_ARGUMENT and why, or passed them all; the nodes counted each refusal.
    assert set(storm.fuzzed) <= {"OK", "the parser", *REFUSED_BY}, storm.fuzzed
    assert all(storm.fuzzed[what] >= 3 for what in ("OK", "the parser", *REFUSED_BY)), storm.fuzzed
    refused = sum(node_status(n["address"]).frames_refused for n in nodes) - refused_before
    assert refused == storm.fuzzed.total() - storm.fuzzed["OK"]
    last = next(n["address"] for n in nodes if stages[n["node_id"]] == 2)
    _impersonate(coordinator, next(n for n, i in stages.items() if i == 1), plan.epoch, last)
    _flood(coordinator)
    assert not node_status(middle).run_done, "the flood should hit a swarm that is still training"
    # Meanwhile, the same run in a plain PyTorch loop (one torch thread, as every node has).
    reference = plain_training("tiny", STEPS)
    # Every node lived and trained to the end under its first plan, exactly as the plain loop:
    # nothing refused changed a parameter.
    summary = json.loads(list(progress_events(coordinator, timeout_s=600))[-1].summary_json)
    assert summary["crashes"] == [] and len(summary["plans"]) == 1
    assert_same_training(trained_run(summary, [tmp_path / f"n{i}" for i in range(3)]), reference)
    for proc in procs.started:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def _impersonate(coordinator: str, member: str, epoch: int, downstream: str) -> None:
    """Every call that speaks for a member, naming the middle stage's node, without a proof
    or with a stranger's (a key of its own, a proof made for this very request), and a
    boundary stream to the last stage claiming to be the middle: each is refused
    UNAUTHENTICATED (and the run's one plan, asserted at the end, shows that none of them
    changed anything)."""
    stranger = NodeKey.generate()
    calls = [
        ("Leave", pb.LeaveRequest(node_id=member)),
        ("Heartbeat", pb.HeartbeatRequest(node_id=member)),
        ("Report", pb.StageReport(node_id=member, stage=1, plan_epoch=epoch, step=1)),
        ("Suspect", pb.SuspectRequest(node_id=member, plan_epoch=epoch, suspects=[member])),
        ("Drain", pb.DrainRequest(node_id=member, plan_epoch=epoch)),
        ("Join", pb.JoinRequest(node_id=member, address="127.0.0.1:9", protocol=PROTOCOL)),
    ]
    with grpc.insecure_channel(coordinator) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for method, request in calls:
            signed = stranger.prove(COORDINATOR + method, request_digest(request))
            for metadata in ((), ((PROOF_METADATA, signed),)):
                with pytest.raises(grpc.RpcError) as refused:
                    getattr(stub, method)(request, metadata=metadata, timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, (
                    method, refused.value.details())  # fmt: skip
    with grpc.insecure_channel(downstream) as channel:
        metadata = [(proofs.NODE_ID_KEY, member), (proofs.EPOCH_KEY, str(epoch)),
                    (proofs.GENERATION_KEY, "1")]  # fmt: skip
        for proof in ((), ((PROOF_METADATA, stranger.prove(boundary.PATH, str(epoch), "1")),)):
            frame = _frame(0, random.Random(0))
            call = channel.stream_stream(boundary.PATH)
            with pytest.raises(grpc.RpcError) as refused:
                list(call(iter([frame]), metadata=(*metadata, *proof), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value.details()


def _flood(coordinator: str) -> None:
    """One peer opens 100 long-lived streams at the coordinator. It gets peer_max_calls of
    them; the swarm's own calls are still served."""
    limited_before = node_status(coordinator).calls_limited
    flood = grpc.insecure_channel(coordinator, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        watch = flood.unary_stream(f"{COORDINATOR}WatchProgress")
        calls = [watch(b"") for _ in range(FLOOD)]  # b"": an empty WatchProgressRequest
        poll_until(lambda: sum(c.done() for c in calls) >= FLOOD - PEER_MAX_CALLS, 30)
        refused = [c for c in calls if c.done()]
        assert len(refused) == FLOOD - PEER_MAX_CALLS
        assert all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refused)
        assert node_status(coordinator).calls_limited - limited_before == len(refused)
    finally:
        flood.close()
