"""`ravnest-node init-swarm` and `ravnest-node revoke`: what the holder of a protected swarm's
authority runs (transport/credentials.py, transport/authority.py, transport/membership.py)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import grpc

from ravnest_node.errors import ConfigError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.state import valid_swarm_name
from ravnest_node.transport.authority import add_members, renew_members, revoke
from ravnest_node.transport.credentials import (
    CA_FILE,
    MEMBER_DAYS,
    MEMBERS_DIR,
    TOKEN_FILE,
    create_swarm,
)
from ravnest_node.transport.options import TransportConfig, grpc_channel

__all__ = ["add_init_swarm_parser", "add_revoke_parser", "run_init_swarm", "run_revoke"]

PROG = "ravnest-node"


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def add_init_swarm_parser(commands: Any) -> None:
    """Register `init-swarm` on `commands` (argparse sub-parsers)."""
    init = commands.add_parser(
        "init-swarm",
        help="create a protected swarm's certificate authority and member credentials",
        description="Write a new certificate authority for swarm NAME and a member certificate "
        "signed by it to --out DIR (ca.pem, ca.key, member.pem, member.key, and token: the "
        "same as one line). Start every node with --swarm-dir DIR (without ca.key) or "
        "--token: they then use mutual TLS with every peer and refuse anyone without the "
        "swarm's certificate. --renew issues new member credentials under the authority "
        "already in DIR. --members N also writes one directory per member, DIR/members/ID, "
        "with a node key of its own certified by the authority: nodes started with "
        "--swarm-dir DIR/members/ID require every member to be so certified, and one member "
        "can be shut out alone (`revoke`); for a DIR that has an authority, --members adds N.",
    )
    init.add_argument("name", metavar="NAME", help="the swarm's name")
    init.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write")
    init.add_argument(
        "--days",
        type=int,
        default=MEMBER_DAYS,
        help=f"member certificate validity (default: {MEMBER_DAYS})",
    )
    init.add_argument(
        "--renew", action="store_true", help="new member credentials, the same authority"
    )
    init.add_argument("--members", type=int, default=0, metavar="N",
                      help="write N member directories with certified node keys")  # fmt: skip


def add_revoke_parser(commands: Any) -> None:
    """Register `revoke` on `commands` (argparse sub-parsers)."""
    cmd = commands.add_parser(
        "revoke",
        help="shut members of a protected swarm out (their node ids)",
        description="Sign a revocation list with the swarm's authority (--swarm-dir DIR, which "
        "holds ca.key): the node ids given and every one revoked before, with the next serial "
        "number; write it to DIR/revoked and, with --coordinator, hand it to the swarm's "
        "coordinator, which bans those members and gives the list to every node with the plan. "
        "Every node refuses their calls from then on. Needs a swarm whose members were "
        "certified (init-swarm --members): elsewhere a revoked member could make a new id.",
    )
    cmd.add_argument("node_ids", nargs="+", metavar="NODE_ID", help="a member's node id")
    cmd.add_argument("--swarm-dir", type=Path, required=True, metavar="DIR",
                     help="the authority's directory (init-swarm --out)")  # fmt: skip
    cmd.add_argument("--coordinator", metavar="HOST:PORT",
                     help="hand the list to the swarm's coordinator")  # fmt: skip
    cmd.add_argument("--timeout-s", type=float, default=10.0,
                     help="seconds to wait for the coordinator (default: 10)")  # fmt: skip


def run_init_swarm(args: argparse.Namespace) -> int:
    """`init-swarm`: write the credentials (and member directories), say what they are for."""
    name, out = args.name, args.out
    if not valid_swarm_name(name):
        return _fail(f"swarm name {name[:80]!r}: 1 to 64 printable characters without '='")
    if args.members < 0:
        return _fail(f"--members {args.members}: a number of members")
    only_members = args.members > 0 and not args.renew and (out / CA_FILE).exists()
    try:
        if not only_members:
            creds = create_swarm(name, out, days=args.days, renew=args.renew)
            renewed = renew_members(out) if args.renew else 0
            what = (
                "new member credentials" if args.renew else "a new authority and member credentials"
            )
            token = out / TOKEN_FILE
            print(
                f"swarm {name!r}: {what} in {out} (member certificate valid until "
                f"{creds.expires:%Y-%m-%d}).\nStart each node with --swarm-dir {out} (copy "
                f"ca.pem, member.pem and member.key; keep ca.key off the nodes), or with the "
                f"token in {token}:\n  RAVNEST_TRANSPORT_TOKEN=$(cat {token}) "
                "ravnest-node start ..."
            )
            if renewed:
                print(f"the new member certificate is in the {renewed} member directories "
                      f"under {out / MEMBERS_DIR} too")  # fmt: skip
        if args.members:
            made = add_members(out, args.members, args.days, name)
            where = out / MEMBERS_DIR
            ids = "\n  ".join(made)
            print(
                f"{len(made)} member directories in {where}, one per node id:\n  {ids}\n"
                f"Start each node with --swarm-dir {where}/ID (copy that directory to its "
                "machine): it is node ID, and its swarm refuses members without a node "
                "certificate from this authority. `ravnest-node revoke` shuts one out."
            )
    except OSError as exc:
        return _fail(f"cannot write to {out}: {exc.strerror or exc}")
    return 0


async def _hand_over(
    address: str, blob: bytes, cfg: TransportConfig, timeout_s: float
) -> tuple[int, str]:
    """(the serial the coordinator holds now, what it said)."""
    async with grpc_channel(address, cfg) as channel:
        reply: pb.RevokeReply = await pb_grpc.CoordinatorStub(channel).Revoke(
            pb.RevokeRequest(revocations=blob), timeout=timeout_s
        )
    banned = ", ".join(reply.banned) or "none of them a member now"
    return reply.serial, (f"the coordinator holds list {reply.serial}, announced with plan "
                          f"epoch {reply.plan_epoch}; banned: {banned}")  # fmt: skip


def run_revoke(args: argparse.Namespace) -> int:
    """`revoke`: sign and write the list; hand it to the coordinator if asked."""
    try:
        signed = revoke(args.swarm_dir, args.node_ids)
    except OSError as exc:
        return _fail(f"cannot write to {args.swarm_dir}: {exc.strerror or exc}")
    print(f"revocation list {signed.serial} ({len(signed.node_ids)} node(s)) written to "
          f"{args.swarm_dir / 'revoked'}")  # fmt: skip
    if not args.coordinator:
        print("hand it to the coordinator: ravnest-node revoke ... --coordinator HOST:PORT")
        return 0
    cfg = TransportConfig(swarm_dir=args.swarm_dir)
    try:
        serial, said = asyncio.run(_hand_over(args.coordinator, signed.blob, cfg, args.timeout_s))
    except grpc.aio.AioRpcError as exc:
        return _fail(f"coordinator {args.coordinator}: {exc.code().name}: {exc.details()}")
    except ConfigError as exc:
        return _fail(str(exc))
    print(said)
    if serial != signed.serial:
        return _fail(f"the coordinator holds list {serial}, not {signed.serial}")
    return 0
