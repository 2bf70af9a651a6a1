"""Moving blocks between plans: a block's weights and AdamW moments, out of one stage and into
another, over `Node.FetchBlock`, in chunks.

When a plan ends at step S (docs/discovery.md, "Re-planning"), every node keeps the blocks it
trained, as they were after step S, and serves them to the members of the next plan. A node
that gains a block fetches it from the node that held it; a block it keeps stays local. What
arrives is checked against the block the receiver built for itself (every parameter present,
named and shaped as expected, float32, the right number of bytes) before anything is copied:
a wrong message is refused whole and changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from ravnest_node.blocks import DTYPE, ROLES, BlockWeights, block_shapes, check_block
from ravnest_node.errors import PeerRefused
from ravnest_node.proto import control_pb2 as pb

CHUNK_BYTES = 1 << 20
"""Data per `BlockChunk`: a block of any size moves in messages far below gRPC's limits."""


def to_chunks(weights: BlockWeights, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.BlockChunk]:
    """A block as `Node.FetchBlock` sends it: each tensor's little-endian float32 values in
    chunks of at most `chunk_bytes` (call it in a worker thread: it converts as it goes)."""
    per_chunk = max(1, chunk_bytes // 4)
    for (role, name), t in weights.tensors.items():
        values = t.detach().cpu().contiguous().view(-1).numpy().astype("<f4", copy=False)
        for offset in range(0, values.size, per_chunk):
            yield pb.BlockChunk(
                block=weights.block,
                version=weights.version,
                optimizer_step=weights.optimizer_step,
                name=name,
                role=role,
                dtype=DTYPE,
                shape=list(t.shape),
                offset=offset,
                data=values[offset : offset + per_chunk].tobytes(),
            )


class BlockAssembler:
    """Puts a fetched block together from its chunks, checking each against the receiver's own
    copy of the block (`block`, freshly built) and the step the plan starts at before anything
    is copied: PeerRefused naming `source` and what is wrong otherwise. Memory is allocated
    for the receiver's own parameter shapes only, never for what a chunk claims."""

    def __init__(self, *, block: torch.nn.Module, index: int, version: int, source: str) -> None:
        self._shapes = block_shapes(block)
        self._index, self._version, self._source = index, version, source
        self._optimizer_step: float | None = None
        self._values: dict[tuple[str, str], np.ndarray] = {}
        self._filled: dict[tuple[str, str], int] = {}

    def _refuse(self, what: str) -> PeerRefused:
        return PeerRefused(f"block {self._index} from {self._source}: {what}")

    @property
    def progress(self) -> tuple[int, int]:
        """(bytes received, bytes the whole block takes: its parameters and AdamW moments)."""
        total = sum(int(np.prod(s, dtype=np.int64)) for s in self._shapes.values())
        return 4 * sum(self._filled.values()), 4 * len(ROLES) * total

    def add(self, chunk: pb.BlockChunk) -> None:
        refuse = self._refuse
        if chunk.block != self._index:
            raise refuse(f"it is block {chunk.block}")
        if chunk.version != self._version:
            raise refuse(f"it is at step {chunk.version}, the plan starts at {self._version}")
        if self._optimizer_step is None:
            self._optimizer_step = chunk.optimizer_step
        elif chunk.optimizer_step != self._optimizer_step and not (
            math.isnan(chunk.optimizer_step) and math.isnan(self._optimizer_step)
        ):
            raise refuse("its chunks disagree on the optimizer step")
        key = (chunk.role, chunk.name)
        if chunk.role not in ROLES or chunk.name not in self._shapes:
            raise refuse(f"unknown tensor {chunk.role[:20]} {chunk.name[:80]!r}")
        shape = self._shapes[chunk.name]
        if chunk.dtype != DTYPE:
            raise refuse(f"{chunk.role} {chunk.name} is {chunk.dtype[:20]!r}, not {DTYPE}")
        if tuple(chunk.shape) != shape:
            raise refuse(f"{chunk.role} {chunk.name} has shape {list(chunk.shape)[:8]}, not "
                         f"{list(shape)}")  # fmt: skip
        numel = int(np.prod(shape, dtype=np.int64))
        filled = self._filled.get(key, 0)
        if filled == numel and key in self._values:
            raise refuse(f"{chunk.role} {chunk.name} twice")
        if chunk.offset != filled:
            raise refuse(f"{chunk.role} {chunk.name}: a chunk at element {chunk.offset}, "
                         f"expected {filled}")  # fmt: skip
        count, rest = divmod(len(chunk.data), 4)
        if count == 0 or rest:
            raise refuse(f"{chunk.role} {chunk.name}: a chunk of {len(chunk.data)} bytes")
        if filled + count > numel:
            raise refuse(f"{chunk.role} {chunk.name}: {filled + count} values, not {numel}")
        if key not in self._values:
            self._values[key] = np.empty(numel, dtype=np.float32)
        self._values[key][filled : filled + count] = np.frombuffer(chunk.data, dtype="<f4")
        self._filled[key] = filled + count

    def finish(self) -> BlockWeights:
        """The block, once every chunk has arrived and passed `check_block`."""
        tensors: dict[tuple[str, str], torch.Tensor] = {}
        for (role, name), values in self._values.items():
            if self._filled[(role, name)] != values.size:
                raise self._refuse(f"{role} {name} has {self._filled[(role, name)]} of "
                                   f"{values.size} values")  # fmt: skip
            tensors[(role, name)] = torch.from_numpy(values).reshape(self._shapes[name])
        return check_block(
            tensors, shapes=self._shapes, index=self._index, version=self._version,
            optimizer_step=self._optimizer_step or 0.0, refuse=self._refuse,
        )  # fmt: skip


def from_chunks(
    chunks: Iterable[pb.BlockChunk], *, block: torch.nn.Module, index: int, version: int,
    source: str,
) -> BlockWeights:  # fmt: skip
    """`BlockAssembler` over chunks at hand (tests, and what a peer sent in one go)."""
    assembler = BlockAssembler(block=block, index=index, version=version, source=source)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()
