"""A protected swarm's credentials: its certificate authority and the member certificate that
every node presents, for mutual TLS between all peers.

`ravnest-node init-swarm NAME --out DIR` makes them (`create_swarm`):

```
DIR/ca.pem        the swarm's certificate authority (public: every node needs it)
DIR/ca.key        its private key (keep it off the nodes: only `init-swarm --renew` uses it)
DIR/member.pem    the member certificate, signed by the authority, and
DIR/member.key    its private key: what every node of the swarm presents
DIR/token         the same three (authority, member certificate, member key) as one line
```

`init-swarm ... --members N` also writes one directory per member, `DIR/members/ID`: the files a
node needs (ca.pem, member.pem, member.key), the member's own node key and the authority's
certificate for it (membership.py): a node started with `--swarm-dir DIR/members/ID` is node
ID, and its swarm can shut it out alone (`ravnest-node revoke`). Given for an existing DIR,
`--members N` adds N more under the same authority.

A node is given either the directory (`--swarm-dir DIR`, which needs ca.pem, member.pem and
member.key) or the token alone (`--token`, or RAVNEST_TRANSPORT_TOKEN to keep it out of `ps`).
Every member certificate names the swarm (its common name is `member of NAME`) and carries one
DNS name, TLS_NAME, which every channel expects of its server (gRPC's target name override): an
address in a swarm may be an IP, a relay's port or a name, and the authority, not the name, is
what proves a peer is a member.

Keys are ECDSA P-256; the authority is valid for CA_DAYS, a member certificate for the days
given to init-swarm (MEMBER_DAYS by default). `init-swarm --renew` issues a new member
certificate and token under the same authority; old ones stay valid until they expire. To shut
someone out at once, make a new authority (a new directory) and give it to the others.

Nothing here is received from the network: certificates of peers are checked by TLS itself.
"""

from __future__ import annotations

import base64
import datetime
import functools
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ravnest_node.errors import ConfigError
from ravnest_node.state import valid_swarm_name, write_atomic

TLS_NAME = "swarm.ravnest"
"""The DNS name in every member certificate, and the name every channel checks its server for."""
CA_DAYS = 3650
MEMBER_DAYS = 365
TOKEN_PREFIX = "rvn1."
MAX_TOKEN_LEN = 8192
MEMBERS_DIR = "members"
MAX_NEW_MEMBERS = 1000
CA_FILE, CA_KEY_FILE, MEMBER_FILE, MEMBER_KEY_FILE, TOKEN_FILE = (
    "ca.pem",
    "ca.key",
    "member.pem",
    "member.key",
    "token",
)
MEMBER_PREFIX = "member of "
AUTHORITY_PREFIX = "ravnest swarm "


@dataclass(frozen=True, slots=True)
class SwarmCredentials:
    """What a node of a protected swarm proves itself with, and checks its peers against."""

    swarm: str
    """The swarm's name, from the member certificate."""
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    expires: datetime.datetime
    """When the member certificate expires (UTC)."""

    def server_context(self) -> ssl.SSLContext:
        """TLS for a node's server: its member certificate, and a valid one demanded of every
        client (HTTP/2 negotiated, as gRPC needs)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(context, self.cert_pem, self.key_pem)
        context.load_verify_locations(cadata=self.ca_pem.decode())
        context.verify_mode = ssl.CERT_REQUIRED
        context.set_alpn_protocols(["h2"])
        return context

    def client_context(self) -> ssl.SSLContext:
        """TLS for a connection to a member (a relay's): its certificate demanded, this one's
        member certificate presented."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # checks the name and the chain
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_verify_locations(cadata=self.ca_pem.decode())
        _load_chain(context, self.cert_pem, self.key_pem)
        return context

    def token(self) -> str:
        """The authority, the member certificate and its key as one line."""
        packed = msgpack.packb(
            {"ca": _der(self.ca_pem), "cert": _der(self.cert_pem), "key": _key_der(self.key_pem)}
        )
        return TOKEN_PREFIX + base64.urlsafe_b64encode(packed).decode().rstrip("=")


def _load_chain(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    """ssl loads a certificate and key only from files: a private temporary directory."""
    shm = Path("/dev/shm")  # memory, where there is one: a key never reaches a disk
    where = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="ravnest-tls-", dir=where) as tmp:
        cert, key = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert.write_bytes(cert_pem)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem)
        context.load_cert_chain(cert, key)


def _der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


def _key_der(pem: bytes) -> bytes:
    key = serialization.load_pem_private_key(pem, password=None)
    return key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Certificate | None,
    issuer_key: ec.EllipticCurvePrivateKey,
    days: int,
) -> x509.Certificate:
    """A certificate for `key`: the authority's own (issuer None) or a member's."""
    now = _now()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name if issuer is None else issuer.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little apart
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if issuer is not None:  # strict verifiers (Python 3.13's default) want both identifiers
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), False
        )
    if issuer is None:
        builder = builder.add_extension(
            x509.BasicConstraints(ca=True, path_length=0), critical=True
        ).add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
    else:
        builder = (
            builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), True)
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                False,
            )
        )
    return builder.sign(issuer_key, hashes.SHA256())


def create_swarm(
    name: str, out: Path, *, days: int = MEMBER_DAYS, renew: bool = False
) -> SwarmCredentials:
    """Write a new authority and member credentials for swarm `name` to `out` (which must not
    hold an authority yet); with `renew`, a new member certificate and token under the
    authority already there. ConfigError if that cannot be done."""
    if not 1 <= days <= CA_DAYS:
        raise ConfigError(f"days={days}: must be 1 to {CA_DAYS}")
    ca_file, ca_key_file = out / CA_FILE, out / CA_KEY_FILE
    if renew:
        ca, ca_key = load_authority(out, name, "--renew")
    else:
        if ca_file.exists() or ca_key_file.exists():
            raise ConfigError(
                f"{out} already holds a swarm authority: use --renew for new member "
                "credentials under it, or another directory for a new swarm"
            )
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _issue(AUTHORITY_PREFIX + name, ca_key, None, ca_key, CA_DAYS)
    member_key = ec.generate_private_key(ec.SECP256R1())
    member = _issue(MEMBER_PREFIX + name, member_key, ca, ca_key, days)
    out.mkdir(parents=True, exist_ok=True)
    if not renew:
        write_atomic(ca_key_file, _pem_key(ca_key), mode=0o600)
        write_atomic(ca_file, _pem(ca))
    write_atomic(out / MEMBER_KEY_FILE, _pem_key(member_key), mode=0o600)
    write_atomic(out / MEMBER_FILE, _pem(member))
    creds = _checked(_pem(ca), _pem(member), _pem_key(member_key), str(out))
    write_atomic(out / TOKEN_FILE, (creds.token() + "\n").encode(), mode=0o600)
    return creds


def load_authority(
    out: Path, name: str | None, why: str
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The authority of the swarm directory `out` and its private key (of swarm `name`, if
    given); ConfigError, beginning with `why`, if they cannot be read."""
    try:
        ca = x509.load_pem_x509_certificate((out / CA_FILE).read_bytes())
        ca_key = serialization.load_pem_private_key((out / CA_KEY_FILE).read_bytes(), None)
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{why}: cannot read the authority in {out}: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ConfigError(f"{why}: {out / CA_KEY_FILE} is not this project's kind of key")
    if name is not None and _common_name(ca) != AUTHORITY_PREFIX + name:
        raise ConfigError(f"{why}: the authority in {out} is not swarm {name!r}'s")
    return ca, ca_key


@functools.lru_cache(maxsize=8)
def load_credentials(swarm_dir: Path | None, token: str | None) -> SwarmCredentials | None:
    """The credentials of `swarm_dir` or `token` (None if neither is given). ConfigError, saying
    what is wrong, for missing, malformed, mismatched or expired ones."""
    if swarm_dir is not None and token is not None:
        raise ConfigError("give --swarm-dir or --token, not both")
    if swarm_dir is not None:
        try:
            ca, cert, key = (
                (swarm_dir / f).read_bytes() for f in (CA_FILE, MEMBER_FILE, MEMBER_KEY_FILE)
            )
        except OSError as exc:
            raise ConfigError(
                f"swarm_dir={str(swarm_dir)!r}: {exc.strerror or exc}: {exc.filename} (made by "
                "`ravnest-node init-swarm NAME --out DIR`)"
            ) from None
        return _checked(ca, cert, key, str(swarm_dir))
    if token is not None:
        return _from_token(token.strip())
    return None


def _from_token(token: str) -> SwarmCredentials:
    bad = ConfigError(
        "token: not a swarm token (it starts with 'rvn1.'; `ravnest-node init-swarm` writes it "
        "to DIR/token)"
    )
    if not token.startswith(TOKEN_PREFIX) or len(token) > MAX_TOKEN_LEN:
        raise bad
    body = token.removeprefix(TOKEN_PREFIX)
    try:
        packed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        fields = msgpack.unpackb(packed, raw=False, max_bin_len=MAX_TOKEN_LEN)
        if not isinstance(fields, dict) or set(fields) != {"ca", "cert", "key"}:
            raise bad
        ca = _pem(x509.load_der_x509_certificate(fields["ca"]))
        cert = _pem(x509.load_der_x509_certificate(fields["cert"]))
        key_obj = serialization.load_der_private_key(fields["key"], password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm, msgpack.UnpackException):
        raise bad from None
    if not isinstance(key_obj, ec.EllipticCurvePrivateKey):
        raise bad
    return _checked(ca, cert, _pem_key(key_obj), "token")


def _common_name(cert: x509.Certificate) -> str:
    common = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    value = common[0].value if common else ""
    return value if isinstance(value, str) else ""


def swarm_of_authority(ca: x509.Certificate) -> str:
    """The name of the swarm whose authority `ca` is."""
    return _common_name(ca).removeprefix(AUTHORITY_PREFIX)


def _checked(ca_pem: bytes, cert_pem: bytes, key_pem: bytes, where: str) -> SwarmCredentials:
    """Credentials whose member certificate is the authority's, current, and matches its key."""
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
        ca_public, public = ca.public_key(), cert.public_key()
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigError(f"{where}: unreadable credentials: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(
        ca_public, ec.EllipticCurvePublicKey
    ):
        raise ConfigError(f"{where}: the credentials are not ECDSA (made by init-swarm)")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm) as exc:
        raise ConfigError(
            f"{where}: the member certificate is not signed by this swarm's authority ({exc!r})"
        ) from None
    if (
        not isinstance(public, ec.EllipticCurvePublicKey)
        or public.public_numbers() != key.public_key().public_numbers()
    ):
        raise ConfigError(f"{where}: the member key does not belong to the member certificate")
    subject = _common_name(cert)
    if not subject.startswith(MEMBER_PREFIX) or not valid_swarm_name(
        subject.removeprefix(MEMBER_PREFIX)
    ):
        raise ConfigError(f"{where}: not a member certificate of a ravnest swarm")
    now = _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise ConfigError(
            f"{where}: the member certificate is valid from {cert.not_valid_before_utc:%Y-%m-%d} "
            f"to {cert.not_valid_after_utc:%Y-%m-%d}, not now: renew it with "
            "`ravnest-node init-swarm NAME --out DIR --renew`"
        )
    return SwarmCredentials(
        swarm=subject.removeprefix(MEMBER_PREFIX),
        ca_pem=ca_pem,
        cert_pem=cert_pem,
        key_pem=key_pem,
        expires=cert.not_valid_after_utc,
    )
