"""Fakes for driving the coordinator service without sockets: a servicer context whose abort
raises `Aborted`, a clock the test moves, and a member's measurements and joins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import MEMBER_KEY_METADATA, PROTOCOL


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
    """The part of grpc.aio.ServicerContext the coordinator uses. Its calls carry the member
    key `key` (every member of a test has the same one unless the test says otherwise)."""

    def __init__(self, key: str = "test-member-key") -> None:
        self.key = key

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((MEMBER_KEY_METADATA, self.key),) if self.key else ()

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, str]] = (),
    ) -> NoReturn:
        raise Aborted(code, details, trailing_metadata)


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
    key: str = "test-member-key",
) -> pb.JoinReply:
    """A node's two joins: to learn what to measure, then with what it measured (its calls
    carry the member key `key`)."""
    request = pb.JoinRequest(node_id=node, address=address or f"{node}:1", protocol=PROTOCOL)
    ctx: Any = FakeContext(key)
    first = await svc.Join(request, ctx)
    request.capabilities.CopyFrom(caps or capabilities())
    again = await svc.Join(request, ctx)
    assert again.member_index == first.member_index and again.model == first.model
    return again
