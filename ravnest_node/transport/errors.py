"""gRPC statuses and this project's errors, both ways, in one place.

**A call that failed** (`grpc.aio.AioRpcError`, the client side) is one of two faults
(errors.py):

- `PeerUnavailable`: the peer gave no answer. UNAVAILABLE (no connection, or it broke: also
  what a caller gets when the peer's server stops with the call open), DEADLINE_EXCEEDED (no
  answer in time) and CANCELLED. A call this node cancels itself never gets here (grpc.aio
  raises `asyncio.CancelledError` in the caller for it; tests/test_transport_errors.py), so a
  CANCELLED status comes from the other end or from between: the HTTP/2 stream reset with
  CANCEL (a proxy, a relay). Nobody answered, and the caller may try again (it checks whether
  its own node is stopping first).
- `PeerRefused`: every other status. The peer answered, and said no.

**A call this node refuses** (the server side): a handler raises `Refusal(code, reason)` and
the servicer answers with that status; a refused call changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from ravnest_node.errors import PeerRefused, PeerUnavailable

__all__ = ["UNANSWERED", "Refusal", "peer_error", "peer_errors", "unanswered"]

UNANSWERED = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)
"""Statuses of a call the peer did not answer."""


class Refusal(Exception):
    """A call (or a whole stream) refused: carries the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def unanswered(code: grpc.StatusCode) -> bool:
    """A call that ended with `code` got no answer from its peer."""
    return code in UNANSWERED


def peer_error(exc: grpc.aio.AioRpcError, what: str) -> PeerUnavailable | PeerRefused:
    """`exc` as the fault it is, its message `what: CODE: details`."""
    message = f"{what}: {exc.code().name}: {exc.details()}"
    return PeerUnavailable(message) if unanswered(exc.code()) else PeerRefused(message)


@contextmanager
def peer_errors(what: str) -> Iterator[None]:
    """Translate a failed call within it into PeerUnavailable / PeerRefused (`peer_error`)."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        raise peer_error(exc, what) from None
