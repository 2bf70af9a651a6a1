"""What a swarm would do before it exists: memory per node, bytes per link, samples/s. Pure.

`ravnest-node plan` and `bench plan-check` ask this module; the answer comes from the planner
itself (`placement.plan_swarm`): the model becomes the planner's `Block`s, the nodes its
`NodeCaps`, the link its `Links`, and the planner's cut, memory check and seconds per
microbatch are the prediction. What is added here is what the planner takes as given:

* **Blocks from a shape** (shapes.py). Per block: parameters, forward FLOPs per sample, the
  activation that crosses a cut after it, and the activations autograd keeps for the backward
  pass, computed from a published shape or measured on a registered model.
* **Time.** A microbatch costs ``forward FLOPs x (3 full | 2 LoRA, + 1 with recomputation)``
  at the node's effective FLOP/s (for a GPU: its dense bf16 peak times an assumed MFU; for this
  machine's CPU: calibrated by timing a block), plus a fixed cost per block and the AdamW step
  spread over the step's microbatches. A node's `speed` is its FLOP/s over the fastest's.
* **Memory** a block needs on its node: weights (full: 16 B a parameter for weights, gradients
  and AdamW moments, plus one weight copy per unit of staleness; LoRA: the frozen base in
  fp32/bf16/int8/nf4 and 16 B per adapter parameter; one more weight copy for the snapshot
  audit records keep; embedding tables and vectors stay
  fp32), and the activations of every microbatch in
  flight, ``(max_staleness + 1) x microbatches`` (stage.py's bound), or only each block's input
  when the backward recomputes the forward. The last block (head and loss) keeps its
  activations for one microbatch only: the last stage runs forward, loss and backward at once.
  Each node keeps `margin` of its memory free, less a fixed reserve (a CUDA context).
* **Links.** Each codec's payload for a boundary tensor is asked of the codec itself
  (`payload_nbytes`), never assumed; the planner scales the link time by it. `auto` chooses
  per link as the running swarm would (`compression.auto.choose_codec`).
* **A shared host.** Nodes on one machine (the local swarm of `demo`) share its cores: a step
  cannot take less than the total compute over the cores (`SharedHost`).

Everything is a prediction for the steady state of the asynchronous pipeline, where transfers
overlap compute: a pipeline moves one microbatch per max(slowest stage, slowest link).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ravnest_node.compression.auto import AUTO_LADDER, choose_codec
from ravnest_node.compression.codecs import encoder
from ravnest_node.coordination.planning.negotiate import (
    ADAM_BYTES_PER_PARAM,
    STASH_BYTES_PER_PARAM,
    place,
)
from ravnest_node.coordination.planning.placement import Block, Link, Links, NodeCaps, SwarmPlan
from ravnest_node.coordination.planning.shapes import BlockShape, ModelShape
from ravnest_node.errors import ConfigError
from ravnest_node.models.lora import nf4_bytes

__all__ = [
    "CODECS",
    "DoesNotFit",
    "Estimate",
    "NodeGroup",
    "SharedHost",
    "StageEstimate",
    "Training",
    "codec_bits",
    "estimate",
    "stage_memory",
]

CODECS: tuple[str, ...] = ("none", "fp16", "bf16", "int8-block", "int4-block")
"""The codecs the link table shows."""
BASE_BYTES = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "nf4": nf4_bytes(2**20) / 2**20}
"""Bytes a frozen base weight takes (int8 also keeps a float32 scale per output row; nf4 is
two codes a byte, an int8 scaler per 64 and a float32 factor per 256 scalers, as
models/lora.py stores them)."""
DEQUANTISE_BYTES = {"fp32": 0.0, "bf16": 0.0, "int8": 0.0, "nf4": 2.0}
"""Bytes of temporaries a weight takes while its base is dequantised, besides the dequantised
copy itself (nf4: its codes as int32 indices, one per byte)."""
ROW_SCALE_BYTES = 4
LORA_STATE_BYTES = ADAM_BYTES_PER_PARAM
"""An adapter parameter trains in fp32 like any other: weight, gradient, two AdamW moments."""
ADAMW_BYTES_MOVED = 28
"""Bytes an AdamW step reads and writes per parameter (fp32 weight r/w, gradient r, two moments
r/w): on a GPU the step is bound by memory bandwidth."""


class DoesNotFit(ConfigError):
    """No plan fits the nodes' memory; the message says by how much."""


Mode = Literal["full", "lora"]
Base = Literal["fp32", "bf16", "int8", "nf4"]
Recompute = Literal["auto", "off", "on"]


@dataclass(kw_only=True, frozen=True, slots=True)
class NodeGroup:
    """Nodes alike: how many, and what each can hold and compute."""

    count: int
    """Nodes in the group."""
    memory_bytes: float
    """Memory of each node (a GPU's, or the share of RAM a CPU node may use)."""
    flops_per_s: float
    """Effective FLOP/s of each node on this model's blocks (peak x MFU, or calibrated)."""
    label: str
    """What the group is, for people: "rtx4090", "24 GiB at 71 TFLOP/s"."""
    block_overhead_s: float = 0.0
    """Fixed seconds per block and microbatch beyond its FLOPs (calibrated on a CPU)."""
    optimizer_s_per_param: float = 0.0
    """Seconds of one AdamW step per trainable parameter."""
    reserve_bytes: float = 0.0
    """Memory the runtime takes before any block (a CUDA context and library workspaces)."""

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"node group {self.label}: count must be at least 1")
        if not (self.memory_bytes > 0 and math.isfinite(self.memory_bytes)):
            raise ConfigError(f"node group {self.label}: memory must be a positive size")
        if not (self.flops_per_s > 0 and math.isfinite(self.flops_per_s)):
            raise ConfigError(f"node group {self.label}: FLOP/s must be positive")


@dataclass(kw_only=True, frozen=True, slots=True)
class Training:
    """How the swarm would train."""

    mode: Mode = "full"
    """full: every parameter trains (AdamW); lora: adapters on every linear of every layer."""
    lora_rank: int = 16
    """Rank of each LoRA adapter."""
    base: Base = "bf16"
    """LoRA only: how the frozen base is stored (fp32, bf16, int8 or nf4)."""
    batch_size: int = 16
    """Samples per optimizer step (per pipeline)."""
    microbatches: int = 4
    """Microbatches a step is split into."""
    max_staleness: int = 1
    """Steps a stage may run ahead of its gradients (stage.py's bound)."""
    audits: bool = True
    """Stages audit their neighbours (the run's default --audit-share): one weight copy more
    per trainable parameter, the snapshot a step's audit records keep (pipeline/audit.py)."""
    pipelines: int = 1
    """Pipelines side by side, each with its own data; every stage's owners average."""
    stages: int = 0
    """Stages per pipeline: 0 lets the planner choose, as the swarm's does (it may leave nodes
    spare); N asks for exactly N."""
    recompute: Recompute = "auto"
    """Recompute the forward in the backward, keeping only each block's input: on, off, or
    auto (only when the activations would not fit otherwise)."""
    margin: float = 0.1
    """Share of each node's memory kept free (allocator fragmentation, estimate error)."""

    def __post_init__(self) -> None:
        if self.lora_rank < 1 or self.max_staleness < 0 or self.pipelines < 1 or self.stages < 0:
            raise ConfigError("lora rank and pipelines must be >= 1, max staleness and stages >= 0")
        if self.batch_size < 1 or self.microbatches < 1 or self.batch_size % self.microbatches:
            raise ConfigError(
                f"batch size {self.batch_size} must be a positive multiple of microbatches "
                f"({self.microbatches})"
            )
        if self.mode == "full" and self.base in ("int8", "nf4"):
            raise ConfigError(f"an {self.base} base is frozen: use it with --mode lora")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"margin {self.margin}: give a share of memory in [0, 1)")

    @property
    def microbatch(self) -> int:
        """Samples per microbatch."""
        return self.batch_size // self.microbatches

    @property
    def in_flight(self) -> int:
        """Microbatches a stage may hold at once: ``(max_staleness + 1) x microbatches``."""
        return (self.max_staleness + 1) * self.microbatches


@dataclass(frozen=True, slots=True)
class SharedHost:
    """Nodes that share one machine's cores (the local swarm of `demo`)."""

    cores: float
    """Cores the nodes share (less what other work takes); a step takes at least their total
    work over this."""
    stage_overhead_s: float = 0.0
    """Host seconds per microbatch and stage besides the blocks (frames, streams)."""


@dataclass(frozen=True, slots=True)
class StageEstimate:
    """One stage of the plan, in one pipeline."""

    first_block: int
    stop_block: int
    owners: tuple[str, ...]
    compute_s: float
    """Seconds per microbatch on its slowest owner."""
    send_s: float
    """Seconds per microbatch on the link after it (0 for the last)."""
    frame_bytes: int
    """Bytes of the activation it sends per microbatch before any codec (0 for the last)."""
    memory: dict[str, float]
    """Bytes on each owner: weights, trainable (gradients, optimizer, stash), activations,
    workspace, reserve, total, and the node's memory."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """The answer: a plan that fits, what it moves, how fast it trains."""

    model: ModelShape
    training: Training
    recompute: bool
    stages: tuple[StageEstimate, ...]
    codec: str
    """The codec of the prediction (the chosen one, or what `auto` picks)."""
    cut_for: str
    """The codec the stages were cut for: the chosen one, or for `auto` its most compact, as
    the swarm's planner counts it (the prediction is that plan's: `links[cut_for]`)."""
    auto_choices: tuple[str, ...]
    """What `auto` would pick on each boundary (activations; gradients alike)."""
    links: dict[str, dict[str, float]]
    """Per codec: bits per element, bytes per step on the busiest link each way, seconds of
    link per microbatch, and the samples/s and step of the plan cut for that codec."""
    step_s: float
    """Seconds per microbatch of each pipeline."""
    samples_per_s: float
    """Over all pipelines."""
    bottleneck: str
    spare: tuple[str, ...] = field(default=())

    @property
    def tokens_per_s(self) -> float:
        """Samples/s times tokens per sample."""
        return self.samples_per_s * self.model.tokens_per_sample


def codec_bits(codec: str, elements: int, dtype: torch.dtype) -> float:
    """Bits per element of a tensor of `elements` elements of `dtype` under `codec`, from the
    codec's own `payload_nbytes` (params from encoding a small tensor: block sizes and the like
    do not depend on the size)."""
    coder = encoder(codec, "activation")
    params, _ = coder.encode(torch.zeros(64, dtype=dtype), coder.new_state())
    return coder.payload_nbytes((elements,), dtype, params) * 8 / elements


def _flops_factor(training: Training, recompute: bool) -> float:
    """Forward passes' worth of FLOPs per microbatch: forward + backward (input and weight
    gradients for full, input gradients only for frozen LoRA bases), + one forward if the
    backward recomputes it."""
    return (3.0 if training.mode == "full" else 2.0) + (1.0 if recompute else 0.0)


def _block_memory(
    shape: ModelShape, block: BlockShape, t: Training, recompute: bool, previous: BlockShape | None
) -> dict[str, float]:
    """Bytes a block needs on its node, by kind."""
    mb, stash = t.microbatch, STASH_BYTES_PER_PARAM * (t.max_staleness + int(t.audits))
    if t.mode == "full":
        weights, trainable = 0.0, float(block.params * (ADAM_BYTES_PER_PARAM + stash))
    else:
        vectors = block.params - block.matrix_params
        weights = block.matrix_params * BASE_BYTES[t.base] + 4.0 * vectors
        if t.base == "int8":
            weights += ROW_SCALE_BYTES * block.matrix_rows
        trainable = float(t.lora_rank * block.adapter_dims * (LORA_STATE_BYTES + stash))
    act_bytes = shape.activation_dtype.itemsize
    if block.transient:  # with its own matrix expanded, if the layers' workspace is smaller
        activations = mb * block.saved_bytes
        if _dequantises(shape, t):
            activations += block.largest_matrix * (act_bytes + DEQUANTISE_BYTES[t.base])
    elif recompute:  # only the block's input is kept; the first block's is the token ids
        inp = previous.boundary_elements * act_bytes if previous else 8 * shape.tokens_per_sample
        activations = t.in_flight * mb * inp
    else:
        activations = t.in_flight * mb * block.saved_bytes
        if t.mode == "lora":  # each adapter's A x
            lora = shape.tokens_per_sample * t.lora_rank * block.adapted_linears * act_bytes
            activations += t.in_flight * mb * lora
    return {"weights": weights, "trainable": trainable, "activations": activations}


def _workspace(shape: ModelShape, t: Training, recompute: bool) -> float:
    """Bytes any node needs at once beyond its blocks: one microbatch's full activations of the
    largest block while it recomputes, and a dequantised copy of a layer's largest matrix for a
    LoRA base stored below the compute dtype (the head's is counted with the head)."""
    work = 0.0
    if recompute:
        work += max(t.microbatch * b.saved_bytes for b in shape.blocks if not b.transient)
    if _dequantises(shape, t):
        layers = [b.largest_matrix for b in shape.blocks if b.adapter_dims]
        itemsize = shape.activation_dtype.itemsize
        work += max(layers, default=0) * (itemsize + DEQUANTISE_BYTES[t.base])
    return work


def _dequantises(shape: ModelShape, t: Training) -> bool:
    """Whether a LoRA base is stored below the compute dtype (and expanded for each matmul)."""
    return t.mode == "lora" and BASE_BYTES[t.base] < shape.activation_dtype.itemsize


def _blocks(shape: ModelShape, t: Training, recompute: bool, speed_ref: NodeGroup) -> list[Block]:
    """The planner's blocks: seconds per microbatch on the reference node, bytes out, memory."""
    factor, mb = _flops_factor(t, recompute), t.microbatch
    out = []
    for i, b in enumerate(shape.blocks):
        trained = b.params if t.mode == "full" else t.lora_rank * b.adapter_dims
        flops = factor * b.forward_flops * mb
        if t.mode == "lora":  # the adapters: forward, and both gradients
            flops += 3 * 2 * shape.tokens_per_sample * t.lora_rank * b.adapter_dims * mb
        compute_s = (
            flops / speed_ref.flops_per_s
            + speed_ref.block_overhead_s
            + speed_ref.optimizer_s_per_param * trained / t.microbatches
        )
        memory = _block_memory(shape, b, t, recompute, shape.blocks[i - 1] if i else None)
        act = b.boundary_elements * mb * shape.activation_dtype.itemsize
        out.append(Block(compute_s, act, round(sum(memory.values()))))
    return out


def _nodes(groups: Sequence[NodeGroup], t: Training, work: float) -> dict[str, NodeCaps]:
    """The planner's nodes, n00, n01, ... group by group: speed relative to the fastest, and
    the memory left for blocks."""
    fastest = max(g.flops_per_s for g in groups)
    nodes: dict[str, NodeCaps] = {}
    for g in groups:
        usable = max(0.0, g.memory_bytes * (1 - t.margin) - g.reserve_bytes - work)
        for _ in range(g.count):
            node_id = f"n{len(nodes):02d}"
            nodes[node_id] = NodeCaps(node_id, g.flops_per_s / fastest, usable)
    return nodes


def estimate(
    shape: ModelShape,
    groups: Sequence[NodeGroup],
    link: Link,
    training: Training,
    *,
    codec: str = "auto",
    host: SharedHost | None = None,
) -> Estimate:
    """The fastest plan for `shape` on `groups` over `link` (the same link between every two
    nodes), with its memory, link traffic and samples/s. `codec` is the one the prediction uses
    (`auto`: what each link would choose). Raises ConfigError when no plan fits in memory,
    naming the shortfall, or for impossible settings."""
    if codec != "auto" and codec not in CODECS:
        raise ConfigError(f"codec {codec!r}: choose auto or one of {', '.join(CODECS)}")
    nodes = sum(g.count for g in groups)
    if not groups or nodes < training.pipelines:
        raise ConfigError(f"{nodes} nodes cannot form {training.pipelines} pipeline(s)")
    most = min(nodes // training.pipelines, len(shape.blocks))
    if training.stages > most:
        raise ConfigError(
            f"{training.stages} stages: {nodes} nodes in {training.pipelines} pipeline(s) of a "
            f"{len(shape.blocks)}-block model make at most {most}"
        )
    reference = max(groups, key=lambda g: g.flops_per_s)
    tries = {"off": [False], "on": [True], "auto": [False, True]}[training.recompute]
    for recompute in tries:
        try:
            return _estimate(shape, groups, link, training, codec, host, reference, recompute)
        except DoesNotFit:
            if recompute is tries[-1]:
                raise
    raise AssertionError("unreachable")


def _estimate(
    shape: ModelShape,
    groups: Sequence[NodeGroup],
    link: Link,
    t: Training,
    codec: str,
    host: SharedHost | None,
    reference: NodeGroup,
    recompute: bool,
) -> Estimate:
    """The estimate with or without `recompute`; DoesNotFit when no plan fits."""
    blocks = _blocks(shape, t, recompute, reference)
    work = _workspace(shape, t, recompute)
    caps = _nodes(groups, t, work)
    owners = [g for g in groups for _ in range(g.count)]
    group_of = dict(zip(caps, owners, strict=True))
    nodes = list(caps.values())
    elements = t.microbatch * max(b.boundary_elements for b in shape.blocks[:-1])
    dtype = shape.activation_dtype
    bits = {c: codec_bits(c, elements, dtype) for c in CODECS}
    plans = _plans(shape, blocks, nodes, link, bits, t, recompute, work)
    # The swarm's planner counts `auto` as its most compact codec (negotiate.wire_ratio): where
    # auto picks a more faithful one, that one's transfer hides behind compute.
    cut_for = codec if codec != "auto" else AUTO_LADDER[-1]
    choices = _auto_choices(plans[AUTO_LADDER[-1]], blocks, link, bits, dtype.itemsize)
    chosen = codec if codec != "auto" else max(choices, key=AUTO_LADDER.index, default="none")
    table = {c: _link_row(plans[c], blocks, bits[c], dtype.itemsize, t, host) for c in CODECS}
    plan = plans[cut_for]
    step_s, bottleneck = _step(plan, t, host)
    stages = tuple(
        StageEstimate(
            s.first_block,
            s.stop_block,
            s.owners,
            s.compute_s,
            s.send_s,
            blocks[s.stop_block - 1].activation_bytes if s.stop_block < len(blocks) else 0,
            _stage_memory(
                shape, t, recompute, s.first_block, s.stop_block, work, group_of[s.owners[0]]
            ),
        )
        for s in plan.stages
    )
    return Estimate(
        model=shape,
        training=t,
        recompute=recompute,
        stages=stages,
        codec=chosen,
        cut_for=cut_for,
        auto_choices=tuple(choices),
        links=table,
        step_s=step_s,
        samples_per_s=t.pipelines * t.microbatch / step_s,
        bottleneck=bottleneck,
        spare=plan.spare,
    )


def _plans(
    shape: ModelShape,
    blocks: Sequence[Block],
    nodes: Sequence[NodeCaps],
    link: Link,
    bits: dict[str, float],
    t: Training,
    recompute: bool,
    work: float,
) -> dict[str, SwarmPlan]:
    """The planner's plan for each codec of the link table, its link time scaled by the codec's
    `bits` per element; DoesNotFit, naming the shortfall, when the blocks fit no plan."""
    itemsize = shape.activation_dtype.itemsize
    plans: dict[str, SwarmPlan] = {}
    for c in CODECS:
        links = Links(default=link, codec_ratio=bits[c] / (8 * itemsize), in_flight=t.in_flight)
        try:
            plans[c] = place(blocks, nodes, links, pipelines=t.pipelines, stages=t.stages)
        except ConfigError:
            raise DoesNotFit(_shortfall(shape, blocks, nodes, t, recompute, work)) from None
    return plans


def _step(plan: SwarmPlan, t: Training, host: SharedHost | None) -> tuple[float, str]:
    """Seconds per microbatch and what sets them: the planner's, or on a shared host the
    larger of a stage's work and all stages' work over the cores."""
    if host is None:
        return plan.step_s, plan.bottleneck
    work = [s.compute_s + host.stage_overhead_s for s in plan.stages] * t.pipelines
    slowest = max(max(work), max(s.send_s for s in plan.stages))
    shared = sum(work) / min(host.cores, len(work))
    if shared >= slowest:
        return shared, f"the host's {host.cores:g} cores, shared by {len(work)} nodes"
    return slowest, plan.bottleneck


def _link_row(
    plan: SwarmPlan,
    blocks: Sequence[Block],
    bits: float,
    itemsize: int,
    t: Training,
    host: SharedHost | None,
) -> dict[str, float]:
    """One codec's row of the link table, for the plan cut with that codec."""
    step_s, _ = _step(plan, t, host)
    raw = max((blocks[s.stop_block - 1].activation_bytes for s in plan.stages[:-1]), default=0)
    return {
        "bits_per_element": bits,
        "bytes_per_step_each_way": raw * bits / (8 * itemsize) * t.microbatches,
        "link_s_per_microbatch": max((s.send_s for s in plan.stages), default=0.0),
        "samples_per_s": t.pipelines * t.microbatch / step_s,
        "stages": float(len(plan.stages)),
    }


def _auto_choices(
    plan: SwarmPlan, blocks: Sequence[Block], link: Link, bits: dict[str, float], itemsize: int
) -> list[str]:
    """What `auto` picks on each boundary of `plan`. Each direction is chosen by its sender
    from its own compute per microbatch; the faster of the two stages has the smaller budget,
    so its pick (the more compressed) is the one that counts."""
    picks = []
    for up, down in itertools.pairwise(plan.stages):
        elements = blocks[up.stop_block - 1].activation_bytes / itemsize
        sizes = [(c, round(elements * bits[c] / 8)) for c in AUTO_LADDER]
        compute_s = min(up.compute_s, down.compute_s)
        picks.append(choose_codec(sizes, bandwidth_bps=link.bandwidth_bps, compute_s=compute_s))
    return picks


def stage_memory(
    shape: ModelShape, t: Training, first: int, stop: int, *, recompute: bool = False
) -> dict[str, float]:
    """Bytes blocks ``[first, stop)`` of `shape` keep on their node, by kind (weights,
    trainable, activations), without the node's workspace and reserve: what bench/plan_check.py
    measures against a run."""
    parts = {"weights": 0.0, "trainable": 0.0, "activations": 0.0}
    for i in range(first, stop):
        previous = shape.blocks[i - 1] if i else None
        for key, value in _block_memory(shape, shape.blocks[i], t, recompute, previous).items():
            parts[key] += value
    return parts


def _stage_memory(
    shape: ModelShape,
    t: Training,
    recompute: bool,
    first: int,
    stop: int,
    work: float,
    group: NodeGroup,
) -> dict[str, float]:
    parts = stage_memory(shape, t, first, stop, recompute=recompute)
    parts["workspace"] = work
    parts["reserve"] = group.reserve_bytes
    parts["total"] = math.fsum(parts.values())
    parts["usable"] = group.memory_bytes * (1 - t.margin)
    parts["node"] = group.memory_bytes
    return parts


def _shortfall(
    shape: ModelShape,
    blocks: Sequence[Block],
    nodes: Sequence[NodeCaps],
    t: Training,
    recompute: bool,
    work: float,
) -> str:
    need = sum(b.memory_bytes for b in blocks)
    have = sum(n.memory_bytes for n in nodes)
    biggest, roomiest = max(b.memory_bytes for b in blocks), max(n.memory_bytes for n in nodes)
    what = "full fine-tuning" if t.mode == "full" else f"LoRA on a {t.base} base"
    what = f"does not fit: {shape.name} ({what}{', recomputing activations' * recompute})"
    gib = 2**30
    if need > have:
        return (
            f"{what} needs {need / gib:,.1f} GiB beyond each node's "
            f"reserve and margin, the {len(nodes)} nodes offer {have / gib:,.1f} GiB: short "
            f"by {(need - have) / gib:,.1f} GiB"
        )
    if biggest > roomiest:
        return (
            f"{what}: its largest block needs {biggest / gib:,.1f} GiB, the "
            f"roomiest node offers {roomiest / gib:,.1f} GiB: short by "
            f"{(biggest - roomiest) / gib:,.1f} GiB"
        )
    return (
        f"{what}: {need / gib:,.1f} GiB of blocks do not pack into "
        f"contiguous stages on {len(nodes)} nodes of {roomiest / gib:,.1f} GiB or less "
        f"(workspace {work / gib:.1f} GiB each)"
    )
