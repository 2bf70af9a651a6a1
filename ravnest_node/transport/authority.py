"""What the holder of a protected swarm's authority does with it, beyond init-swarm's
credentials (credentials.py): issue member directories with certified node keys, and sign
revocation lists (membership.py says what they mean to the swarm). And what a node reads of
its member directory: its node key and certificate.

```
DIR/members/ID/ca.pem, member.pem, member.key   the swarm's credentials (as in DIR)
DIR/members/ID/node_key                          node ID's own key (Ed25519; 0600)
DIR/members/ID/node.cert                         the authority's certificate for that key
DIR/revoked                                      the newest revocation list `revoke` signed
```
"""

from __future__ import annotations

import base64
import binascii
import shutil
import time
from pathlib import Path

from cryptography import x509

from ravnest_node.errors import ConfigError
from ravnest_node.identity import NODE_KEY_FILE, NodeKey
from ravnest_node.state import write_atomic
from ravnest_node.transport.credentials import (
    CA_FILE,
    MAX_NEW_MEMBERS,
    MEMBER_FILE,
    MEMBER_KEY_FILE,
    MEMBERS_DIR,
    load_authority,
    load_credentials,
    swarm_of_authority,
)
from ravnest_node.transport.membership import (
    CERTIFICATE_FILE,
    MAX_CERTIFICATE_BYTES,
    REVOKED_FILE,
    MembershipError,
    RevocationList,
    authority_of,
    certify,
    check_certificate,
    sign_revocations,
)

__all__ = ["add_members", "member_identity", "renew_members", "revoke"]

DAY_S = 86_400


def add_members(out: Path, count: int, days: int, name: str | None = None) -> list[str]:
    """Write `count` member directories under `out/members`, each a node key of its own and
    the authority's certificate for it, valid `days`; their node ids. ConfigError if the
    authority (of swarm `name`, if given) or the swarm's credentials in `out` cannot be
    read."""
    if not 1 <= count <= MAX_NEW_MEMBERS:
        raise ConfigError(f"--members {count}: 1 to {MAX_NEW_MEMBERS} at a time")
    ca, ca_key = load_authority(out, name, "--members")
    creds = load_credentials(out, None)
    assert creds is not None
    if swarm_of_authority(ca) != creds.swarm:
        raise ConfigError(f"--members: the member certificate in {out} is not its authority's")
    until = int(time.time()) + days * DAY_S
    made = []
    for _ in range(count):
        key = NodeKey.generate()
        home = out / MEMBERS_DIR / key.node_id
        home.mkdir(parents=True, exist_ok=False)
        for file in (CA_FILE, MEMBER_FILE, MEMBER_KEY_FILE):
            shutil.copy2(out / file, home / file)
        key.write(home)
        certificate = certify(ca_key, creds.swarm, key.public, until)
        write_atomic(home / CERTIFICATE_FILE, base64.b64encode(certificate) + b"\n")
        made.append(key.node_id)
    return made


def renew_members(out: Path) -> int:
    """After `init-swarm --renew`: the new member certificate and key into every member
    directory under `out` (their node keys and certificates stay); how many."""
    homes = sorted(p for p in (out / MEMBERS_DIR).glob("*") if p.is_dir())
    for home in homes:
        for file in (MEMBER_FILE, MEMBER_KEY_FILE):
            shutil.copy2(out / file, home / file)
    return len(homes)


def member_identity(swarm_dir: Path | None) -> tuple[NodeKey, bytes] | None:
    """The node key and certificate of a member directory (None if `swarm_dir` is not one).
    ConfigError if it holds one without the other, or either is unreadable."""
    if swarm_dir is None:
        return None
    key_file, cert_file = swarm_dir / NODE_KEY_FILE, swarm_dir / CERTIFICATE_FILE
    if not key_file.exists() and not cert_file.exists():
        return None
    if not (key_file.exists() and cert_file.exists()):
        raise ConfigError(f"{swarm_dir}: a member directory holds both {NODE_KEY_FILE} and "
                          f"{CERTIFICATE_FILE} (init-swarm --members)")  # fmt: skip
    try:
        text = cert_file.read_bytes()[: 2 * MAX_CERTIFICATE_BYTES]
        certificate = base64.b64decode(text.strip(), validate=True)
    except (OSError, binascii.Error) as exc:
        raise ConfigError(f"{cert_file}: not a node certificate ({exc})") from None
    try:
        key = NodeKey.load_or_create(swarm_dir)
        creds = load_credentials(swarm_dir, None)
        assert creds is not None
        authority = authority_of(x509.load_pem_x509_certificate(creds.ca_pem))
        check_certificate(authority, creds.swarm, certificate, key.node_id)
    except (MembershipError, OSError, ValueError) as exc:
        raise ConfigError(
            f"{cert_file}: {exc} (a member directory of init-swarm --members holds its own "
            "key and the authority's certificate for it)"
        ) from None
    return key, certificate


def revoke(out: Path, node_ids: list[str]) -> RevocationList:
    """Sign a revocation list naming `node_ids` and every node the last one (`out/revoked`)
    named, with the next serial, and write it there. ConfigError if the authority cannot be
    read or the ids are not node ids."""
    ca, ca_key = load_authority(out, None, "revoke")
    swarm = swarm_of_authority(ca)
    before: frozenset[str] = frozenset()
    serial = 1
    path = out / REVOKED_FILE
    if path.exists():
        try:
            last = RevocationList.read(authority_of(ca), swarm, path.read_bytes())
        except (OSError, MembershipError) as exc:
            raise ConfigError(
                f"{path}: {exc} (copy the newest list back from any node's state directory, "
                "where each keeps it as `revoked`: a list of a lower serial than the swarm's "
                "is ignored)"
            ) from None
        before, serial = last.node_ids, last.serial + 1
    try:
        signed = sign_revocations(ca_key, swarm, serial, [*before, *node_ids])
    except MembershipError as exc:
        raise ConfigError(f"revoke: {exc}") from None
    write_atomic(path, signed.blob)
    return signed
