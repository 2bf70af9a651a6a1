"""Calls that name their caller's node id carry its proof (identity.py), and receivers check it.

Two kinds of call name a node id. Data-plane calls (boundary streams, link probes, averaging
pushes) name it in their metadata (`ravnest-node-id`, with the plan epoch and, for a boundary
stream, its generation): the proof signs the method and those values. Calls whose request
names the caller (`node_id` in the coordinator's Join, Heartbeat, Report, Suspect, Drain and
Leave, a holder's FetchBlock and FetchCheckpoint, `candidate_id` in a Vote) have the proof sign
the method, the id and the sha256 of the request's bytes, so that a proof made for one
request does not serve another. `provers` add proofs to a channel's calls, `with_proof` to a
boundary stream's; `caller` and `check_request` are the receivers' checks: a call whose proof
fails is refused UNAUTHENTICATED, logged with the address it came from, and changes nothing.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import Message

from ravnest_node.identity import PROOF_METADATA, NodeKey, ProofError, proof_in, verify
from ravnest_node.transport.errors import Refusal

__all__ = [
    "EPOCH_KEY",
    "GENERATION_KEY",
    "NODE_ID_KEY",
    "Caller",
    "ProofCheck",
    "caller",
    "check_request",
    "provers",
    "request_digest",
    "with_proof",
]

log = logging.getLogger(__name__)

# Initial metadata of a data-plane call: who is sending, under which plan epoch, which opening.
NODE_ID_KEY = "ravnest-node-id"
EPOCH_KEY = "ravnest-plan-epoch"
GENERATION_KEY = "ravnest-stream-gen"
"""Which opening of a boundary stream this is (0, then 1, 2, ... for each resume)."""
_SIGNED_KEYS = (EPOCH_KEY, GENERATION_KEY)
_NAMING_FIELDS = ("node_id", "candidate_id")
"""Request fields that name the caller."""


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _signed_values(metadata: Sequence[tuple[str, str | bytes]]) -> list[str]:
    """The metadata values a data-plane proof signs, in a fixed order ("" where absent)."""
    found = {name: _text(value) for name, value in metadata if name in _SIGNED_KEYS}
    return [found.get(name, "") for name in _SIGNED_KEYS]


def request_digest(request: Message) -> bytes:
    """What a proof signs of a request: the sha256 of its deterministic serialisation."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).digest()


def _named(request: object) -> str:
    """The caller's node id a request names ("" if it names none)."""
    if not isinstance(request, Message):
        return ""
    for name in _NAMING_FIELDS:
        if name in request.DESCRIPTOR.fields_by_name:
            return str(getattr(request, name))
    return ""


class _Proving:
    """Adds this node's proof to each call that names this node: in its metadata (data-plane
    calls), or in its request (member calls, fetches, votes)."""

    def __init__(self, key: NodeKey) -> None:
        self._key = key

    def _details(self, details: Any, request: object = None) -> Any:
        metadata = list(details.metadata or ())
        method = _text(details.method)
        named = {_text(v) for k, v in metadata if k == NODE_ID_KEY}
        if named == {self._key.node_id}:
            proof = self._key.prove(method, *_signed_values(metadata))
        elif _named(request) == self._key.node_id:
            assert isinstance(request, Message)
            proof = self._key.prove(method, request_digest(request))
        else:
            return details
        return details._replace(metadata=grpc.aio.Metadata(*metadata, (PROOF_METADATA, proof)))


class _UnaryUnary(_Proving, grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(details, request), request)


class _UnaryStream(_Proving, grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return await continuation(self._details(details, request), request)


def provers(key: NodeKey) -> list[Any]:
    """The client interceptors that add `key`'s proofs to a channel's unary-request calls, one
    for each kind (a grpc.aio channel files an interceptor under one kind only). Streamed
    requests (the boundary streams) add theirs with `with_proof`: through an interceptor, a
    call's responses become one async generator that two tasks cannot read at once, and a
    boundary stream's writer reads the status while its reader reads frames."""
    return [_UnaryUnary(key), _UnaryStream(key)]


def with_proof(
    key: NodeKey | None, method: str, metadata: Sequence[tuple[str, str]]
) -> tuple[tuple[str, str], ...]:
    """A data-plane call's `metadata` with `key`'s proof (as it is without a key)."""
    if key is None:
        return tuple(metadata)
    return (*metadata, (PROOF_METADATA, key.prove(method, *_signed_values(metadata))))


def _refuse(context: Any, node_id: str, error: ProofError) -> Refusal:
    log.warning("refused a call claiming node %s from %s: %s", node_id or "(none)",
                context.peer(), error)  # fmt: skip
    return Refusal(grpc.StatusCode.UNAUTHENTICATED, str(error))


Caller = Callable[[Any, str], tuple[str, int]]
"""`caller`'s signature: (context, method) -> (node id, epoch); raises Refusal."""


def caller(context: Any, method: str) -> tuple[str, int]:
    """(node id, plan epoch) a data-plane call's metadata claims, its proof checked: Refusal
    (UNAUTHENTICATED, logged) if the proof fails. The epoch is -1 where missing or malformed,
    so the checks that follow refuse it."""
    metadata = list(context.invocation_metadata() or ())
    values = {name: _text(value) for name, value in metadata}
    peer_id = values.get(NODE_ID_KEY, "")[:128]
    try:
        verify(proof_in(metadata), method, peer_id, *_signed_values(metadata))
    except ProofError as exc:
        raise _refuse(context, peer_id, exc) from None
    try:
        epoch = int(values.get(EPOCH_KEY, "")[:20])
    except ValueError:
        epoch = -1
    return peer_id, epoch


ProofCheck = Callable[[Any, str, Message], None]
"""check_request's signature: (context, method, request); raises Refusal."""


def check_request(context: Any, method: str, request: Message) -> None:
    """A request naming its caller (`node_id` or `candidate_id`) carries that node's proof for
    this very request: Refusal (UNAUTHENTICATED, logged) otherwise."""
    node_id = _named(request)
    try:
        verify(proof_in(context.invocation_metadata()), method, node_id, request_digest(request))
    except ProofError as exc:
        raise _refuse(context, node_id, exc) from None
