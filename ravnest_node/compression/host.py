"""Where an encoder's tensor work leaves the device, and where its rounding noise comes from.

Encoders do their tensor work (block scales, rounding, projections, state updates) on the
device of the tensor they are given, and move only their small results (codes, scales,
coefficients) to host memory, through `to_host`, just before the numpy byte packing. So a GPU
node sends int4 codes across PCIe, not float32 activations, and no encoder calls `.numpy()` on
a device tensor. By default `to_host` is `.cpu()` (on a CPU tensor: the tensor itself, no
copy); a caller that moves device tensors better installs its own `HostCopy` for the duration
of an encode with `copying_with` (pipeline/encoder.py: a side CUDA stream into pinned memory,
so the compute stream does not wait for the copies). The copier is a context variable, so it
holds for the calling thread only, and codecs need no extra argument for it.

Stochastic rounding draws its noise on the tensor's device from a private generator
(`random_generator`, `generator_on`). On the CPU the numbers are those of a CPU generator of
the same seed, as before this module; a CUDA generator of the same seed draws other numbers, so
a CUDA sender's codes differ from a CPU sender's in the rounding noise (allowed: both are
unbiased, and the decoder does not depend on the noise). Pure torch, no I/O.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch

HostCopy = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]
"""Returns CPU tensors holding the values of the given tensors (same shapes and dtypes), ready
to read when it returns; CPU tensors may come back as they are."""

_COPY: ContextVar[HostCopy | None] = ContextVar("ravnest_host_copy", default=None)


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """CPU tensors with the values of `tensors`, through the installed `HostCopy` if any, else
    `.cpu()`. Blocks until the values can be read."""
    copy = _COPY.get()
    if copy is not None:
        return copy(tensors)
    return [t.cpu() for t in tensors]


@contextmanager
def copying_with(copy: HostCopy) -> Iterator[None]:
    """Within the block, `to_host` on this thread (and its asyncio task) goes through `copy`."""
    token = _COPY.set(copy)
    try:
        yield
    finally:
        _COPY.reset(token)


def random_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on `device` with a seed from the OS: private, so drawing from it leaves the
    training's RNG alone."""
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(seed)


def generator_on(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """`generator` if it draws on `device`, else a new generator there with its initial seed
    (callers keep the result in their state, so the stream of numbers goes on from there)."""
    if generator.device == device:
        return generator
    return torch.Generator(device=device).manual_seed(generator.initial_seed())
