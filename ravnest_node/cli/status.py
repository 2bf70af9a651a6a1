"""`ravnest-node status`: what a running node, or a whole swarm, says about itself.

`status HOST:PORT` asks one node (`Node.Status`): its role and swarm, the coordinator it follows
and how it found it (given by --join, over mDNS, or through a bootstrap peer), the mDNS records
it sees, its stage and counters.

`status --swarm NAME` finds the swarm's coordinator as a worker would (mDNS on the LAN, and any
`--peer HOST:PORT`), asks it for the swarm (`Coordinator.Swarm`: members, plan, progress) and
every member for its status, and shows who owns which blocks, who answers, step counters and
samples/s. `--json` prints the same as one JSON object for tools.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import grpc

from ravnest_node.coordination.locate import Found, grpc_status_asker, locate_coordinator
from ravnest_node.discovery.mdns import MdnsDiscovery
from ravnest_node.errors import ConfigError, PeerError, StartupError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.protocol import PROTOCOL
from ravnest_node.transport.options import (
    TransportConfig,
    grpc_channel,
    grpc_sync_channel,
    split_host_port,
)
from ravnest_node.units import rate_text

_ENUMS = {"role": ("NODE_ROLE_", pb.NodeRole), "coordinator_found_via": ("FOUND_VIA_", pb.FoundVia)}

WATCH_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What ends `status --watch`."""


def status_dict(status: pb.NodeStatus) -> dict[str, Any]:
    """Every field of `status`, enums as lower-case words ("worker", "mdns", "" if unset)."""
    out: dict[str, Any] = {}
    for field in status.DESCRIPTOR.fields:
        value = getattr(status, field.name)
        if field.name in _ENUMS:
            prefix, enum = _ENUMS[field.name]
            value = "" if value == 0 else enum.Name(value).removeprefix(prefix).lower()
        elif field.message_type is not None and field.message_type.GetOptions().map_entry:
            value = dict(value)
        out[field.name] = value
    return out


def describe(status: pb.NodeStatus) -> str:
    """A few lines for a person."""
    s = status_dict(status)
    role = s["role"] or "node"
    lines = [f"node {s['node_id']} at {s['address']}: {role} of swarm {s['swarm_name']!r}"]
    if not s["coordinator_address"]:
        lines.append("coordinator: not found yet")
    elif s["role"] == "coordinator":
        lines.append("coordinator: this node")
    else:
        how = {
            "config": "given by --join",
            "mdns": f"found over mDNS (record of node {s['coordinator_found_from']})",
            "peer": f"found through bootstrap peer {s['coordinator_found_from']}",
        }.get(s["coordinator_found_via"], "")
        lines.append(f"coordinator: {s['coordinator_address']}" + (f", {how}" if how else ""))
    if s["mdns_peers"]:
        lines.append(f"mDNS: sees {s['mdns_peers']} other nodes of the swarm")
    if s["relay"]:
        lines.append(f"reached through relay {s['relay']} (it accepts no connections itself)")
    if s["relay_address"]:
        lines.append(f"relay on {s['relay_address']} for {len(s['relayed'])} nodes")
        lines += [f"  {n} at {a}" for n, a in sorted(s["relayed"].items())]
    if s["device"]:  # (a node older than GPU nodes does not say)
        lines.append(f"compute: {s['device']}, precision {s['precision']}")
    if s["stage"] < 0:
        lines.append("stage: none yet")
    else:
        done = ", run done" if s["run_done"] else ""
        lines.append(
            f"stage {s['stage']}: blocks [{s['first_block']}, {s['stop_block']}), plan epoch "
            f"{s['plan_epoch']}, weight version {s['version']}, "
            f"{s['microbatches_in_flight']} microbatches in flight{done}"
        )
    if s["eval_step"]:
        lines.append(f"evaluation on held-out data after step {s['eval_step']}: "
                     f"loss {s['eval_loss']:.4f}")  # fmt: skip
    if s["security"] == "mtls":
        lines.append(f"security: protected (mutual TLS); {s['refused_connections']} "
                     "connections refused")  # fmt: skip
    else:
        lines.append("security: open (anyone who can reach it may call it)")
    if s["calls_limited"] or s["messages_delayed"]:
        lines.append(f"per-peer limits: {s['calls_limited']} calls refused, "
                     f"{s['messages_delayed']} stream messages held back")  # fmt: skip
    if s["requests_malformed"]:
        peers = ", ".join(f"{p} {n}" for p, n in s["requests_malformed_by_peer"].items())
        lines.append(f"malformed requests refused: {s['requests_malformed']} ({peers})")
    lines += [f"banned replica {n}: {why}" for n, why in sorted(s["banned_replicas"].items())]
    lines.append(
        f"frames accepted {s['frames_accepted']}, refused {s['frames_refused']}; "
        f"bytes sent {s['bytes_sent']}"
    )
    return "\n".join(lines)


def run_status(
    address: str, *, as_json: bool, timeout_s: float, transport: TransportConfig | None = None
) -> int:
    """Print the node's status; exit status 0, 1 if it does not answer, 2 for a bad address.
    `transport` carries a protected swarm's credentials (--swarm-dir, --token)."""
    transport = transport or TransportConfig()
    try:
        split_host_port(address)
    except ConfigError as exc:
        print(f"ravnest-node: error: {exc}", file=sys.stderr)
        return 2
    try:
        with grpc_sync_channel(address, transport) as channel:
            status: pb.NodeStatus = pb_grpc.NodeStub(channel).Status(
                pb.StatusRequest(), timeout=timeout_s
            )
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "UNAVAILABLE"
        print(f"ravnest-node: status: no answer from {address} ({code}){_hint(code, transport)}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(json.dumps(status_dict(status)) if as_json else describe(status))
    return 0


# ----- the whole swarm --------------------------------------------------------------------------
def _hint(code: str, transport: TransportConfig) -> str:
    """Why a node may not answer: a protected node refuses a caller without its credentials."""
    if code != "UNAVAILABLE":
        return ""
    if transport.credentials is None:
        return "; a protected swarm's node answers only with its credentials: --swarm-dir DIR"
    return "; or it is not of this swarm (another authority), or an open node"


async def _swarm_view(address: str, timeout_s: float, transport: TransportConfig) -> pb.SwarmView:
    async with grpc_channel(address, transport) as ch:
        view: pb.SwarmView = await pb_grpc.CoordinatorStub(ch).Swarm(
            pb.SwarmRequest(), timeout=timeout_s
        )
        return view


async def _member_status(
    address: str, timeout_s: float, transport: TransportConfig
) -> pb.NodeStatus | str:
    """The member's status, or why it did not answer."""
    try:
        return await grpc_status_asker(transport)(address, timeout_s)
    except PeerError as exc:
        return str(exc)


def swarm_dict(
    swarm: str,
    found: Found,
    view: pb.SwarmView,
    statuses: Sequence[pb.NodeStatus | str],
    security: str = "open",
) -> dict[str, Any]:
    """The swarm as one JSON-able object: the coordinator, the plan and every member (reached
    with `security`: "mtls" with the swarm's credentials, or "open"). Pure."""
    stages = {s.node_id: s for s in view.plan.stages}
    members = [
        member_dict(member, stages.get(member.node_id), status)
        for member, status in zip(view.members, statuses, strict=True)
    ]
    return {
        "swarm": swarm,
        "swarm_id": view.swarm_id,
        # "mtls": a protected swarm, asked with its credentials; "open": anyone may join.
        "security": security,
        "coordinator": {
            "address": found.address,
            "found_via": found.via_name,
            "found_from": found.source,
        },
        "swarm_size": view.swarm_size,
        "plan_epoch": view.plan.epoch if view.HasField("plan") else 0,
        "pipelines": max(1, view.plan.run.pipelines) if view.HasField("plan") else 0,
        "step": view.step,
        "samples": view.samples,
        "samples_per_s": view.samples_per_s,
        "done": view.done,
        # Evaluations on held-out data (--eval-every): [step, mean loss] each.
        "evals": [[s, v] for s, v in zip(view.eval_steps, view.eval_losses, strict=True)],
        "members": members,
        # Relays a node behind NAT may choose (--no-inbound without --relay).
        "relays": [{"node_id": r.node_id, "address": r.address} for r in view.relays],
    }


def member_dict(
    member: pb.SwarmMember, stage: pb.StageAssignment | None, status: pb.NodeStatus | str
) -> dict[str, Any]:
    """One member of `swarm_dict`: what the coordinator says of it, its `stage` of the plan
    (None: it holds none), and what it said itself (`status`) or why it did not answer. Pure."""
    entry: dict[str, Any] = {
        "node_id": member.node_id,
        "address": member.address,
        "reachable": isinstance(status, pb.NodeStatus),
        "error": status if isinstance(status, str) else "",
        "pipeline": stage.pipeline if stage else None,
        "stage": stage.index if stage else None,
        "blocks": [stage.first_block, stage.stop_block] if stage else None,
        "compute_s": member.compute_s,
        "speed": member.speed,
        "silent_s": member.silent_s,
        "lease_expired": member.lease_expired,
        "left": member.left,
        "checkpoint_step": member.checkpoint_step,
        # Its link to the coordinator, as it measured it before the plan (0: not measured).
        "uplink_bps": member.uplink_bps,
        "rtt_s": member.rtt_s,
        # Its links to the members that joined before it, measured both ways before it
        # sent its capabilities (bits per second there and back, round trip).
        "links": [peer_link(p) for p in member.peer_links],
        # The relay it is reached through ("": it accepts connections itself, or did not
        # answer).
        "relay": "",
    }
    if isinstance(status, pb.NodeStatus):
        entry.update(
            role=status_dict(status)["role"],
            version=status.version,
            bytes_sent=status.bytes_sent,
            run_done=status.run_done,
            relay=status.relay,
            security=status.security,
            device=status_dict(status).get("device", ""),
        )
    return entry


def peer_link(link: pb.PeerLink) -> dict[str, Any]:
    return {"node_id": link.node_id, "to_bps": link.to_bps, "from_bps": link.from_bps,
            "rtt_s": link.rtt_s}  # fmt: skip


def describe_swarm(s: dict[str, Any]) -> str:
    """A few lines for a person."""
    c = s["coordinator"]
    lines = [
        f"swarm {s['swarm']!r} ({s['swarm_id']}): coordinator {c['address']}, found via "
        f"{c['found_via']} ({c['found_from']})",
        (f"plan epoch {s['plan_epoch']}" if s["plan_epoch"] else "no plan yet")
        + f", {len(s['members'])} of {s['swarm_size']} members; step {s['step']}, "
        f"{s['samples']} samples, {s['samples_per_s']:.1f} samples/s"
        + (f", eval loss {s['evals'][-1][1]:.4f} after step {s['evals'][-1][0]}"
           if s["evals"] else "")
        + (", run done" if s["done"] else ""),
        "security: "
        + (
            "protected (mutual TLS, the swarm's certificate)"
            if s["security"] == "mtls"
            else "open (anyone who can reach a node may join)"
        ),
    ]
    if s["relays"]:
        lines.append("relays offered: " + ", ".join(
            f"{r['node_id']} at {r['address']}" for r in s["relays"]))  # fmt: skip
    for m in s["members"]:
        where = (
            f"pipeline {m['pipeline']} stage {m['stage']} blocks [{m['blocks'][0]}, "
            f"{m['blocks'][1]})"
            if m["blocks"]
            else ("spare (no stage)" if s["plan_epoch"] else "no stage")
        )
        answer = f"version {m['version']}" if m["reachable"] else f"no answer ({m['error']})"
        if m["uplink_bps"]:
            answer += f", link {rate_text(m['uplink_bps'])}, {m['rtt_s'] * 1e3:.1f} ms"
        if m.get("device"):
            answer += f", on {m['device']}"
        if m["relay"]:
            answer += f", reached through relay {m['relay']}"
        if m["checkpoint_step"]:
            answer += f", checkpoint at step {m['checkpoint_step']}"
        if m["left"]:
            answer += ", left the swarm"
        elif m["lease_expired"]:
            answer += f", lease expired (silent {m['silent_s']:.0f} s)"
        lines.append(f"  {m['node_id']} {m['address']}: {where}, speed {m['speed']:.2f}, {answer}")
        lines += [
            f"    link to {p['node_id']}: {rate_text(p['to_bps'])} there, "
            f"{rate_text(p['from_bps'])} back, {p['rtt_s'] * 1e3:.1f} ms"
            for p in m["links"]
        ]
    return "\n".join(lines)


async def _find_swarm(
    swarm: str,
    peers: Sequence[str],
    interface: str | None,
    timeout_s: float,
    transport: TransportConfig,
) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        mdns = await stack.enter_async_context(
            MdnsDiscovery(swarm=swarm, protocol=PROTOCOL, interface=interface)
        )
        browsing = asyncio.create_task(mdns.run())
        stack.callback(browsing.cancel)
        found = await locate_coordinator(
            swarm=swarm,
            discovery=mdns,
            peers=peers,
            ask=grpc_status_asker(transport),
            timeout_s=timeout_s,
        )
    try:
        view = await _swarm_view(found.address, timeout_s, transport)
    except grpc.aio.AioRpcError as exc:
        raise PeerError(
            f"coordinator {found.address}: {exc.code().name}: {exc.details()}"
        ) from None
    statuses = await asyncio.gather(
        *(_member_status(m.address, timeout_s, transport) for m in view.members)
    )
    security = "open" if transport.credentials is None else "mtls"
    return swarm_dict(swarm, found, view, statuses, security)


def run_swarm_status(
    swarm: str,
    *,
    peers: Sequence[str],
    interface: str | None,
    as_json: bool,
    timeout_s: float,
    transport: TransportConfig | None = None,
) -> int:
    """Print the swarm's status; exit status 0, 1 if it cannot be found, 2 for bad settings."""
    transport = transport or TransportConfig()
    try:
        for peer in peers:
            split_host_port(peer)
        shown = asyncio.run(_find_swarm(swarm, peers, interface, timeout_s, transport))
    except (ConfigError, StartupError) as exc:
        print(f"ravnest-node: error: {exc}", file=sys.stderr)
        return 2
    except PeerError as exc:
        print(f"ravnest-node: status: swarm {swarm!r} not found: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(shown) if as_json else describe_swarm(shown))
    return 0


def watch(show: Callable[[], int], every_s: float, header: TextIO = sys.stdout) -> int:
    """`status --watch`: call `show` (which prints) every `every_s` seconds until SIGINT or
    SIGTERM (exit status 0), each time after a header line on `header` (stderr for --json, so
    that stdout stays one JSON object per line); on a terminal the screen is cleared first, so
    the view redraws in place. A view the node does not answer (it stopped) prints its error
    and the next one is tried; bad settings (exit status 2) end it at once. The signal only sets
    a flag: raised as KeyboardInterrupt inside a gRPC call it can leave the process hanging at
    exit."""
    clear = "\x1b[H\x1b[2J" if header is sys.stdout and header.isatty() else ""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in WATCH_STOP_SIGNALS}
    try:
        while not stop.is_set():
            header.write(clear + f"{time.strftime('%H:%M:%S')}, every {every_s:g} s "
                         "(Ctrl-C to stop)\n")  # fmt: skip
            header.flush()
            if show() == 2:
                return 2
            sys.stdout.flush()
            stop.wait(every_s)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
