"""A live node refuses bad frames with a gRPC status that says why, and nothing changes."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import grpc
import msgpack
import pytest
import torch

from ravnest_node.compression import get_codec
from ravnest_node.identity import PROOF_METADATA, NodeKey
from ravnest_node.transport import boundary, proofs
from ravnest_node.transport.frames import MAGIC, FrameKind, encode_frame

from .conftest import Procs, node_status, progress_events

MB = 4  # tiny with batch 16 in 4 microbatches
HIDDEN = (MB, 32, 64)
KEYS: dict[str, NodeKey] = {}
"""The keys of the nodes the tests speak as, by node id."""


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A 2-node tiny swarm that has finished a short run: (coordinator, stage-1 node) addresses."""
    tmp = tmp_path_factory.mktemp("swarm")
    procs = Procs()
    try:
        _, ready = procs.start_node(tmp / "n0", "--swarm-size", "2", "--model", "tiny",
                                    "--steps", "3")  # fmt: skip
        _, worker = procs.start_node(tmp / "n1", "--join", ready["address"])
        assert [e for e in progress_events(ready["address"]) if e.done]
        for node in ("n0", "n1"):  # the tests speak as these nodes: they hold their keys
            key = NodeKey.load_or_create(tmp / node)
            KEYS[key.node_id] = key
        yield ready["address"], worker["address"]
    finally:
        procs.cleanup()


def _send(address: str, message: bytes, node_id: str, epoch: int = 1) -> grpc.RpcError:
    """Open a boundary stream as node `node_id` (with its proof, if its key is in KEYS), send
    one message; return the error status it ends with."""
    metadata = [(proofs.NODE_ID_KEY, node_id), (proofs.EPOCH_KEY, str(epoch))]
    if node_id in KEYS:
        metadata.append((PROOF_METADATA, KEYS[node_id].prove(boundary.PATH, str(epoch), "")))
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(boundary.PATH)(iter([message]), metadata=metadata,
                                                    timeout=30)  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        return info.value


def _frame(shape: tuple[int, ...], seq: int = 12) -> bytes:
    return encode_frame(
        FrameKind.FORWARD, seq, seq // 4,
        [("hidden", torch.zeros(shape), get_codec("none")),
         ("targets", torch.zeros(MB, 32, dtype=torch.uint8), get_codec("none"))],
    )  # fmt: skip


def _header_frame(header: dict[str, object], payload: bytes) -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return MAGIC + struct.pack("<I", len(packed)) + packed + payload


UNKNOWN_DTYPE = _header_frame(
    {"kind": 1, "seq": 12, "version": 3, "tensors": [
        {"name": "hidden", "shape": list(HIDDEN), "dtype": "float128", "codec": "none",
         "nbytes": 16}]},
    b"\0" * 16,
)  # fmt: skip
CLAIMED_100_GB = _header_frame(
    {"kind": 1, "seq": 12, "version": 3, "tensors": [
        {"name": "hidden", "shape": [25600, 1024, 1024], "dtype": "float32", "codec": "none",
         "nbytes": 100 * 2**30}]},
    b"\0" * 16,
)  # fmt: skip
OVERSIZED_HEADER = _header_frame(
    {"kind": 1, "seq": 12, "version": 3, "tensors": [], "pad": "x" * 10_000}, b""
)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (_frame((MB, 32, 63)), "shape [4, 32, 63] does not match the plan's [4, 32, 64]"),
        (UNKNOWN_DTYPE, "unknown dtype 'float128'"),
        (OVERSIZED_HEADER, "exceeds the limit of 4096"),
        (CLAIMED_100_GB, "larger than the message"),
        (b"\x80\x04pickle", "bad magic"),
        (_frame(HIDDEN, seq=12), "past the plan's last microbatch"),
    ],
    ids=[
        "wrong-shape",
        "unknown-dtype",
        "oversized-header",
        "claimed-100-gb",
        "not-a-frame",
        "past-the-run",
    ],
)
def test_bad_frame_is_refused_and_changes_nothing(
    swarm: tuple[str, str], message: bytes, reason: str
) -> None:
    _, node = swarm
    before = node_status(node)
    assert before.stage == 1 and before.run_done and before.version == 3
    error = _send(node, message, before.upstream_node_id)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in (error.details() or "")
    after = node_status(node)
    assert after.frames_refused == before.frames_refused + 1
    assert (after.version, after.params_sha256, after.frames_accepted) == (
        before.version, before.params_sha256, before.frames_accepted
    )  # fmt: skip
    assert after.microbatches_in_flight == before.microbatches_in_flight == 0


def test_unknown_peer_and_stale_epoch_are_refused(swarm: tuple[str, str]) -> None:
    _, node = swarm
    before = node_status(node)
    intruder = NodeKey.generate()  # a node with a key of its own, not this stage's upstream
    KEYS[intruder.node_id] = intruder
    error = _send(node, _frame(HIDDEN), intruder.node_id)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"unknown peer '{intruder.node_id}'" in (error.details() or "")
    # Claiming the upstream's id without its key: refused before anything else.
    with grpc.insecure_channel(node) as channel:
        call = channel.stream_stream(boundary.PATH)(iter([_frame(HIDDEN)]), timeout=30, metadata=(
            (proofs.NODE_ID_KEY, before.upstream_node_id), (proofs.EPOCH_KEY, "1"),
            (PROOF_METADATA, intruder.prove(boundary.PATH, "1", "")),
        ))  # fmt: skip
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    error = _send(node, _frame(HIDDEN), before.upstream_node_id, epoch=0)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    # An epoch far past any plan: refused at once, not held while the node waits for it.
    error = _send(node, _frame(HIDDEN), before.upstream_node_id, epoch=10**9)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "far past this node's newest" in (error.details() or "")
    after = node_status(node)
    assert (after.version, after.params_sha256) == (before.version, before.params_sha256)


def test_oversized_message_is_refused_by_the_transport(swarm: tuple[str, str]) -> None:
    _, node = swarm
    before = node_status(node)
    error = _send(node, b"\0" * (64 * 2**20 + 1), before.upstream_node_id)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert node_status(node).params_sha256 == before.params_sha256
