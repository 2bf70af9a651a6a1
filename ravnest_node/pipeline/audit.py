"""Audited computation (issue #35, docs/security.md): a stage recomputes a sampled share of
what its neighbours send it and compares. Pure torch; the worker fetches records and reports.

**What is audited.** A stage receives activations from its upstream and gradients of its
input from its downstream. One in every `round(1 / audit_share)` of each kind (`AuditDraw`;
the place within each window drawn by this node, after the frame came) is audited: the
receiver asks the sender for its **record** of that microbatch (`AuditRecord`: the input it
took, the token ids and targets where its blocks need them, the gradient its backward
started from, and the weight snapshot its forward used: the very tensors, kept by the sender
for its last step's worth of microbatches, `AuditRecords`), rebuilds the sender's blocks from
the run's model and seed, runs them on the record with those weights (`recompute`, float32
on the CPU, off the compute thread) and compares the result with what it received
(`distance`). The records cost the sender at most one weight snapshot more than its stash
holds; the planner counts it.

**The tolerance.** Honest recomputations land within 5e-3 of each other whatever the thread
count, device and precision (bf16 against fp32, GPU against CPU; docs/benchmarks.md), and a
frame's codec adds its own error (the largest distance an honest audit passed with is in
each stage's metrics, `audit_max_passed`; docs/benchmarks.md has it per codec); every lie of
pipeline/lies.py lands at 1.0 or more. `TOLERANCE` = 0.5 sits
between. Frames of `topk-ef` (1% of a gradient kept, the rest fed back later) are not
audited: one frame says nothing of the honest gradient (`auditable`).

**What a record proves and what it does not.** The sender names the weights and the input;
the receiver holds what was sent. A sender that lies about what it computed from its own
weights is caught; one that trains its weights wrong (stale or skipped updates) and
computes honestly from them is not (nothing checks an update against its gradients). A
sender cannot choose which of its frames are audited: it has sent them before the draw.

Nothing from the network is unpickled: a record is a safetensors file (tensors and string
metadata), read by safetensors, checked against the model's own names and shapes.
"""

from __future__ import annotations

import json
import random
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ravnest_node.compression import get_codec
from ravnest_node.errors import FrameError
from ravnest_node.models import BlockModel
from ravnest_node.models.base import Chain

__all__ = [
    "TOLERANCE",
    "AuditDraw",
    "AuditRecord",
    "AuditRecords",
    "StageBlocks",
    "auditable",
    "distance",
    "received_bytes",
    "received_tensor",
]

TOLERANCE = 0.5
"""The largest relative distance (||received - recomputed|| / ||recomputed||) an audit passes."""

UNAUDITED_CODECS = frozenset({"topk-ef"})

WEIGHT_CODEC = get_codec("int8-block")
"""How a record's weights travel: a quarter of their float32 bytes, an error of about 1% of
each block's largest value, which moves an honest recomputation far less than the tolerance
(the distances in docs/benchmarks.md were measured with it)."""


def auditable(codec: str) -> bool:
    """Whether a frame sent with `codec` can be audited (not `topk-ef`)."""
    return codec not in UNAUDITED_CODECS


_FORWARD, _BACKWARD = "forward", "backward"
_OPTIONAL = ("tokens", "targets", "grad_out")


class AuditDraw:
    """Which received frames of one kind from one neighbour are audited: one in each window
    of `window` frames, at a place drawn at random when the window begins (stratified: an
    audit every window, however the dice fall). `again` audits the next frame too (a
    failure is checked once more before it is reported)."""

    def __init__(self, share: float, rng: random.Random | None = None) -> None:
        self.window = 0 if share <= 0 else max(1, round(1 / share))
        self._rng = rng if rng is not None else random.SystemRandom()
        self._at = 0
        self._pick = 0
        self._again = False
        self.again_drawn = False
        """The last frame drawn was the check again (`again`), not the window's draw."""

    def draw(self) -> bool:
        """Whether the frame that just came is audited."""
        self.again_drawn = False
        if not self.window:
            return False
        if self._again:
            self._again, self.again_drawn = False, True
            return True
        if self._at == 0:
            self._pick = self._rng.randrange(self.window)
        chosen = self._at == self._pick
        self._at = (self._at + 1) % self.window
        return chosen

    def again(self) -> None:
        self._again = True


@dataclass(frozen=True, slots=True)
class AuditRecord:
    """What a stage computed one microbatch's output from: the forward's (its activation) or
    the backward's (the gradient of its input)."""

    backward: bool
    seq: int
    version: int
    """The weight version the forward used (the frame's `version`)."""
    first_block: int
    stop_block: int
    inputs: torch.Tensor
    weights: dict[str, torch.Tensor]
    """The snapshot the forward used, by the stage's parameter names ("i.name")."""
    tokens: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    """Last stage, backward: the loss's targets."""
    grad_out: torch.Tensor | None = None
    """Backward of a stage before the last: the gradient of its output it received."""
    packed: dict[str, tuple[tuple[int, ...], dict[str, int], torch.Tensor]] | None = None
    """A received record's weights as they came: name -> (shape, codec params, payload),
    decoded by `StageBlocks.recompute` once the shapes are checked against the model."""

    def to_bytes(self) -> bytes:
        """A safetensors file of the record (CPU tensors; metadata as strings). The weights
        go in WEIGHT_CODEC (int8-block: a quarter of their float32 bytes)."""
        tensors = {"inputs": self.inputs}
        for name in _OPTIONAL:
            t = getattr(self, name)
            if t is not None:
                tensors[name] = t
        # (Copies: a first stage's input is its token ids, one tensor that safetensors would
        # not save twice.)
        tensors = {k: v.detach().to("cpu").clone().contiguous() for k, v in tensors.items()}
        meta = {
            "kind": _BACKWARD if self.backward else _FORWARD, "seq": str(self.seq),
            "version": str(self.version), "first_block": str(self.first_block),
            "stop_block": str(self.stop_block),
        }  # fmt: skip
        for name, w in self.weights.items():
            params, payload = WEIGHT_CODEC.encode(w.detach(), None)
            tensors[f"w.{name}"] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            meta[f"w.{name}"] = json.dumps({"shape": list(w.shape), "params": params})
        return save_tensors(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> AuditRecord:
        """The record `to_bytes` made; FrameError if `data` is not one."""
        try:
            tensors = load_tensors(data)
            meta = _metadata(data)
            kind = meta["kind"]
            numbers = {k: int(meta[k]) for k in ("seq", "version", "first_block", "stop_block")}
        except (SafetensorError, KeyError, ValueError, TypeError) as exc:
            raise FrameError(f"audit record does not parse: {exc}") from None
        if kind not in (_FORWARD, _BACKWARD) or "inputs" not in tensors:
            raise FrameError("audit record: unknown kind or no inputs")
        unknown = set(tensors) - {"inputs", *_OPTIONAL} - {k for k in tensors if k[:2] == "w."}
        if unknown:
            raise FrameError(f"audit record: unknown tensors {sorted(unknown)[:4]}")
        packed = {}
        for key, payload in tensors.items():
            if key.startswith("w."):
                packed[key[2:]] = (*_weight_meta(meta.get(key)), payload)
        return cls(kind == _BACKWARD, numbers["seq"], numbers["version"],
                   numbers["first_block"], numbers["stop_block"], tensors["inputs"], {},
                   tokens=tensors.get("tokens"), targets=tensors.get("targets"),
                   grad_out=tensors.get("grad_out"), packed=packed)  # fmt: skip


def _weight_meta(text: str | None) -> tuple[tuple[int, ...], dict[str, int]]:
    """(shape, codec params) of a packed weight, from its metadata entry; FrameError if it is
    not one."""
    try:
        value = json.loads(text or "")
        shape = tuple(int(n) for n in value["shape"])
        params = {str(k): int(v) for k, v in value["params"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FrameError(f"audit record: a weight's metadata does not parse: {exc}") from None
    if len(shape) > 8 or any(n < 0 for n in shape) or len(params) > 6:
        raise FrameError("audit record: a weight's metadata is out of range")
    return shape, params


def _metadata(data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors file (its JSON header's __metadata__)."""
    if len(data) < 8:
        raise ValueError("too short")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, 100_000_000):
        raise ValueError("header length out of range")
    header: dict[str, Any] = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return {str(k): str(v) for k, v in meta.items()}


def received_bytes(tensor: torch.Tensor) -> bytes:
    """What an auditor received, for a report: one tensor "received", as float32."""
    return save_tensors({"received": tensor.detach().to("cpu", torch.float32).contiguous()})


def received_tensor(data: bytes) -> torch.Tensor:
    """The tensor of `received_bytes`; FrameError if `data` is not one."""
    try:
        tensors = load_tensors(data)
    except SafetensorError as exc:
        raise FrameError(f"received tensor does not parse: {exc}") from None
    if set(tensors) != {"received"}:
        raise FrameError("received tensor: expected exactly one tensor named 'received'")
    return tensors["received"]


def distance(received: torch.Tensor, recomputed: torch.Tensor) -> float:
    """||received - recomputed|| / ||recomputed|| (float32); inf if the shapes differ."""
    if received.shape != recomputed.shape:
        return float("inf")
    a, b = received.detach().float(), recomputed.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


class AuditRecords:
    """The records a stage keeps of its recent microbatches, for its neighbours' audits:
    those of the last `keep` microbatch sequence numbers of each kind. Written by the compute
    thread, read by the event loop (single dict operations)."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._records: dict[tuple[bool, int], AuditRecord] = {}
        self._order: dict[bool, deque[int]] = {False: deque(), True: deque()}

    def add(self, record: AuditRecord) -> None:
        self._records[record.backward, record.seq] = record
        order = self._order[record.backward]
        order.append(record.seq)
        while len(order) > self._keep:
            self._records.pop((record.backward, order.popleft()), None)

    def get(self, backward: bool, seq: int) -> AuditRecord | None:
        return self._records.get((backward, seq))

    def __len__(self) -> int:
        return len(self._records)


def _unpacked(record: AuditRecord, own: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """A received record's weights, decoded: each checked against the parameter of its name
    (its shape, and its payload's size for that shape) before anything is allocated."""
    assert record.packed is not None
    if set(record.packed) != set(own):
        raise FrameError("audit record: its weights are not the stage's parameters")
    weights = {}
    for name, (shape, params, payload) in record.packed.items():
        if shape != tuple(own[name].shape) or payload.dtype != torch.uint8:
            raise FrameError(f"audit record: weight {name!r} has the wrong shape or dtype")
        data = memoryview(payload.numpy().tobytes())
        weights[name] = WEIGHT_CODEC.decode(data, shape, torch.float32, params)
    return weights


class StageBlocks:
    """An auditor's copies of the blocks of the stages it audits (built once per range from
    the run's model and seed; their values are replaced by each record's weights)."""

    def __init__(self, model: BlockModel, seed: int, *, microbatches: int, loss_scale: float):
        self._model = model
        self._seed = seed
        self._microbatches = microbatches
        self._loss_scale = loss_scale
        self._built: dict[tuple[int, int], Chain] = {}

    def _chain(self, first: int, stop: int) -> Chain:
        key = (first, stop)
        if key not in self._built:
            try:
                self._model.check_range(first, stop)
            except ValueError as exc:
                raise FrameError(f"audit record: {exc}") from None
            self._built[key] = Chain(*self._model.build_stage(self._seed, first, stop))
        return self._built[key]

    def recompute(self, record: AuditRecord) -> torch.Tensor:
        """What the stage should have sent for `record`: its output (forward) or its input's
        gradient (backward), float32 on the CPU. FrameError if the record does not fit the
        model (names, shapes, what its kind needs)."""
        chain = self._chain(record.first_block, record.stop_block)
        own = dict(chain.named_parameters())
        weights = _unpacked(record, own) if record.packed is not None else record.weights
        if set(weights) != set(own):
            raise FrameError("audit record: its weights are not the stage's parameters")
        for name, p in own.items():
            w = weights[name]
            if w.shape != p.shape or not w.is_floating_point():
                raise FrameError(f"audit record: weight {name!r} has the wrong shape or dtype")
        weights = {k: v.float() for k, v in weights.items()}
        x = record.inputs.float() if record.inputs.is_floating_point() else record.inputs
        if not record.backward:
            with torch.no_grad():
                out: torch.Tensor = torch.func.functional_call(chain, weights, (x, record.tokens))
            return out.float()
        if not x.is_floating_point():
            raise FrameError("audit record: a backward record's input must be floating point")
        x = x.detach().requires_grad_(True)
        out = torch.func.functional_call(chain, weights, (x, record.tokens))
        if record.targets is not None:
            loss = self._model.loss(out, record.targets) / self._microbatches
            torch.autograd.backward(loss * self._loss_scale)
        elif record.grad_out is not None and record.grad_out.shape == out.shape:
            torch.autograd.backward(out, record.grad_out.to(out.dtype))
        else:
            raise FrameError("audit record: a backward record needs targets or grad_out")
        assert x.grad is not None
        return x.grad.float()
