"""Protected swarms: credentials from `init-swarm`, the TLS gate in front of a node's server, and
real node processes that refuse a stranger and log it with its address."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import datetime
import json
import logging
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import msgpack
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import given, settings
from hypothesis import strategies as st

from ravnest_node.daemon.config import NodeConfig
from ravnest_node.errors import ConfigError, PeerRefused, PeerUnavailable
from ravnest_node.transport.credentials import (
    TLS_NAME,
    TOKEN_PREFIX,
    SwarmCredentials,
    create_swarm,
    load_credentials,
)
from ravnest_node.transport.gate import TlsGate, peer_address
from ravnest_node.transport.options import TransportConfig
from ravnest_node.transport.relay import RelayServer
from ravnest_node.transport.tunnel import TunnelClient

from .conftest import NODE_ENV, Procs, demo_summary, node_status, progress_events, ravnest


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("swarm") / "lab"
    create_swarm("lab", out)
    return out


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another swarm of the same name: another authority."""
    out = tmp_path_factory.mktemp("other") / "lab"
    create_swarm("lab", out)
    return out


# ----- credentials --------------------------------------------------------------------------------
def test_the_directory_and_the_token_are_the_same_credentials(swarm: Path) -> None:
    from_dir = load_credentials(swarm, None)
    assert from_dir is not None and from_dir.swarm == "lab"
    token = (swarm / "token").read_text().strip()
    assert load_credentials(None, token) == from_dir
    assert (swarm / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (swarm / "member.key").stat().st_mode & 0o777 == 0o600
    assert (swarm / "token").stat().st_mode & 0o777 == 0o600
    assert load_credentials(None, None) is None  # an open swarm


def test_renew_issues_new_member_credentials_under_the_same_authority(tmp_path: Path) -> None:
    first = create_swarm("lab", tmp_path / "s")
    with pytest.raises(ConfigError, match="already holds a swarm authority"):
        create_swarm("lab", tmp_path / "s")
    with pytest.raises(ConfigError, match="not swarm 'other'"):
        create_swarm("other", tmp_path / "s", renew=True)
    second = create_swarm("lab", tmp_path / "s", renew=True)
    assert second.ca_pem == first.ca_pem and second.cert_pem != first.cert_pem
    with pytest.raises(ConfigError, match="cannot read the authority"):
        create_swarm("lab", tmp_path / "none", renew=True)


def _member(ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate, *, days: int) -> bytes:
    """A member certificate whose validity ends `days` from now (negative: expired)."""
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "member of lab")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=30))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(TLS_NAME)]), False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def test_bad_credentials_are_refused_with_what_is_wrong(
    tmp_path: Path, swarm: Path, stranger: Path
) -> None:
    def write(name: str, ca: Path, cert: bytes, key: bytes) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "ca.pem").write_bytes((ca / "ca.pem").read_bytes())
        (d / "member.pem").write_bytes(cert)
        (d / "member.key").write_bytes(key)
        return d

    member, key = (swarm / "member.pem").read_bytes(), (swarm / "member.key").read_bytes()
    with pytest.raises(ConfigError, match="No such file"):
        load_credentials(tmp_path / "missing", None)
    foreign = write("foreign", stranger, member, key)
    with pytest.raises(ConfigError, match="not signed by this swarm's authority"):
        load_credentials(foreign, None)
    other_key = (stranger / "member.key").read_bytes()
    with pytest.raises(ConfigError, match="does not belong to the member certificate"):
        load_credentials(write("mismatched", swarm, member, other_key), None)
    with pytest.raises(ConfigError, match="unreadable credentials"):
        load_credentials(write("corrupt", swarm, member[:100], key), None)
    ca = x509.load_pem_x509_certificate((swarm / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((swarm / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    expired = write("expired", swarm, *_member(ca_key, ca, days=-1))
    with pytest.raises(ConfigError, match="not now: renew it"):
        load_credentials(expired, None)
    with pytest.raises(ConfigError, match="not both"):
        load_credentials(swarm, "rvn1.x")
    with pytest.raises(ConfigError, match="swarm_name='other'"):
        NodeConfig(swarm_name="other", transport=TransportConfig(swarm_dir=swarm))
    assert NodeConfig(transport=TransportConfig(swarm_dir=swarm)).swarm_name == "lab"


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.text(max_size=200),
        st.binary(max_size=300).map(lambda b: TOKEN_PREFIX + base64.urlsafe_b64encode(b).decode()),
        st.dictionaries(st.sampled_from(["ca", "cert", "key", "x"]), st.binary(max_size=64)).map(
            lambda d: TOKEN_PREFIX + base64.urlsafe_b64encode(msgpack.packb(d)).decode()
        ),
    )
)
def test_a_malformed_token_is_a_config_error_and_nothing_else(token: str) -> None:
    with pytest.raises(ConfigError):
        load_credentials(None, token)


# ----- the gate -----------------------------------------------------------------------------------
SEEN: list[str] = []
"""What the echo server behind the gate makes of its peers, as a gRPC handler would."""


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    host, port = writer.get_extra_info("peername")[:2]
    while data := await reader.read(65536):
        # Once bytes arrive (as a gRPC handler runs only then), the gate knows who sent them.
        SEEN.append(peer_address(f"ipv4:{host}:{port}"))
        writer.write(data)
        await writer.drain()
    writer.close()


def _client_context(creds: SwarmCredentials | None, ca: SwarmCredentials) -> ssl.SSLContext:
    """What a peer's TLS looks like: the swarm's authority, and `creds`' certificate (if any)."""
    if creds is None:
        context = ssl.create_default_context(cadata=ca.ca_pem.decode())
    else:  # another swarm's member certificate, checking this swarm's authority
        context = dataclasses.replace(creds, ca_pem=ca.ca_pem).client_context()
    context.set_alpn_protocols(["h2"])  # as gRPC's own TLS asks
    return context


@pytest.fixture
async def gate(swarm: Path) -> AsyncIterator[TlsGate]:
    creds = load_credentials(swarm, None)
    assert creds is not None
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    backend = ("127.0.0.1", int(echo.sockets[0].getsockname()[1]))
    gate = TlsGate(
        "127.0.0.1", 0, backend, creds.server_context(), max_per_host=3, limit_loopback=True
    )
    await gate.start()
    yield gate
    await gate.close()
    echo.close()


async def _talk(port: int, context: ssl.SSLContext | None, payload: bytes) -> bytes:
    """Connect (TLS with `context`, or plain TCP), send `payload`, read what comes back."""
    tls = {"ssl": context, "server_hostname": TLS_NAME} if context is not None else {}
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, **tls)  # type: ignore[arg-type]
    except (ssl.SSLError, ConnectionError):
        return b""
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.read(len(payload)), 10)
    except (ssl.SSLError, ConnectionError):
        return b""
    finally:
        writer.close()


async def test_the_gate_lets_members_through_and_logs_everyone_else_with_their_address(
    gate: TlsGate, swarm: Path, stranger: Path, caplog: pytest.LogCaptureFixture
) -> None:
    creds, other = load_credentials(swarm, None), load_credentials(stranger, None)
    assert creds is not None and other is not None
    caplog.set_level(logging.WARNING, logger="ravnest_node.transport.gate")
    three = asyncio.Event()
    refuse = gate._refuse

    def counted(address: str, reason: str) -> None:
        refuse(address, reason)
        if gate.refused == 3:
            three.set()

    gate._refuse = counted  # type: ignore[method-assign]
    SEEN.clear()
    assert await _talk(gate.port, _client_context(creds, creds), b"hello") == b"hello"
    assert gate.accepted == 1 and gate.refused == 0
    # Behind the gate, the peer is known by its own address and certificate.
    (seen,) = SEEN
    assert seen.startswith("127.0.0.1:") and seen.endswith(" (member of lab)")
    # No certificate, another authority's, and not TLS at all: each refused and logged.
    assert await _talk(gate.port, _client_context(None, creds), b"hello") == b""
    assert await _talk(gate.port, _client_context(other, creds), b"hello") == b""
    assert await _talk(gate.port, None, b"GET / HTTP/1.1\r\n\r\n") == b""
    await asyncio.wait_for(three.wait(), 10)
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.message]
    assert len(refusals) == 3
    assert all(m.startswith("refused a connection from 127.0.0.1:") for m in refusals)
    reasons = [m.rpartition(": ")[2] for m in refusals]
    assert reasons[0] == "no certificate"
    assert reasons[1] == "a certificate this swarm's authority did not sign"
    assert reasons[2].startswith("not TLS")
    assert gate.accepted == 1


async def test_one_host_cannot_hold_every_connection(gate: TlsGate, swarm: Path) -> None:
    creds = load_credentials(swarm, None)
    assert creds is not None
    context = _client_context(creds, creds)
    held = [
        await asyncio.open_connection("127.0.0.1", gate.port, ssl=context, server_hostname=TLS_NAME)
        for _ in range(3)
    ]
    for reader, writer in held:  # all three go through
        writer.write(b"x")
        assert await asyncio.wait_for(reader.read(1), 10) == b"x"
    assert await _talk(gate.port, context, b"fourth") == b""  # over max_per_host=3
    assert gate.refused == 1
    for _, writer in held:
        writer.close()


async def test_a_relay_of_a_protected_swarm_refuses_a_tunnel_without_its_certificate(
    swarm: Path, stranger: Path
) -> None:
    creds, other = load_credentials(swarm, None), load_credentials(stranger, None)
    assert creds is not None and other is not None
    relay = RelayServer("127.0.0.1:0", "127.0.0.1", tls=creds.server_context())
    port = await relay.start()
    try:
        member = TunnelClient(f"127.0.0.1:{port}", "member", "127.0.0.1:9",
                              connect_timeout_s=5, tls=creds.client_context())  # fmt: skip
        assert (await member.open()).startswith("127.0.0.1:")
        member.close()
        for tls in (None, other.client_context()):  # plain TCP; another swarm's certificate
            client = TunnelClient(f"127.0.0.1:{port}", "intruder", "127.0.0.1:9",
                                  connect_timeout_s=5, tls=tls)  # fmt: skip
            with pytest.raises((PeerRefused, PeerUnavailable)):
                await client.open()
            client.close()
        assert relay.refused >= 1 and set(relay.tunnels()) <= {"member"}
    finally:
        await relay.close()


# ----- real node processes ------------------------------------------------------------------------
def test_a_protected_swarm_trains_and_refuses_a_node_without_its_certificate(
    procs: Procs, tmp_path: Path, swarm: Path
) -> None:
    """Three nodes of swarm `lab` (two from the directory, one from the token alone) train
    over mutual TLS; a fourth started without credentials is refused, and the coordinator logs
    the refusal with its address; `status` answers only with the credentials."""
    transport = TransportConfig(swarm_dir=swarm)
    _, ready = procs.start_node(tmp_path / "n0", "--swarm-dir", str(swarm), "--swarm-size", "3",
                                "--model", "tiny", "--steps", "10", "--relay-listen",
                                "127.0.0.1:0")  # fmt: skip
    coordinator = ready["address"]
    token_env = {**NODE_ENV, "RAVNEST_TRANSPORT_TOKEN": (swarm / "token").read_text().strip()}
    procs.start_node(tmp_path / "n1", "--swarm-dir", str(swarm), "--join", coordinator)
    # Behind NAT too: its tunnel through n0's relay passes mutual TLS as well.
    _, hidden = procs.start_node(tmp_path / "n2", "--join", coordinator, "--no-inbound",
                                 env=token_env)  # fmt: skip
    open_node, _ = procs.start_node(tmp_path / "n3", "--join", coordinator,
                                    "--connect-timeout-s", "3")  # fmt: skip
    assert open_node.wait(60) == 1  # it never got an answer
    done = [e for e in progress_events(coordinator, transport=transport) if e.done]
    assert len(done) == 1 and not done[0].error
    assert json.loads(done[0].summary_json)["steps"] == 10
    status = node_status(coordinator, transport)
    assert status.security == "mtls" and status.refused_connections >= 1
    assert dict(status.relayed) == {hidden["node_id"]: hidden["address"]}
    log = (tmp_path / "n0" / "node.log").read_text()
    assert "refused a connection from 127.0.0.1:" in log and "not TLS" in log
    assert "swarm 'lab' is protected" in log
    assert "swarm 'default' is open" in (tmp_path / "n3" / "node.log").read_text()

    def status_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(ravnest("status", *args), env=NODE_ENV, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)  # fmt: skip

    refused = status_cli(coordinator, "--timeout-s", "3")
    assert refused.returncode == 1 and "answers only with its credentials" in refused.stderr
    shown = status_cli("--swarm-dir", str(swarm), "--peer", coordinator, "--json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    assert view["swarm"] == "lab" and view["security"] == "mtls"
    assert len(view["members"]) == 3
    assert all(m["reachable"] and m["security"] == "mtls" for m in view["members"])
    for proc in procs.started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    assert [proc.wait(30) for proc in procs.started if proc is not open_node] == [0, 0, 0]


def test_replicas_of_a_protected_swarm_average_over_mutual_tls(tmp_path: Path, swarm: Path) -> None:
    """`demo --swarm-dir`: four protected node processes, two pipelines of two stages; each
    stage averages with its replica over the same mutual TLS, every round complete."""
    s = demo_summary(tmp_path, "protected", "--swarm-dir", str(swarm), "--model", "tiny",
                     "--nodes", "4", "--pipelines", "2", "--steps", "8",
                     "--average-every", "4")  # fmt: skip
    assert s["pipelines"] == 2 and len(s["stages"]) == 4
    for stage in s["stages"]:
        assert stage["averaging_rounds"] == 2 and stage["averaging_rounds_incomplete"] == 0
        assert stage["averaging_bytes_sent"] > 0
    logs = "".join(p.read_text() for p in (tmp_path / "protected").rglob("*.log"))
    assert "swarm 'lab' is protected" in logs and "refused a connection" not in logs
