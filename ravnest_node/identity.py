"""A node's identity: an Ed25519 key pair of its own, its node id derived from the public key,
and the proofs its calls carry.

A node makes its key pair at first start and keeps the private key in its state directory
(`node_key`, readable by its user only). Its node id is `node_id_of(public key)`: 16 hex
characters of a sha256 of the key, so an id cannot be claimed without the key it is made from.
Every call that names the caller's node id (the coordinator's member calls, boundary streams,
link probes, averaging pushes) carries a proof in the call metadata `ravnest-node-proof`:
the public key, the time, and a signature over what the call is (its method, the node id, the
fields that say which stream or request it is, the time). A receiver checks that the key makes
the id the call claims, that the signature holds, and that the time is within `PROOF_WINDOW_S`
of its own clock; nothing else is needed (no list of keys to keep, no first-come claims): the
ids certify themselves.

What a proof does not stop: someone on the path between two nodes of an open swarm (no TLS)
sees the proof and the call, and can replay or alter them within the window; a protected
swarm's mutual TLS keeps such a party off the path (docs/security.md).

Written here because no maintained library does self-certifying node ids over gRPC metadata;
the signatures are `cryptography`'s Ed25519 (OpenSSL).
"""

from __future__ import annotations

import base64
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ravnest_node.errors import ConfigError
from ravnest_node.state import write_atomic

__all__ = [
    "NODE_KEY_FILE",
    "PROOF_METADATA",
    "PROOF_WINDOW_S",
    "NodeKey",
    "ProofError",
    "node_id_of",
    "proof_in",
    "proof_key",
    "verify",
]

NODE_KEY_FILE = "node_key"
PROOF_METADATA = "ravnest-node-proof"
PROOF_WINDOW_S = 600.0
"""How far a proof's time may be from the receiver's clock, either way: machines whose clocks
differ by more are refused, with the difference in the message."""
_DOMAIN = b"ravnest-node-proof/1"
_ID_DOMAIN = b"ravnest-node-id/1"
MAX_PROOF_LEN = 200
"""Characters of a proof a receiver reads (a real one is about 150)."""


class ProofError(Exception):
    """A call's proof is missing, malformed, too old or too new, made by a key that is not the
    claimed node's, or its signature does not hold."""


def node_id_of(public_key: bytes) -> str:
    """The node id a raw 32-byte Ed25519 public key makes."""
    return hashlib.sha256(_ID_DOMAIN + public_key).hexdigest()[:16]


def _message(at: int, purpose: str, node_id: str, fields: Sequence[str | bytes]) -> bytes:
    """What a proof signs: unambiguous (every part length-prefixed)."""
    parts = [_DOMAIN, str(at).encode(), purpose.encode(), node_id.encode()]
    parts += [f.encode() if isinstance(f, str) else bytes(f) for f in fields]
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """Strict base64url: any character outside its alphabet is a ValueError (binascii.Error),
    never skipped, so every reader of a proof sees the same bytes."""
    return base64.b64decode(text + "=" * (-len(text) % 4), altchars=b"-_", validate=True)


def proof_key(proof: str) -> bytes | None:
    """The raw public key a proof names (None if it has none of 32 bytes): what a receiver
    that refuses revoked keys reads (transport/membership.py), parsed exactly as `verify`
    does."""
    parts = proof.split(".")
    if len(proof) > MAX_PROOF_LEN or len(parts) != 3:
        return None
    try:
        public = _unb64(parts[0])
    except ValueError:
        return None
    return public if len(public) == 32 else None


@dataclass(frozen=True, slots=True)
class NodeKey:
    """This node's key pair."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, state_dir: Path | None) -> NodeKey:
        """The key kept in `state_dir` (made there on first start, readable by this user
        only); without a state directory, a new key each start, so a new node id. A key file
        that does not parse is a ConfigError, not replaced: the node's id is at stake."""
        if state_dir is None:
            return cls.generate()
        path = state_dir / NODE_KEY_FILE
        if path.exists():
            try:
                loaded = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except ValueError as exc:
                raise ConfigError(f"{path} is not a node key ({exc}): move it away to make a "
                                  "new one (and a new node id)") from None  # fmt: skip
            if not isinstance(loaded, Ed25519PrivateKey):
                raise ConfigError(f"{path} is not an Ed25519 key: move it away to make a new one")
            return cls(loaded)
        key = cls.generate()
        key.write(state_dir)
        return key

    def write(self, directory: Path) -> None:
        """Keep this key in `directory` (NODE_KEY_FILE, readable by this user only)."""
        pem = self.private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        write_atomic(directory / NODE_KEY_FILE, pem, mode=0o600)

    @property
    def public(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def node_id(self) -> str:
        return node_id_of(self.public)

    def prove(self, purpose: str, *fields: str | bytes, now: float | None = None) -> str:
        """A proof that this node makes the call `purpose` (a method's name) with `fields`:
        the metadata value of PROOF_METADATA."""
        at = int(time.time() if now is None else now)
        signature = self.private.sign(_message(at, purpose, self.node_id, fields))
        return f"{_b64(self.public)}.{at}.{_b64(signature)}"


def proof_in(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The proof a call's invocation metadata carries ("" if none)."""
    for name, value in metadata or ():
        if name == PROOF_METADATA:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return text[: MAX_PROOF_LEN + 1]
    return ""


def verify(
    proof: str, purpose: str, node_id: str, *fields: str | bytes, now: float | None = None
) -> None:
    """Check that `proof` shows the call `purpose` with `fields` comes from node `node_id`.
    ProofError saying what is wrong otherwise."""
    if not proof:
        raise ProofError(
            f"a call naming node {node_id} must carry its proof ({PROOF_METADATA} metadata; "
            "nodes before node keys do not send it: upgrade the node)"
        )
    parts = proof.split(".")
    if len(proof) > MAX_PROOF_LEN or len(parts) != 3 or not parts[1].isdigit():
        raise ProofError("malformed node proof")
    try:
        public, signature = _unb64(parts[0]), _unb64(parts[2])
    except ValueError:
        raise ProofError("malformed node proof") from None
    if len(public) != 32 or len(signature) != 64:
        raise ProofError("malformed node proof")
    if node_id_of(public) != node_id:
        raise ProofError(f"the call names node {node_id} but is signed by the key of node "
                         f"{node_id_of(public)}")  # fmt: skip
    at = int(parts[1])
    skew = (time.time() if now is None else now) - at
    if abs(skew) > PROOF_WINDOW_S:
        raise ProofError(
            f"node {node_id}'s proof is dated {skew:+.0f} s from this node's clock (at most "
            f"{PROOF_WINDOW_S:.0f} s either way: set both clocks right)"
        )
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(
            signature, _message(at, purpose, node_id, fields)
        )
    except InvalidSignature:
        raise ProofError(f"node {node_id}'s proof does not hold for this call") from None
