"""What a protected swarm's authority says of its members: node certificates and revocation.

In a protected swarm every node presents the same member certificate for TLS
(credentials.py), and a node's id is made from a key of its own (identity.py). Alone, that lets
anyone who once had the swarm's credentials make a new key, so a new id, whenever shut out. So
the authority can also vouch for node keys one by one:

- **Node certificates.** `ravnest-node init-swarm NAME --out DIR --members N` writes, beside the
  swarm's credentials, one directory per member (`DIR/members/ID`): the credentials, the
  member's own node key (`node_key`) and the authority's signature over that key
  (`node.cert`). A node started with `--swarm-dir DIR/members/ID` takes that key as its
  identity (its node id is ID), and requires a certificate of the same authority of every node
  that joins or stands for election: a coordinator refuses a Join, and every node a Vote, whose
  node id no certificate vouches for (PERMISSION_DENIED). Every other call between nodes comes
  only from members of the plan (the stage's neighbours, its replicas, holders named in the
  plan), whom a coordinator admitted that way.
- **Revocation.** `ravnest-node revoke --swarm-dir DIR ID...` (DIR holding the authority's key)
  signs a list of revoked node ids with a serial number one above the last, writes it to
  `DIR/revoked` and, with `--coordinator HOST:PORT`, hands it to the coordinator. A coordinator
  checks the authority's signature (nobody else can make a list), bans the listed members
  (counted lost and re-planned without, as a member who failed audits: coordinator/bans.py)
  and puts the list in every plan it announces; the current one is announced again at once
  with it. Every node that sees it in a plan checks the signature against its own authority,
  keeps it in its state directory (a restarted node still refuses) and from then on refuses
  every call a listed node makes (PERMISSION_DENIED, "banned from this swarm: node ID is
  revoked by the swarm's authority": the revoked daemon, refused so, stops with exit status 3),
  before any handler runs: a server interceptor that reads whose key made the call's proof.

Certificates and lists are msgpack maps of plain values (bytes, ints, strings), read with size
limits and never evaluated; their signatures are ECDSA P-256 with SHA-256 by the authority's
key (`cryptography`, OpenSSL), over length-prefixed fields so that no two messages sign alike.
Written here because X.509 certificates and CRLs would bind the TLS key, not the node key a call
is proven with, and no maintained library binds the two.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from ravnest_node.errors import ConfigError
from ravnest_node.identity import node_id_of, proof_in, proof_key
from ravnest_node.protocol import BANNED
from ravnest_node.state import write_atomic
from ravnest_node.transport.credentials import MEMBERS_DIR
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.limits import handler_like

__all__ = [
    "CERTIFICATE_FILE",
    "MAX_CERTIFICATE_BYTES",
    "MAX_REVOKED",
    "REVOKED",
    "REVOKED_FILE",
    "Membership",
    "MembershipError",
    "RevocationList",
    "authority_of",
    "certify",
    "check_certificate",
    "sign_revocations",
]

log = logging.getLogger(__name__)

CERTIFICATE_FILE = "node.cert"
"""A member directory's node certificate (one line of base64)."""
REVOKED_FILE = "revoked"
"""The newest revocation list: in the authority's directory (`revoke` writes it) and in every
node's state directory (each keeps the newest it has seen)."""
REVOKED = "revoked by the swarm's authority"
"""How a refusal of a revoked member begins."""
MAX_REVOKED = 10_000
"""Node ids one list may name."""
MAX_CERTIFICATE_BYTES = 1024
MAX_LIST_BYTES = 64 + MAX_REVOKED * 20 + 1024
_CERT_DOMAIN = b"ravnest-node-certificate/1"
_LIST_DOMAIN = b"ravnest-revocations/1"
_LOG_EVERY_S = 60.0
"""A revoked member's refused calls are logged at most once a minute each."""


class MembershipError(Exception):
    """A node certificate or revocation list that is malformed, not the swarm's authority's,
    of another swarm, or expired."""


def _signed(domain: bytes, *parts: str | bytes | int) -> bytes:
    """What a signature covers: every part length-prefixed."""
    encoded = [domain] + [
        p.encode() if isinstance(p, str) else (str(p).encode() if isinstance(p, int) else p)
        for p in parts
    ]
    return b"".join(len(p).to_bytes(4, "big") + p for p in encoded)


def _key_made(node_id: object) -> bool:
    """`node_id` is what a node key makes (identity.node_id_of): 16 lowercase hex digits."""
    return (
        isinstance(node_id, str) and len(node_id) == 16 and all(c in _HEX for c in node_id)
    )


_HEX = frozenset("0123456789abcdef")


def _unpack(blob: bytes, limit: int, what: str) -> dict[str, Any]:
    if not blob or len(blob) > limit:
        raise MembershipError(f"{what}: {len(blob)} bytes (1 to {limit})")
    try:
        fields = msgpack.unpackb(
            blob, raw=False, strict_map_key=True, max_bin_len=limit, max_str_len=limit,
            max_array_len=MAX_REVOKED, max_map_len=16,
        )  # fmt: skip
    except (ValueError, msgpack.UnpackException) as exc:
        raise MembershipError(f"{what}: not readable ({exc})") from None
    if not isinstance(fields, dict) or fields.get("v") != 1:
        raise MembershipError(f"{what}: not one this version reads")
    return fields


def _verify(authority: ec.EllipticCurvePublicKey, signature: object, message: bytes,
            what: str) -> None:  # fmt: skip
    if not isinstance(signature, bytes):
        raise MembershipError(f"{what}: no signature")
    try:
        authority.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise MembershipError(f"{what}: not signed by this swarm's authority") from None


def authority_of(ca: x509.Certificate) -> ec.EllipticCurvePublicKey:
    """The public key of a swarm's authority certificate; ValueError if it is not ECDSA."""
    public = ca.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise ValueError("the swarm's authority is not an ECDSA key (made by init-swarm)")
    return public


# ----- node certificates ----------------------------------------------------------------------
def certify(
    authority_key: ec.EllipticCurvePrivateKey, swarm: str, node_public: bytes, until: int
) -> bytes:
    """The authority's certificate that the node key `node_public` (raw Ed25519) is a member of
    `swarm` until `until` (Unix seconds)."""
    signature = authority_key.sign(
        _signed(_CERT_DOMAIN, swarm, node_public, until), ec.ECDSA(hashes.SHA256())
    )
    packed: bytes = msgpack.packb(
        {"v": 1, "swarm": swarm, "key": node_public, "until": until, "sig": signature}
    )
    return packed


def check_certificate(
    authority: ec.EllipticCurvePublicKey, swarm: str, blob: bytes, node_id: str,
    now: float | None = None,
) -> None:  # fmt: skip
    """MembershipError unless `blob` is the authority's certificate for node `node_id` in
    `swarm`, valid now."""
    what = f"node {node_id}'s certificate"
    fields = _unpack(blob, MAX_CERTIFICATE_BYTES, what)
    key, until, named = fields.get("key"), fields.get("until"), fields.get("swarm")
    if not isinstance(key, bytes) or not isinstance(until, int) or not isinstance(named, str):
        raise MembershipError(f"{what}: malformed")
    if named != swarm:
        raise MembershipError(f"{what}: of swarm {named[:64]!r}, not {swarm!r}")
    if node_id_of(key) != node_id:
        raise MembershipError(f"{what}: vouches for node {node_id_of(key)}, not {node_id}")
    _verify(authority, fields.get("sig"), _signed(_CERT_DOMAIN, named, key, until), what)
    if (time.time() if now is None else now) > until:
        raise MembershipError(f"{what}: expired (ask the swarm's authority for a new member "
                              "directory: init-swarm --members)")  # fmt: skip


# ----- revocation lists -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RevocationList:
    """The authority's list of revoked node ids; a higher serial replaces a lower."""

    serial: int
    node_ids: frozenset[str]
    issued: int
    """When the authority signed it (Unix seconds)."""
    blob: bytes
    """As signed: what plans carry and files hold."""

    @classmethod
    def read(cls, authority: ec.EllipticCurvePublicKey, swarm: str, blob: bytes) -> RevocationList:
        """The list `blob` holds, its signature checked; MembershipError otherwise."""
        what = "revocation list"
        fields = _unpack(blob, MAX_LIST_BYTES, what)
        serial, issued, ids = fields.get("serial"), fields.get("issued"), fields.get("ids")
        named = fields.get("swarm")
        if (
            not isinstance(serial, int) or serial < 1 or not isinstance(issued, int)
            or not isinstance(named, str) or not isinstance(ids, list)
            or not all(_key_made(i) for i in ids)
        ):  # fmt: skip
            raise MembershipError(f"{what}: malformed")
        if named != swarm:
            raise MembershipError(f"{what}: of swarm {named[:64]!r}, not {swarm!r}")
        _verify(authority, fields.get("sig"), _signed(_LIST_DOMAIN, named, serial, issued, *ids),
                what)  # fmt: skip
        return cls(serial=serial, node_ids=frozenset(ids), issued=issued, blob=blob)


def sign_revocations(
    authority_key: ec.EllipticCurvePrivateKey, swarm: str, serial: int, node_ids: Iterable[str]
) -> RevocationList:
    """A revocation list of `node_ids`, signed by the authority."""
    ids = sorted(set(node_ids))
    if len(ids) > MAX_REVOKED:
        raise MembershipError(f"at most {MAX_REVOKED} revoked node ids in one list")
    bad = [i for i in ids if not _key_made(i)]
    if bad:
        raise MembershipError(f"not node ids: {', '.join(bad[:5])}")
    issued = int(time.time())
    signature = authority_key.sign(
        _signed(_LIST_DOMAIN, swarm, serial, issued, *ids), ec.ECDSA(hashes.SHA256())
    )
    blob = msgpack.packb({"v": 1, "swarm": swarm, "serial": serial, "issued": issued,
                          "ids": ids, "sig": signature})  # fmt: skip
    return RevocationList(serial=serial, node_ids=frozenset(ids), issued=issued, blob=blob)


def _proof_node(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The node id whose key made a call's proof, read as `identity.verify` reads it (the
    first proof entry, `proof_key`); "" if it carries none that parses."""
    public = proof_key(proof_in(list(metadata or ())))
    return node_id_of(public) if public is not None else ""


# ----- what one node knows ---------------------------------------------------------------------
class Membership:
    """What this node holds of its swarm's authority: whether members need node certificates,
    and the newest revocation list it has seen (kept in its state directory)."""

    def __init__(
        self,
        authority: ec.EllipticCurvePublicKey | None = None,
        swarm: str = "",
        *,
        certified: bool = False,
        state_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.authority = authority
        """The swarm's authority (None in an open swarm: nothing is certified or revoked)."""
        self.swarm = swarm
        self._certified = certified
        self.current: RevocationList | None = None
        self._state_dir = state_dir
        self._clock = clock
        self._logged: dict[str, float] = {}
        self.refused = 0
        """Calls refused from revoked members."""

    @classmethod
    def of(
        cls, ca_pem: bytes | None, swarm: str, *, state_dir: Path | None,
        swarm_dir: Path | None = None, member: bool = False,
    ) -> Membership:  # fmt: skip
        """A node's view: the authority of its credentials (None: open swarm); members need
        certificates if this node is one (`member`: started from a member directory) or its
        `swarm_dir` is the authority's that issued them (it holds MEMBERS_DIR); and the newest
        valid list among the swarm dir's and its state directory's."""
        authority = None
        if ca_pem is not None:
            try:
                authority = authority_of(x509.load_pem_x509_certificate(ca_pem))
            except ValueError as exc:
                raise ConfigError(f"the swarm's authority is unreadable: {exc}") from None
        certified = member or (swarm_dir is not None and (swarm_dir / MEMBERS_DIR).is_dir())
        membership = cls(authority, swarm, certified=certified, state_dir=state_dir)
        places = [d / REVOKED_FILE for d in (swarm_dir, state_dir) if d is not None]
        for path in places:
            try:
                if path.is_file():
                    membership.adopt(path.read_bytes()[: MAX_LIST_BYTES + 1])
            except (MembershipError, OSError) as exc:
                log.warning("ignoring %s: %s", path, exc)
        return membership

    @property
    def certified(self) -> bool:
        """Members need node certificates: this node was started from a member directory or
        from the authority's directory that issued them, or it holds a revocation list (a
        swarm that revokes members must certify them, or a revoked one comes back under a
        new key)."""
        return self.authority is not None and (self._certified or self.current is not None)

    @property
    def revoked(self) -> frozenset[str]:
        return self.current.node_ids if self.current else frozenset()

    def adopt(self, blob: bytes) -> bool:
        """Take the list `blob` if it is the authority's and newer than the one held (kept in
        the state directory); whether it was. MembershipError if it is not the authority's
        (or this swarm has none)."""
        if not blob or (self.current is not None and blob == self.current.blob):
            return False  # (every plan carries the list: it is checked once)
        if self.authority is None:
            raise MembershipError("an open swarm has no authority to revoke members")
        read = RevocationList.read(self.authority, self.swarm, blob)
        if self.current is not None and read.serial <= self.current.serial:
            return False
        self.current = read
        if self._state_dir is not None:
            try:
                write_atomic(self._state_dir / REVOKED_FILE, read.blob)
            except OSError as exc:  # held in memory all the same
                log.warning("cannot keep the revocation list in %s: %s", self._state_dir, exc)
        named = ", ".join(sorted(read.node_ids)[:8])
        log.warning("revocation list %d of the swarm's authority: %d node(s) revoked (%s)",
                    read.serial, len(read.node_ids), named)  # fmt: skip
        return True

    def check_member(self, node_id: str, certificate: bytes) -> None:
        """Refusal PERMISSION_DENIED if `node_id` is revoked, or, where members need node
        certificates, `certificate` is not the authority's for it."""
        if node_id in self.revoked:
            why = f"{BANNED}: node {node_id} is {REVOKED}"
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, why)
        if not self.certified:
            return
        assert self.authority is not None
        if not certificate:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                          f"node {node_id} has no node certificate: this swarm's members are "
                          "certified by its authority (a member directory of init-swarm "
                          "--members, given as --swarm-dir)")  # fmt: skip
        try:
            check_certificate(self.authority, self.swarm, certificate, node_id)
        except MembershipError as exc:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None

    def refusal(self, metadata: Iterable[tuple[str, str | bytes]] | None, method: str) -> str:
        """Why a call to `method` with this `metadata` is refused ("" if it is not): its proof
        is a revoked member's. Logged at most once a minute per member."""
        revoked = self.revoked
        if not revoked:
            return ""
        node_id = _proof_node(metadata)
        if node_id not in revoked:
            return ""
        self.refused += 1
        now = self._clock()
        if now - self._logged.get(node_id, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._logged[node_id] = now
            log.warning("refused a call from revoked node %s (%s)", node_id, method)
        serial = self.current.serial if self.current else 0
        return f"{BANNED}: node {node_id} is {REVOKED} (list {serial})"

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        """The server interceptor that refuses revoked members' calls before any handler."""
        return _RevokedCalls(self)


class _RevokedCalls(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # untyped in grpc
    def __init__(self, membership: Membership) -> None:
        self._membership = membership

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        reason = self._membership.refusal(details.invocation_metadata, details.method)
        return _refusing(handler, reason) if reason else handler


def _refusing(handler: Any, reason: str) -> Any:
    """A handler of `handler`'s kind that refuses the call PERMISSION_DENIED with `reason`."""

    async def refuse(_request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

    async def refuse_stream(_request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        yield  # (an async generator, as a streaming handler is)

    return handler_like(handler, refuse_stream if handler.response_streaming else refuse)
