"""The block contract: how a model is presented to the swarm (registry.py finds one by name).

A swarm trains one model cut into contiguous *stages*; each node runs one stage. To be cut, a
model is written as an ordered list of *blocks* (`BlockModel.build_blocks`) with a relative
compute cost per block (`BlockModel.block_costs`) that the planner balances, and tensor specs that
say what crosses every possible cut (`BlockModel.output_spec`).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "BlockModel",
    "Chain",
    "TensorSpec",
    "build_seeded",
    "run_blocks",
    "shapes_only",
    "to_device",
]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Name, shape and dtype of a tensor that enters, leaves or crosses a model."""

    name: str
    """What the tensor is, e.g. "tokens", "hidden", "logits", "targets"."""
    shape: tuple[int, ...]
    """Full shape, batch dimension first."""
    dtype: torch.dtype
    """Element type."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def size_bytes(self) -> int:
        """Size of a dense tensor of this spec, in bytes."""
        return self.numel * self.dtype.itemsize


class BlockModel(ABC):
    """A model written as an ordered list of blocks, so that it can be cut into pipeline stages.

    The contract every implementation keeps, and that the pipeline relies on:

    * **One tensor in, one tensor out.** Block ``i``'s ``forward`` takes exactly one tensor, the
      output of block ``i - 1``; block 0 takes the input tensor (``input_spec``). Each block returns
      one tensor, of ``output_spec(i, batch)``. The last block returns the model output that
      ``loss`` consumes together with the targets (``target_spec``). Chaining all blocks
      (`run_blocks`) therefore *is* the model, and any cut between block ``i`` and ``i + 1`` is a
      valid stage boundary across which exactly one tensor travels forward (the activation) and one
      travels back (its gradient).
    * **Token ids, where the model carries them** (``carries_tokens``, models/subspace.py):
      every block is then called with ``(x, tokens)``, the input token ids (``input_spec``) as
      a second argument (block 0 gets them twice), and a forward frame carries them next to the
      activation; they are an input, never differentiated. Models that do not carry tokens
      keep one tensor in, one tensor out, with the same frames.
    * **No sharing.** Blocks share no parameters or buffers (no weight tying across blocks), so
      each stage owns and updates its parameters alone.
    * **No state between calls.** A block's output depends only on its input and its parameters:
      no caches, no running statistics, no dropout or other randomness, so that a forward pass can
      be recomputed and two nodes holding the same parameters compute the same thing.
    * **Deterministic construction.** ``build_blocks(seed)`` builds all blocks, in order, under
      ``torch.random.fork_rng`` with ``torch.manual_seed(seed)``: the same seed gives bit-identical
      parameters on every node, whichever blocks that node keeps, and the caller's global RNG
      state is left untouched.
    * **Costs.** ``block_costs()`` has one non-negative, finite entry per block: its relative
      compute cost per sample (e.g. forward FLOPs). Only ratios matter; the planner uses them to
      balance stages.

    Shapes are per batch: every ``*_spec(batch)`` method returns the full shape for a batch of
    ``batch`` samples.
    """

    name: str
    """Registry name of this model, e.g. ``"bench-small"``."""
    vocab_size: int = 256
    """Token ids fed to block 0 are below this (for a model whose input is token ids)."""
    carries_tokens: bool = False
    """Every block takes the input token ids as a second argument, and they cross every stage
    boundary (see the class docstring)."""

    @abstractmethod
    def build_blocks(self, seed: int) -> list[torch.nn.Module]:
        """Build all blocks in order, deterministically from `seed` (see the class docstring)."""

    @abstractmethod
    def num_blocks(self) -> int:
        """Number of blocks: ``len(build_blocks(seed))``, also ``len(block_costs())``."""

    @abstractmethod
    def block_costs(self) -> list[float]:
        """Relative compute cost of each block per sample (non-negative, finite)."""

    @abstractmethod
    def input_spec(self, batch: int) -> TensorSpec:
        """The tensor block 0 consumes."""

    @abstractmethod
    def output_spec(self, block: int, batch: int) -> TensorSpec:
        """The tensor block `block` returns; raises `ValueError` if `block` is out of range."""

    @abstractmethod
    def target_spec(self, batch: int) -> TensorSpec:
        """The targets that `loss` takes next to the last block's output."""

    @abstractmethod
    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scalar mean loss of the last block's `output` against `targets`."""

    def dataset(
        self, *, seed: int, shard: int = 0, num_shards: int = 1, num_samples: int = 0
    ) -> Any:
        """The training data of this model: an object with ``batch(step, batch_size) ->
        (inputs, targets)`` matching `input_spec` and `target_spec`, ``sample_ids(step,
        batch_size)``, ``num_samples`` and ``fingerprint`` (see `StdlibBytes`), a pure function
        of its arguments. Default: byte windows of the standard library's source."""
        from ravnest_node.data.stdlib_bytes import StdlibBytes

        return StdlibBytes(
            seq_len=self.input_spec(1).shape[1], seed=seed, shard=shard,
            num_shards=num_shards, num_samples=num_samples,
        )  # fmt: skip

    @property
    def held_out(self) -> bool:
        """Whether the model has held-out data to evaluate on (`eval_dataset`)."""
        return False

    def eval_dataset(self, *, seed: int) -> Any:
        """The held-out data, with `dataset`'s interface; None if the model has none."""
        return None

    def build_stage(
        self, seed: int, start: int, stop: int, *, device: torch.device | None = None
    ) -> list[torch.nn.Module]:
        """Blocks ``[start, stop)`` of ``build_blocks(seed)``, the parameters a stage owns, on
        `device` (default: where they are built, the CPU).

        All blocks are built so that the RNG stream, hence every parameter, is the same as on a
        node that keeps other blocks; they are moved to `device` one block at a time. Raises
        `ValueError` for an empty or out-of-range range.
        """
        self.check_range(start, stop)
        return [to_device(b, device) for b in self.build_blocks(seed)[start:stop]]

    def check_range(self, start: int, stop: int) -> None:
        """Raise `ValueError` unless ``[start, stop)`` is a non-empty range of the blocks."""
        n = self.num_blocks()
        if not 0 <= start < stop <= n:
            raise ValueError(
                f"stage range [{start}, {stop}) is not a non-empty range of the {n} blocks of "
                f"{self.name!r}; need 0 <= start < stop <= {n}"
            )

    def timing_blocks(self, *, device: torch.device | None = None) -> list[torch.nn.Module]:
        """All blocks, for timing their forward and backward (capabilities.py): the shapes and
        the trainable parts of the real ones, their values not needed, on `device` (default:
        the CPU). A module listed more than once (identical layers) is timed once; its output
        must have its input's shape."""
        return [to_device(b, device) for b in self.build_blocks(0)]

    def num_parameters(self) -> int:
        """Total number of parameters over all blocks."""
        return sum(p.numel() for block in self.build_blocks(0) for p in block.parameters())


class _NoInit(TorchFunctionMode):
    """`torch.nn.init` calls on meta tensors do nothing (see `shapes_only`)."""

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Blocks built within it are on the meta device, for their shapes and sizes: nothing is
    allocated, nothing initialised, no pretrained weight read. Arithmetic on a meta tensor
    (an initialiser's too: torch's meta kernels) imports torch's decompositions, sympy among
    them: 2 s the first time in a process, which once stalled a coordinator's event loop past
    its members' leases. So initialisers are skipped here, and the models do no arithmetic on
    a meta tensor (tests/test_models.py checks that building them here imports no sympy).
    Per thread (torch's function modes are)."""
    with torch.device("meta"), _NoInit():
        yield


def to_device(block: torch.nn.Module, device: torch.device | None) -> torch.nn.Module:
    """`block` moved to `device` (itself, unchanged, for None or where it already is)."""
    return block if device is None else block.to(device)


def build_seeded(
    seed: int,
    make: Callable[[int], torch.nn.Module],
    start: int,
    stop: int,
    device: torch.device | None = None,
) -> list[torch.nn.Module]:
    """Blocks ``make(start) .. make(stop - 1)``, the same as in a whole build: ``make(0),
    make(1), ...`` called in order after ``torch.manual_seed(seed)``; each block kept is moved
    to `device` as soon as it is made, those before `start` are made and dropped, those from
    `stop` on never made. So the host holds one block beyond those already moved, never the
    whole model. The caller's global RNG state is left untouched."""
    blocks = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for i in range(stop):
            block = make(i)
            if i >= start:
                blocks.append(to_device(block, device))
    return blocks


def run_blocks(
    blocks: Sequence[torch.nn.Module], x: torch.Tensor, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """Run `x` through `blocks` in order and return the last output (`x` itself if empty);
    each block is called with `tokens` as a second argument where given (`carries_tokens`)."""
    for block in blocks:
        x = block(x) if tokens is None else block(x, tokens)
    return x


class Chain(torch.nn.Sequential):
    """A stage's blocks in order (a `Sequential`: the same parameter names ``"i.name"``), whose
    forward passes the token ids on to every block where given (`run_blocks`)."""

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        return run_blocks(list(self), x, tokens)
