"""`ravnest-node status HOST:PORT`: what one running node says about itself (`Node.Status`).

Shows its role and swarm, the coordinator it follows and how it found it (given by --join,
over mDNS, or through a bootstrap peer), the mDNS records it sees, its stage and counters.
`--json` prints the same as one JSON object for tools.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import grpc

from ravnest_node.errors import ConfigError
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.proto import control_pb2_grpc as pb_grpc
from ravnest_node.transport.options import split_host_port

_ENUMS = {"role": ("NODE_ROLE_", pb.NodeRole), "coordinator_found_via": ("FOUND_VIA_", pb.FoundVia)}


def status_dict(status: pb.NodeStatus) -> dict[str, Any]:
    """Every field of `status`, enums as lower-case words ("worker", "mdns", "" if unset)."""
    out: dict[str, Any] = {}
    for field in status.DESCRIPTOR.fields:
        value = getattr(status, field.name)
        if field.name in _ENUMS:
            prefix, enum = _ENUMS[field.name]
            value = "" if value == 0 else enum.Name(value).removeprefix(prefix).lower()
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
    if s["stage"] < 0:
        lines.append("stage: none yet")
    else:
        done = ", run done" if s["run_done"] else ""
        lines.append(
            f"stage {s['stage']}: blocks [{s['first_block']}, {s['stop_block']}), plan epoch "
            f"{s['plan_epoch']}, weight version {s['version']}, "
            f"{s['microbatches_in_flight']} microbatches in flight{done}"
        )
    lines.append(
        f"frames accepted {s['frames_accepted']}, refused {s['frames_refused']}; "
        f"bytes sent {s['bytes_sent']}"
    )
    return "\n".join(lines)


def run_status(address: str, *, as_json: bool, timeout_s: float) -> int:
    """Print the node's status; exit status 0, 1 if it does not answer, 2 for a bad address."""
    try:
        split_host_port(address)
    except ConfigError as exc:
        print(f"ravnest-node: error: {exc}", file=sys.stderr)
        return 2
    try:
        with grpc.insecure_channel(address) as channel:
            status: pb.NodeStatus = pb_grpc.NodeStub(channel).Status(
                pb.StatusRequest(), timeout=timeout_s
            )
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "UNAVAILABLE"
        print(f"ravnest-node: status: no answer from {address} ({code})", file=sys.stderr)
        return 1
    print(json.dumps(status_dict(status)) if as_json else describe(status))
    return 0
