"""Member keys: a member-scoped call must prove it comes from the member it names. Pure.

Each node makes a random key once and keeps it in its state directory
(`state.load_or_create_member_key`); it sends the key as call metadata
(`protocol.MEMBER_KEY_METADATA`) with every call that speaks for it: Join, Heartbeat, Report,
Suspect, Drain and Leave. The coordinator keeps the key's sha256 from the member's first Join
(the node picks its own key, so a Join whose reply was lost can be sent again as it was) and
refuses, changing nothing, a member-scoped call that names a member without its key: a stranger
who read a member's id in `status --swarm` cannot make it leave, nor report, drain or suspect
in its name. The digests outlive a coordinator restart (the store) and a failover (every plan's
stages carry their node's digest, and the member that takes over reads them from the plan it
had); a digest reveals nothing of the key.

Until every node has an identity of its own (certificates per node, the open-swarms work),
this is what a member's id is worth.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterable, Sequence

import grpc

from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import MAX_MEMBER_KEY_LEN, MEMBER_KEY_METADATA, member_key_digest
from ravnest_node.transport.errors import Refusal

__all__ = ["MemberKeys", "key_of"]

log = logging.getLogger(__name__)


def key_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The member key a call's invocation metadata carries ("" if none, or not one)."""
    for name, value in metadata or ():
        if name == MEMBER_KEY_METADATA:
            text = value.decode(errors="replace") if isinstance(value, bytes) else value
            return text if 0 < len(text) <= MAX_MEMBER_KEY_LEN else ""
    return ""


class MemberKeys:
    """The sha256 of each member's key, by node id."""

    def __init__(self) -> None:
        self.digests: dict[str, bytes] = {}

    def may_join(self, node_id: str, key: str) -> None:
        """A Join naming `node_id` with `key`, before it changes anything: a newcomer's key
        is any key, a member's must be its own. Refusal UNAUTHENTICATED without a key,
        PERMISSION_DENIED with another member's id."""
        digest = self._digest(node_id, key)
        known = self.digests.get(node_id)
        if known is not None:
            self._compare(node_id, known, digest)

    def claim(self, node_id: str, key: str) -> bool:
        """A Join naming `node_id` with `key` was answered: the member's key is `key` from
        now on (`may_join` checked it). True if the digest is new (the caller stores it)."""
        if node_id in self.digests:
            return False
        self.digests[node_id] = self._digest(node_id, key)
        return True

    def check(self, node_id: str, key: str) -> bool:
        """A member-scoped call naming `node_id` carries that member's key. A member whose
        digest this coordinator never learnt (it resumed from a store or took over a plan
        written before keys existed) gets it from this call: True then (store it). Refusal
        UNAUTHENTICATED without a key, PERMISSION_DENIED with another one."""
        digest = self._digest(node_id, key)
        known = self.digests.get(node_id)
        if known is None:
            log.warning("member %s had no key on record: taking the one its call carries",
                        node_id)  # fmt: skip
            self.digests[node_id] = digest
            return True
        self._compare(node_id, known, digest)
        return False

    def learn(self, pairs: Iterable[tuple[str, bytes]]) -> None:
        """Digests from a store or a plan taken over (32-byte ones only; others ignored)."""
        for node_id, digest in pairs:
            if len(digest) == 32:
                self.digests.setdefault(node_id, bytes(digest))

    def stamp(self, plan: pb.Plan) -> None:
        """Write each stage's node's digest into `plan` (StageAssignment.member_key_sha256)."""
        for stage in plan.stages:
            stage.member_key_sha256 = self.digests.get(stage.node_id, b"")

    def forget(self, node_ids: Iterable[str]) -> None:
        """Members that lost their place (before the plan): a node with that id starts anew."""
        for node_id in node_ids:
            self.digests.pop(node_id, None)

    @staticmethod
    def _digest(node_id: str, key: str) -> bytes:
        if not key:
            raise Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"a call for member {node_id} must carry its member key ({MEMBER_KEY_METADATA} "
                "metadata; nodes before member keys do not send it: upgrade the node)",
            )
        return member_key_digest(key)

    @staticmethod
    def _compare(node_id: str, known: bytes, digest: bytes) -> None:
        if not hmac.compare_digest(known, digest):
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this call names member {node_id} but does not carry its member key",
            )
