"""Shutting one member of a protected swarm out (issue #35, item 2; transport/membership.py,
transport/authority.py, coordinator/bans.py): node certificates from the swarm's authority,
signed revocation lists, the coordinator's rules and the interceptor every node refuses
revoked members with. Across real processes: tests/test_revocation_live.py."""

from __future__ import annotations

import argparse
import base64
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import msgpack
import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from ravnest_node.cli.swarm import run_init_swarm
from ravnest_node.coordination.coordinator.service import CoordinatorService
from ravnest_node.errors import ConfigError
from ravnest_node.identity import (
    NODE_KEY_FILE,
    PROOF_METADATA,
    NodeKey,
    ProofError,
    proof_key,
    verify,
)
from ravnest_node.launch.demo import DemoConfig
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import PROTOCOL
from ravnest_node.transport.authority import add_members, member_identity, revoke
from ravnest_node.transport.credentials import (
    MEMBERS_DIR,
    create_swarm,
    load_authority,
    load_credentials,
)
from ravnest_node.transport.errors import Refusal
from ravnest_node.transport.membership import (
    CERTIFICATE_FILE,
    REVOKED,
    REVOKED_FILE,
    Membership,
    MembershipError,
    RevocationList,
    _proof_node,
    certify,
    check_certificate,
    sign_revocations,
)
from ravnest_node.transport.options import TransportConfig
from ravnest_node.transport.proofs import provers, request_digest

from .fakes import Aborted, Clock, FakeContext, capabilities

DAY = 86_400


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("authority")
    create_swarm("lab", out)
    return out


def _keys(out: Path) -> tuple[ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey]:
    _, key = load_authority(out, "lab", "test")
    return key, key.public_key()


def test_a_node_certificate_holds_for_its_node_only(authority: Path, tmp_path: Path) -> None:
    private, public = _keys(authority)
    node, other = NodeKey.generate(), NodeKey.generate()
    until = int(time.time()) + DAY
    cert = certify(private, "lab", node.public, until)
    check_certificate(public, "lab", cert, node.node_id)
    create_swarm("lab", tmp_path / "elsewhere")
    foreign, _ = _keys(tmp_path / "elsewhere")
    fields = msgpack.unpackb(cert)
    refused = {
        "another node": (cert, other.node_id, "vouches for node"),
        "another swarm": (certify(private, "other", node.public, until), node.node_id, "of swarm"),
        "another authority": (certify(foreign, "lab", node.public, until), node.node_id,
                              "not signed by this swarm's authority"),
        "expired": (certify(private, "lab", node.public, int(time.time()) - 1), node.node_id,
                    "expired"),
        "a later expiry than signed": (msgpack.packb({**fields, "until": until + DAY}),
                                       node.node_id, "not signed"),
        "garbage": (b"\x00" * 40, node.node_id, "not"),
        "empty": (b"", node.node_id, "0 bytes"),
        "too long": (b"x" * 5000, node.node_id, "5000 bytes"),
    }  # fmt: skip
    for what, (blob, node_id, why) in refused.items():
        with pytest.raises(MembershipError, match=why):
            check_certificate(public, "lab", blob, node_id)
        assert what


def test_init_swarm_members_writes_certified_member_directories(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    args = argparse.Namespace(name="lab", out=out, days=30, renew=False, members=2)
    assert run_init_swarm(args) == 0
    ids = sorted(p.name for p in (out / MEMBERS_DIR).iterdir())
    assert len(ids) == 2
    _, public = _keys(out)
    for node_id in ids:
        home = out / MEMBERS_DIR / node_id
        assert not (home / "ca.key").exists()  # the authority's key stays with its holder
        assert load_credentials(home, None) is not None
        found = member_identity(home)
        assert found is not None
        key, cert = found
        assert key.node_id == node_id
        check_certificate(public, "lab", cert, node_id)
    # More under the same authority; the swarm's credentials stay as they were.
    member_pem = (out / "member.pem").read_bytes()
    assert run_init_swarm(argparse.Namespace(**{**vars(args), "members": 1})) == 0
    assert len(list((out / MEMBERS_DIR).iterdir())) == 3
    assert (out / "member.pem").read_bytes() == member_pem
    assert member_identity(out) is None  # the authority's directory is no member's
    half = out / MEMBERS_DIR / ids[0]
    (half / CERTIFICATE_FILE).unlink()
    with pytest.raises(ConfigError, match="holds both"):
        member_identity(half)
    (half / CERTIFICATE_FILE).write_text("not base64 !\n")
    with pytest.raises(ConfigError, match="not a node certificate"):
        member_identity(half)
    with pytest.raises(ConfigError, match="cannot read the authority"):
        add_members(half, 1, 30)  # no ca.key there


def test_a_revocation_list_is_the_authoritys_and_only_a_newer_one_replaces_it(
    authority: Path, tmp_path: Path
) -> None:
    private, public = _keys(authority)
    a, b = NodeKey.generate().node_id, NodeKey.generate().node_id
    first = sign_revocations(private, "lab", 1, [a])
    second = sign_revocations(private, "lab", 2, [a, b])
    state = tmp_path / "state"
    state.mkdir()
    m = Membership(public, "lab", certified=True, state_dir=state)
    assert m.adopt(second.blob) and m.revoked == {a, b}
    assert not m.adopt(first.blob)  # an older list changes nothing
    assert m.revoked == {a, b} and (state / REVOKED_FILE).read_bytes() == second.blob
    fields = msgpack.unpackb(second.blob)
    forged = msgpack.packb({**fields, "ids": [a]})  # one name taken off
    foreign = sign_revocations(
        ec.generate_private_key(ec.SECP256R1()), "lab", 3, [NodeKey.generate().node_id]
    )
    for blob, why in [(forged, "not signed"), (foreign.blob, "not signed"),
                      (sign_revocations(private, "other", 3, [a]).blob, "of swarm"),
                      (b"\x92\x01\x02", "not one this version reads")]:  # fmt: skip
        with pytest.raises(MembershipError, match=why):
            m.adopt(blob)
    assert m.current is not None and m.current.serial == 2
    # A restarted node holds what it held; an open swarm has no authority to revoke.
    again = Membership.of((authority / "ca.pem").read_bytes(), "lab", state_dir=state)
    assert again.revoked == {a, b}
    with pytest.raises(MembershipError, match="open swarm"):
        Membership().adopt(second.blob)
    with pytest.raises(MembershipError, match="not node ids"):
        sign_revocations(private, "lab", 1, ["../../etc"])


def test_revoke_adds_to_the_last_list_with_the_next_serial(tmp_path: Path) -> None:
    create_swarm("lab", tmp_path)
    _, public = _keys(tmp_path)
    a, b = NodeKey.generate().node_id, NodeKey.generate().node_id
    assert revoke(tmp_path, [a]).serial == 1
    second = revoke(tmp_path, [b])
    read = RevocationList.read(public, "lab", (tmp_path / REVOKED_FILE).read_bytes())
    assert (second.serial, read.serial, read.node_ids) == (2, 2, {a, b})
    with pytest.raises(ConfigError, match="not node ids"):
        revoke(tmp_path, ["Z"])
    (tmp_path / REVOKED_FILE).write_bytes(b"damaged")
    with pytest.raises(ConfigError, match="copy the newest list back"):
        revoke(tmp_path, [a])


def test_membership_checks_joining_nodes(authority: Path) -> None:
    private, public = _keys(authority)
    node, stranger = NodeKey.generate(), NodeKey.generate()
    cert = certify(private, "lab", node.public, int(time.time()) + DAY)
    certified = Membership(public, "lab", certified=True)
    certified.check_member(node.node_id, cert)
    for node_id, blob, why in [(stranger.node_id, b"", "has no node certificate"),
                               (stranger.node_id, cert, "vouches for node")]:  # fmt: skip
        with pytest.raises(Refusal, match=why) as refused:
            certified.check_member(node_id, blob)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    Membership(public, "lab").check_member(stranger.node_id, b"")  # not certified: any key
    certified.adopt(sign_revocations(private, "lab", 1, [node.node_id]).blob)
    with pytest.raises(Refusal, match=REVOKED):
        certified.check_member(node.node_id, cert)


# ----- the coordinator's rules ----------------------------------------------------------------
COORDINATOR = "/ravnest.v1.Coordinator/"


def _as(key: NodeKey, method: str, request: Any) -> Any:
    proof = key.prove(COORDINATOR + method, request_digest(request))
    return FakeContext(((PROOF_METADATA, proof),))


async def _join(svc: CoordinatorService, key: NodeKey, cert: bytes) -> None:
    request = pb.JoinRequest(node_id=key.node_id, address=f"{key.node_id}:1", protocol=PROTOCOL,
                             node_certificate=cert)  # fmt: skip
    await svc.Join(request, _as(key, "Join", request))
    request.capabilities.CopyFrom(capabilities(blocks=4))
    await svc.Join(request, _as(key, "Join", request))


async def test_a_certified_swarms_coordinator_admits_certified_nodes_and_bans_revoked_ones(
    authority: Path,
) -> None:
    private, public = _keys(authority)
    keys = [NodeKey.generate() for _ in range(4)]
    until = int(time.time()) + DAY
    certs = {k.node_id: certify(private, "lab", k.public, until) for k in keys}
    membership = Membership(public, "lab", certified=True)
    train = TrainConfig(model="tiny", steps=50, pipelines=2)
    svc = CoordinatorService(train=train, swarm_size=4, swarm_id="lab/tiny", summary_path=None,
                             clock=Clock(), membership=membership)  # fmt: skip
    stranger = NodeKey.generate()
    request = pb.JoinRequest(node_id=stranger.node_id, address="x:1", protocol=PROTOCOL)
    with pytest.raises(Aborted) as refused:
        await svc.Join(request, _as(stranger, "Join", request))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "no node certificate" in refused.value.details and not svc.roster.members
    for key in keys:
        await _join(svc, key, certs[key.node_id])
    plan = svc.plan
    assert plan is not None and len(plan.stages) == 4 and not plan.revocations
    epoch, announced = plan.epoch, len(svc.book.announcements)
    target = next(st for st in plan.stages if st.pipeline == 1 and st.index == 1)
    for blob, code in [(b"junk", grpc.StatusCode.PERMISSION_DENIED),
                       (sign_revocations(ec.generate_private_key(ec.SECP256R1()), "lab", 1,
                                         [target.node_id]).blob,
                        grpc.StatusCode.PERMISSION_DENIED)]:  # fmt: skip
        with pytest.raises(Aborted) as refused:
            await svc.Revoke(pb.RevokeRequest(revocations=blob), FakeContext())
        assert refused.value.code == code
    assert len(svc.book.announcements) == announced and not svc.faults.banned
    signed = sign_revocations(private, "lab", 1, [target.node_id])
    reply = await svc.Revoke(pb.RevokeRequest(revocations=signed.blob), FakeContext())
    assert reply.serial == 1 and list(reply.banned) == [target.node_id]
    assert reply.plan_epoch > epoch  # re-planned without it
    newest = svc.book.announcements[-1]
    assert newest.revocations == signed.blob and target.node_id in newest.banned
    assert target.node_id not in {st.node_id for st in newest.stages}
    assert target.node_id in svc.roster.leases.left
    assert "revoked by the swarm's authority" in svc.faults.banned[target.node_id].to_dict()[
        "reason"]  # fmt: skip
    # Handed over again: nothing more happens; the revoked member cannot come back.
    again = await svc.Revoke(pb.RevokeRequest(revocations=signed.blob), FakeContext())
    assert again.serial == 1 and not again.banned
    revoked_key = next(k for k in keys if k.node_id == target.node_id)
    with pytest.raises(Aborted) as refused:
        await _join(svc, revoked_key, certs[target.node_id])
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED


async def test_an_open_swarms_coordinator_has_nothing_to_revoke() -> None:
    svc = CoordinatorService(train=TrainConfig(model="tiny", steps=5), swarm_size=2,
                             swarm_id="s", summary_path=None, clock=Clock())  # fmt: skip
    with pytest.raises(Aborted) as refused:
        await svc.Revoke(pb.RevokeRequest(revocations=b"x"), FakeContext())
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_list_a_node_held_before_it_coordinates_is_in_its_first_plan(
    authority: Path,
) -> None:
    private, public = _keys(authority)
    gone = NodeKey.generate()
    membership = Membership(public, "lab")
    membership.adopt(sign_revocations(private, "lab", 1, [gone.node_id]).blob)
    svc = CoordinatorService(train=TrainConfig(model="tiny", steps=5), swarm_size=2,
                             swarm_id="s", summary_path=None, clock=Clock(),
                             membership=membership)  # fmt: skip
    until = int(time.time()) + DAY
    for key in (NodeKey.generate(), NodeKey.generate()):
        await _join(svc, key, certify(private, "lab", key.public, until))
    assert svc.plan is not None and svc.book.announcements[-1].revocations
    assert gone.node_id in svc.book.announcements[-1].banned


# ----- every node: the interceptor ------------------------------------------------------------
async def _echo(request: bytes, context: Any) -> bytes:
    return request


async def _stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield request


@pytest.fixture
async def server(authority: Path) -> AsyncIterator[tuple[str, Membership]]:
    _, public = _keys(authority)
    membership = Membership(public, "lab")
    srv = grpc.aio.server(interceptors=[membership.interceptor()])
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(_echo),
        "Stream": grpc.unary_stream_rpc_method_handler(_stream),
    }
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", handlers)])
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield f"127.0.0.1:{port}", membership
    finally:
        await srv.stop(None)


async def test_every_call_a_revoked_member_proves_is_refused_before_its_handler(
    server: tuple[str, Membership], authority: Path
) -> None:
    address, membership = server
    private, _ = _keys(authority)
    revoked, other = NodeKey.generate(), NodeKey.generate()

    async def calls(key: NodeKey) -> list[Any]:
        meta = (("ravnest-node-id", key.node_id),)  # (its proof is added: proofs.provers)
        results: list[Any] = []
        async with grpc.aio.insecure_channel(address, interceptors=provers(key)) as ch:
            try:
                results.append(await ch.unary_unary("/t.T/Echo")(b"hi", metadata=meta))
            except grpc.aio.AioRpcError as exc:
                results.append((exc.code(), exc.details()))
            try:
                stream = ch.unary_stream("/t.T/Stream")(b"hi", metadata=meta)
                results.append([m async for m in stream])
            except grpc.aio.AioRpcError as exc:
                results.append((exc.code(), exc.details()))
        return results

    assert await calls(revoked) == [b"hi", [b"hi"]]  # nothing revoked yet
    membership.adopt(sign_revocations(private, "lab", 1, [revoked.node_id]).blob)
    refused = await calls(revoked)
    assert all(r[0] == grpc.StatusCode.PERMISSION_DENIED and REVOKED in r[1] for r in refused)
    assert membership.refused == 2
    assert await calls(other) == [b"hi", [b"hi"]]


def test_a_certificate_file_is_one_line_of_base64(tmp_path: Path) -> None:
    create_swarm("lab", tmp_path)
    [node_id] = add_members(tmp_path, 1, 1)
    home = tmp_path / MEMBERS_DIR / node_id
    text = (home / CERTIFICATE_FILE).read_text()
    assert text.endswith("\n") and text.count("\n") == 1
    assert msgpack.unpackb(base64.b64decode(text))["v"] == 1
    assert (home / NODE_KEY_FILE).stat().st_mode & 0o077 == 0


def test_a_demo_refuses_a_member_directory_for_all_its_nodes(tmp_path: Path) -> None:
    create_swarm("lab", tmp_path)
    [node_id] = add_members(tmp_path, 1, 1)
    home = tmp_path / MEMBERS_DIR / node_id
    with pytest.raises(ConfigError, match="one node's identity"):
        DemoConfig(nodes=3, transport=TransportConfig(swarm_dir=home))
    DemoConfig(nodes=3, transport=TransportConfig(swarm_dir=tmp_path))  # the swarm's: fine


def test_a_proof_whose_key_is_padded_with_stray_characters_is_no_proof() -> None:
    """A revoked member must not hide its key from the interceptor with characters a lax
    base64 decoder skips: every reader parses a proof strictly, the same way."""
    key = NodeKey.generate()
    proof = key.prove("/t.T/Echo", "0", "")
    padded = "!" * 24 + proof
    assert proof_key(proof) == key.public and proof_key(padded) is None
    with pytest.raises(ProofError, match="malformed"):
        verify(padded, "/t.T/Echo", key.node_id, "0", "")
    meta = [(PROOF_METADATA, padded)]
    assert _proof_node(meta) == ""  # no proof at all: the proof check itself refuses the call
    assert _proof_node([(PROOF_METADATA, proof), (PROOF_METADATA, "x")]) == key.node_id


def test_a_coordinator_started_from_the_authoritys_directory_requires_certificates(
    tmp_path: Path,
) -> None:
    """Certificates are the swarm's rule, not only of nodes started from a member directory:
    the directory that issued them, or a node that holds a revocation list, requires them."""
    create_swarm("lab", tmp_path)
    pem = (tmp_path / "ca.pem").read_bytes()
    private, _ = _keys(tmp_path)
    assert not Membership.of(pem, "lab", state_dir=None, swarm_dir=tmp_path).certified
    [node_id] = add_members(tmp_path, 1, 1)
    assert Membership.of(pem, "lab", state_dir=None, swarm_dir=tmp_path).certified
    member = Membership.of(pem, "lab", state_dir=None, member=True,
                           swarm_dir=tmp_path / MEMBERS_DIR / node_id)  # fmt: skip
    assert member.certified
    revoking = Membership.of(pem, "lab", state_dir=None)
    revoking.adopt(sign_revocations(private, "lab", 1, [NodeKey.generate().node_id]).blob)
    assert revoking.certified
    assert not Membership(None, "", certified=True).certified  # an open swarm certifies nothing


async def test_a_list_that_does_not_replace_the_held_one_is_refused(authority: Path) -> None:
    private, public = _keys(authority)
    membership = Membership(public, "lab")
    svc = CoordinatorService(train=TrainConfig(model="tiny", steps=5), swarm_size=2,
                             swarm_id="s", summary_path=None, clock=Clock(),
                             membership=membership)  # fmt: skip
    a, b = NodeKey.generate().node_id, NodeKey.generate().node_id
    second = sign_revocations(private, "lab", 2, [a])
    assert (await svc.Revoke(pb.RevokeRequest(revocations=second.blob), FakeContext())).serial == 2
    restarted = sign_revocations(private, "lab", 1, [a, b])  # a list started anew
    with pytest.raises(Aborted) as refused:
        await svc.Revoke(pb.RevokeRequest(revocations=restarted.blob), FakeContext())
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds revocation list 2" in refused.value.details
    assert membership.revoked == {a}


def test_a_member_directory_whose_certificate_is_not_its_keys_stops_the_node(
    tmp_path: Path,
) -> None:
    create_swarm("lab", tmp_path)
    one, two = add_members(tmp_path, 2, 1)
    home = tmp_path / MEMBERS_DIR / one
    (home / CERTIFICATE_FILE).write_bytes((tmp_path / MEMBERS_DIR / two / CERTIFICATE_FILE)
                                          .read_bytes())  # fmt: skip
    with pytest.raises(ConfigError, match="vouches for node"):
        member_identity(home)


def test_renew_reaches_the_member_directories(tmp_path: Path) -> None:
    out = tmp_path / "lab"
    args = argparse.Namespace(name="lab", out=out, days=30, renew=False, members=1)
    assert run_init_swarm(args) == 0
    [home] = (out / MEMBERS_DIR).iterdir()
    before = (home / "member.pem").read_bytes()
    assert run_init_swarm(argparse.Namespace(**{**vars(args), "renew": True, "members": 0})) == 0
    assert (home / "member.pem").read_bytes() == (out / "member.pem").read_bytes() != before
    assert member_identity(home) is not None
    wrong = argparse.Namespace(**{**vars(args), "name": "other"})
    with pytest.raises(ConfigError, match="not swarm 'other'"):
        run_init_swarm(wrong)
