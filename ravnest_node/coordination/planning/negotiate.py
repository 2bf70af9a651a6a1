"""From members and what they measured to a plan: the planner's inputs, and its answer as a
`pb.Plan`. Pure functions (the model is built once to count its parameters).

* **Speeds.** Each node sends the seconds of forward + backward of every block for one
  microbatch (`pb.Capabilities.block_s`). A node's speed is the fastest node's total over its
  own. Nodes on one machine (same host and device) share its hardware, so they share its best
  total: on one machine, nodes that start together slow each other's measurements down by up to
  2x. Machines alike measure a little differently every time, so totals within `SPEED_GROUP` of
  a faster machine count as that machine's speed: the same machines give the same plan, and
  only a real difference moves blocks.
* **Blocks.** The shape of the work over blocks is the model's own `block_costs()` (measured
  per-block times are noisier than their sum), scaled so that the blocks add up to the fastest
  node's measured total. A cut after block i carries its output for one microbatch.
* **Memory** a block needs: 16 bytes a parameter (weights, gradients, two Adam moments), 4 more
  per stashed weight version (`max_staleness`, and one more while stages audit their
  neighbours: pipeline/audit.py), and the block's output for every microbatch of
  a step, kept for the backward pass. An estimate: the planner keeps a stage within the
  smallest of its owners' memory by it.
* **Links.** Each node measures, after its first Join, its link to the coordinator
  (`Capabilities.uplink_bps` and `rtt_s`) and its links both ways to every member that joined
  before it on another host (`peer_links`, at most 16): every pair is measured once, by the
  later of the two. A measured pair is taken as measured, each direction on its own. A pair not
  measured gets the slower of the two uplinks and the longer round trip (a home PC's bottleneck
  is its own uplink); nodes on one host (neither behind a relay) talk through memory, and a
  node with no measurement at all (the coordinator's own) counts as `DEFAULT_LINK`.
  A node behind NAT opens its boundary streams itself, straight to a neighbour that is not
  (`dials_back`); between two such nodes the stream goes through the downstream's relay, whose
  uplink carries it in and out: that boundary gets at most half of each relay's uplink, shared
  by the nodes it relays. A boundary's bytes are scaled by the run's activation or gradient
  codec, whichever sends more (`wire_ratio`). `auto` counts as `int4-block`: on a link where
  it picks something more faithful, that codec's transfer fits in half the stage's compute
  (docs/compression.md), so with transfers overlapping compute the step is what int4 gives;
  counting it as fp32 left every slow-linked member spare (a 10 Mbit/s link: one node alone).
* **Spares.** The planner may leave members out (a node on a slow link that would slow every
  microbatch down), but only when that is `SPARE_GAIN` times faster than a plan that gives
  every member a stage: links are measured once, with noise, and a spare's compute is lost.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from ravnest_node.compression.auto import AUTO, AUTO_LADDER
from ravnest_node.compression.codecs import get_codec
from ravnest_node.coordination.planning.placement import (
    Block,
    Link,
    Links,
    NodeCaps,
    SwarmPlan,
    plan_swarm,
)
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.errors import ConfigError
from ravnest_node.models import BlockModel
from ravnest_node.models.base import shapes_only
from ravnest_node.proto import control_pb2 as pb
from ravnest_node.protocol import MAX_OFFERS, MAX_PEER_LINKS
from ravnest_node.state import valid_node_id
from ravnest_node.transport.options import split_host_port

__all__ = [
    "check_capabilities",
    "check_offers",
    "measured_links",
    "member_speeds",
    "model_blocks",
    "negotiated_plan",
    "node_speeds",
    "resume_point",
    "wire_ratio",
]

SPEED_GROUP = 1.3
DEFAULT_LINK = Link(bandwidth_bps=1e9, rtt_s=1e-3)
ADAM_BYTES_PER_PARAM = 16
STASH_BYTES_PER_PARAM = 4
MAX_PIPELINES = 1024  # a swarm has at most 1024 members
MAX_LINK_BPS = 1e13
MAX_RTT_S = 60.0
MIN_LINK_BPS = 1e3
SPARE_GAIN = 1.25


def wire_ratio(codec: str) -> float:
    """Bytes on the wire per byte of fp32 activation with `codec` (1.0 for `none`; `auto`
    as `int4-block`, what it sends on a link too slow to hide anything more faithful)."""
    if codec == AUTO:
        codec = AUTO_LADDER[-1]  # its most compact choice
    try:
        bits = getattr(get_codec(codec), "bits_per_element", None)
    except ConfigError:
        return 1.0
    if bits is None:
        return {"fp16": 0.5, "bf16": 0.5}.get(codec, 1.0)
    return min(1.0, float(bits) / 32)


def measured_links(
    members: Sequence[Member], capabilities: Sequence[pb.Capabilities], *codecs: str
) -> Links:
    """What the members measured, as the planner's links (see the module doc); `codecs`: the
    run's activation and gradient codecs (a boundary's slower direction counts)."""
    up, rtt, relay, host = {}, {}, {}, {}
    measured: dict[tuple[str, str], Link] = {}
    for m, c in zip(members, capabilities, strict=True):
        if c.uplink_bps > 0:
            up[m.node_id] = c.uplink_bps
        if c.rtt_s > 0:
            rtt[m.node_id] = c.rtt_s
        if c.relay_node_id:
            relay[m.node_id] = c.relay_node_id
        else:
            host[m.node_id] = split_host_port(m.address)[0]
        for peer in c.peer_links:
            measured[(m.node_id, peer.node_id)] = Link(peer.to_bps, peer.rtt_s)
            measured[(peer.node_id, m.node_id)] = Link(peer.from_bps, peer.rtt_s)

    load = Counter(relay.values())  # nodes relayed by each relay share its uplink

    def link(a: str, b: str) -> Link | None:
        # One end behind NAT: that end opens the stream, straight to the other (BoundaryBack
        # where it is downstream). Both: through the downstream's relay, in and out.
        relayed = [up.get(relay[n], DEFAULT_LINK.bandwidth_bps) / (2 * load[relay[n]])
                   for n in (a, b) if a in relay and b in relay]  # fmt: skip
        found = measured.get((a, b))
        if found is not None:
            return Link(min([found.bandwidth_bps, *relayed]), found.rtt_s)
        if a in host and host.get(a) == host.get(b):
            return None  # one machine: memory, not a network
        if not (relayed or a in up or b in up):
            return None
        rates = [up.get(a, DEFAULT_LINK.bandwidth_bps), up.get(b, DEFAULT_LINK.bandwidth_bps)]
        return Link(
            min(rates + relayed), max(rtt.get(a, 0.0), rtt.get(b, 0.0)) or DEFAULT_LINK.rtt_s
        )

    ids = [m.node_id for m in members]
    # (Without a measured uplink, a relay or a measured pair, no link is known: skip the
    # N^2 pairs, a million at 1,000 members.)
    pairs: dict[tuple[str, str], Link] = {}
    if up or relay or measured:
        pairs = {(a, b): found for a in ids for b in ids
                 if a != b and (found := link(a, b)) is not None}  # fmt: skip
    ratio = max(wire_ratio(c) for c in codecs) if codecs else 1.0
    return Links(default=DEFAULT_LINK, pairs=pairs, codec_ratio=ratio)


def check_capabilities(caps: pb.Capabilities, num_blocks: int) -> None:
    """Raise ConfigError unless `caps` has one finite, positive time per block, and at most
    MAX_OFFERS checkpoint offers, each of a non-empty range of the model's blocks."""
    if len(caps.block_s) != num_blocks:
        raise ConfigError(f"capabilities give {len(caps.block_s)} block times for {num_blocks}")
    if not all(math.isfinite(t) and t > 0 for t in caps.block_s):
        raise ConfigError("capabilities: every block time must be finite and > 0")
    if not (math.isfinite(caps.uplink_bps) and 0 <= caps.uplink_bps <= MAX_LINK_BPS):
        raise ConfigError(f"capabilities: uplink_bps must be 0 to {MAX_LINK_BPS:g}")
    if not (math.isfinite(caps.rtt_s) and 0 <= caps.rtt_s <= MAX_RTT_S):
        raise ConfigError(f"capabilities: rtt_s must be 0 to {MAX_RTT_S:g} seconds")
    if caps.relay_node_id and not valid_node_id(caps.relay_node_id):
        raise ConfigError("capabilities: relay_node_id is not a node id")
    if caps.relay_address:
        split_host_port(caps.relay_address)  # ConfigError if malformed
    if len(caps.peer_links) > MAX_PEER_LINKS:
        raise ConfigError(
            f"capabilities: {len(caps.peer_links)} peer links, at most {MAX_PEER_LINKS}"
        )
    if len({peer.node_id for peer in caps.peer_links}) != len(caps.peer_links):
        raise ConfigError("capabilities: two peer links to one node")
    for peer in caps.peer_links:
        if not valid_node_id(peer.node_id):
            raise ConfigError("capabilities: a peer link's node_id is not a node id")
        if not all(
            math.isfinite(r) and MIN_LINK_BPS <= r <= MAX_LINK_BPS
            for r in (peer.to_bps, peer.from_bps)
        ):
            raise ConfigError(
                f"capabilities: a peer link's rates must be {MIN_LINK_BPS:g} to "
                f"{MAX_LINK_BPS:g} bit/s"
            )
        if not (math.isfinite(peer.rtt_s) and 0 <= peer.rtt_s <= MAX_RTT_S):
            raise ConfigError(
                f"capabilities: a peer link's rtt_s must be 0 to {MAX_RTT_S:g} seconds"
            )
    check_offers(caps.checkpoints, num_blocks)


def check_offers(offers: Sequence[pb.CheckpointOffer], num_blocks: int) -> None:
    """Raise ConfigError unless there are at most MAX_OFFERS checkpoint offers, each of a
    non-empty range of the model's blocks."""
    if len(offers) > MAX_OFFERS:
        raise ConfigError(f"{len(offers)} checkpoints offered, at most {MAX_OFFERS}")
    for offer in offers:
        if not 0 <= offer.first_block < offer.stop_block <= num_blocks:
            raise ConfigError(f"checkpoint offer of blocks [{offer.first_block}, "
                              f"{offer.stop_block}): the model has {num_blocks}")  # fmt: skip
        if len(offer.run_key) > 64:
            raise ConfigError("checkpoint offer: run_key longer than 64 characters")
        if offer.stage >= num_blocks or offer.pipeline >= MAX_PIPELINES:
            raise ConfigError(f"checkpoint offer: stage {offer.stage} of pipeline "
                              f"{offer.pipeline} cannot exist")  # fmt: skip


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a run resumes from its members' checkpoints (`resume_point`)."""

    step: int
    """The step the first plan starts at (0: from the beginning)."""
    holders: list[pb.StageAssignment]
    """Who holds the blocks at `step`: the first plan's `previous` stages."""
    why: str
    """For the log: what was offered and what was chosen."""


def resume_point(
    members: Sequence[Member],
    offers: Mapping[str, Sequence[pb.CheckpointOffer]],
    *,
    run_key: str,
    num_blocks: int,
    steps: int,
) -> ResumePoint:
    """The newest step, below `steps`, at which the members' checkpoints of this run (`run_key`;
    `offers`: node id -> what it offered) together hold every block, and who holds them; step
    0 if there is none.

    Several holders of a block at that step (replicas) are all listed: a node that gains the
    block fetches it from one of its own pipeline when it can."""
    at: dict[int, list[tuple[Member, pb.CheckpointOffer]]] = {}
    other_run = past_end = 0
    for m in members:
        for offer in offers.get(m.node_id, ()):
            if offer.run_key != run_key:
                other_run += 1
            elif offer.step >= steps:
                past_end += 1
            elif offer.step > 0:
                at.setdefault(offer.step, []).append((m, offer))
    notes = []
    if other_run:
        notes.append(f"{other_run} checkpoint(s) of another run ignored")
    if past_end:
        notes.append(f"{past_end} checkpoint(s) at or past the run's {steps} steps ignored "
                     "(raise --steps to train on from them)")  # fmt: skip
    for step in sorted(at, reverse=True):
        covered = {b for _, o in at[step] for b in range(o.first_block, o.stop_block)}
        if len(covered) < num_blocks:
            continue
        holders = [
            pb.StageAssignment(index=o.stage, first_block=o.first_block, stop_block=o.stop_block,
                               node_id=m.node_id, address=m.address, pipeline=o.pipeline)
            for m, o in at[step]
        ]  # fmt: skip
        notes.insert(0, f"resuming at step {step} from {len(holders)} checkpoint(s)"
                        + (f", newest offered: {max(at)}" if max(at) > step else ""))  # fmt: skip
        return ResumePoint(step, holders, "; ".join(notes))
    if at:
        notes.insert(0, f"checkpoints at steps {sorted(at)[-5:]} hold only some of the "
                        f"{num_blocks} blocks at any one step: starting at step 0")  # fmt: skip
    return ResumePoint(0, [], "; ".join(notes))


def node_speeds(totals: Sequence[float], machines: Sequence[Hashable] | None = None) -> list[float]:
    """Relative speeds from measured totals (seconds): the fastest is 1.0. Nodes on one machine
    (equal `machines` keys: host and device) share its best total, since they share its
    hardware; a machine within `SPEED_GROUP` of the fastest machine of its group gets that
    machine's speed."""
    keys = list(machines) if machines is not None else list(range(len(totals)))
    best: dict[Hashable, float] = {}
    for key, total in zip(keys, totals, strict=True):
        best[key] = min(total, best.get(key, math.inf))
    ranked = sorted(best, key=lambda k: best[k])
    speed: dict[Hashable, float] = {}
    anchor = ranked[0]
    for key in ranked:
        if best[key] > best[anchor] * SPEED_GROUP:
            anchor = key
        speed[key] = best[ranked[0]] / best[anchor]
    return [speed[key] for key in keys]


def member_speeds(
    members: Sequence[Member], capabilities: Sequence[pb.Capabilities]
) -> list[float]:
    """`node_speeds` of members, a machine being a host and a device."""
    totals = [math.fsum(c.block_s) for c in capabilities]
    machines = [
        (split_host_port(m.address)[0], c.device)
        for m, c in zip(members, capabilities, strict=True)
    ]
    return node_speeds(totals, machines)


def model_blocks(model: BlockModel, run: pb.RunSpec, total_s: float) -> list[Block]:
    """The planner's blocks for `model` under `run`, adding up to `total_s` a microbatch."""
    microbatches = max(1, run.microbatches)
    microbatch = max(1, run.batch_size // microbatches)
    costs = model.block_costs()
    scale = total_s / (math.fsum(costs) or 1.0)
    # Audits keep a step's records, their weight snapshot one more beyond the stash (audit.py).
    audits = 1 if run.HasField("audit_share") and run.audit_share > 0 else 0
    per_param = ADAM_BYTES_PER_PARAM + STASH_BYTES_PER_PARAM * (run.max_staleness + audits)
    blocks = []
    for i, (cost, held) in enumerate(zip(costs, block_state_bytes(model, per_param), strict=True)):
        out = model.output_spec(i, microbatch).size_bytes
        blocks.append(Block(cost * scale, out, held + out * microbatches))
    return blocks


def block_state_bytes(model: BlockModel, per_param: int) -> list[int]:
    """Bytes each block of `model` holds besides activations: `per_param` for every trainable
    parameter, and the frozen tensors (a LoRA base: buffers, in whatever dtype the model keeps
    them) at their size. Counted on the meta device: nothing is allocated, and a pretrained
    model's weights are not read (the coordinator need not even have them)."""
    with shapes_only():
        built = model.build_blocks(seed=0)
    return [
        per_param * sum(p.numel() for p in b.parameters())
        + sum(t.numel() * t.element_size() for t in b.buffers())
        for b in built
    ]


def place(
    blocks: Sequence[Block], nodes: Sequence[NodeCaps], links: Links, *, pipelines: int, stages: int
) -> SwarmPlan:
    """The placement a swarm of `nodes` trains with: exactly `stages` stages per pipeline (fewer
    if fewer nodes are left: a shorter pipeline rather than no plan at all), or with `stages`
    0 every node in a stage, unless a plan with spares is `SPARE_GAIN` times faster. Raises
    ConfigError if no placement fits in memory."""
    every = min(len(nodes) // pipelines, len(blocks))
    placed = plan_swarm(blocks, nodes, links, pipelines=pipelines,
                        stages=min(stages, every) or None)  # fmt: skip
    if len(placed.stages) < every and not stages:
        try:
            full = plan_swarm(blocks, nodes, links, pipelines=pipelines, stages=every)
        except ConfigError:  # some node cannot hold any stage
            full = None
        if full is not None and placed.step_s * SPARE_GAIN >= full.step_s:
            placed = full
    return placed


def negotiated_plan(
    *,
    epoch: int,
    swarm_id: str,
    model: BlockModel,
    members: Sequence[Member],
    capabilities: Sequence[pb.Capabilities],
    run: pb.RunSpec,
) -> tuple[pb.Plan, SwarmPlan]:
    """`run.pipelines` pipelines over `members`, placed by the planner from their capabilities:
    every member owns a stage, unless a plan with spares is `SPARE_GAIN` times faster (see the
    module doc), or exactly `run.stages` stages when the run asks for a shape (fewer when
    fewer members are left). Raises ConfigError if no placement fits in memory."""
    pipelines = max(1, run.pipelines)
    if len(members) < pipelines:
        raise ConfigError(f"{len(members)} nodes cannot form {pipelines} pipelines")
    totals = [math.fsum(c.block_s) for c in capabilities]
    speeds = member_speeds(members, capabilities)
    nodes = [
        NodeCaps(m.node_id, speed, float(c.memory_bytes) if c.memory_bytes else math.inf)
        for m, c, speed in zip(members, capabilities, speeds, strict=True)
    ]
    blocks = model_blocks(model, run, min(totals))
    links = measured_links(members, capabilities, run.activation_codec, run.gradient_codec)
    placed = place(blocks, nodes, links, pipelines=pipelines, stages=run.stages)
    address = {m.node_id: m.address for m in members}
    relayed = {m.node_id for m, c in zip(members, capabilities, strict=True) if c.relay_node_id}
    inflating = {m.node_id for m, c in zip(members, capabilities, strict=True) if c.unpacks_deflate}
    klt = {m.node_id for m, c in zip(members, capabilities, strict=True) if c.decodes_klt}
    klt_coder = {m.node_id: c.klt_coder for m, c in zip(members, capabilities, strict=True)}
    stages = [
        pb.StageAssignment(
            pipeline=p,
            index=s,
            first_block=stage.first_block,
            stop_block=stage.stop_block,
            node_id=stage.owners[p],
            address=address[stage.owners[p]],
            relayed=stage.owners[p] in relayed,
            unpacks_deflate=stage.owners[p] in inflating,
            decodes_klt=stage.owners[p] in klt,
            klt_coder=klt_coder[stage.owners[p]],
        )
        for p in range(pipelines)
        for s, stage in enumerate(placed.stages)
    ]
    return pb.Plan(epoch=epoch, swarm_id=swarm_id, run=run, stages=stages), placed
