"""Fakes for driving the coordinator service without sockets: a servicer context whose abort
raises `Aborted`, a clock the test moves, and a member's measurements and joins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL
from ravnest_node.transport.proofs import EPOCH_KEY, NODE_ID_KEY


class Aborted(Exception):
    """A call the service refused: its status, reason and trailing metadata."""

    def __init__(
        self, code: grpc.StatusCode, details: str, metadata: Sequence[tuple[str, str]] = ()
    ) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.metadata = tuple(metadata)


class FakeContext:
    """The part of grpc.aio.ServicerContext the coordinator uses; `metadata`, what its call
    carries (a node's proof: tests/test_identity.py)."""

    def __init__(self, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> NoReturn:
        raise Aborted(code, details, trailing_metadata)


def unproven(context: Any, method: str, request: object) -> None:
    """A coordinator's proof check for unit tests of its rules, whose members have readable
    ids ("a", "b") that no key makes: it takes every call. The real check (proofs.py) is
    tested with real keys in tests/test_identity.py and runs in every live test."""


def claimed(context: Any, method: str) -> tuple[str, int]:
    """A boundary server's caller check for unit tests of the streams, whose stages have
    readable ids: (the node id, the epoch) the call claims, unchecked (proofs.caller checks
    the proof; tests/test_identity.py and every live test run it)."""
    metadata = dict(context.invocation_metadata() or ())
    epoch = str(metadata.get(EPOCH_KEY, "-1"))
    return str(metadata.get(NODE_ID_KEY, "")), int(epoch) if epoch.lstrip("-").isdigit() else -1


class Clock:
    """A monotonic clock the test moves by hand (`now`, seconds)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def capabilities(total_s: float = 0.08, blocks: int = 8, memory: int = 2**34) -> pb.Capabilities:
    """What a member measured: `total_s` over `blocks` blocks."""
    return pb.Capabilities(block_s=[total_s / blocks] * blocks, memory_bytes=memory, device="cpu")


async def join(
    svc: CoordinatorService,
    node: str,
    address: str = "",
    caps: pb.Capabilities | None = None,
) -> pb.JoinReply:
    """A node's two joins: to learn what to measure, then with what it measured."""
    request = pb.JoinRequest(node_id=node, address=address or f"{node}:1", protocol=PROTOCOL)
    ctx: Any = FakeContext()
    first = await svc.Join(request, ctx)
    request.capabilities.CopyFrom(caps or capabilities())
    again = await svc.Join(request, ctx)
    assert again.member_index == first.member_index and again.model == first.model
    return again
