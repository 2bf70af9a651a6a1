"""What a node measures of itself for the planner: per-block compute time and free memory.

Runs on the node's compute thread before the plan exists, on blocks built for measuring only
(their weights are thrown away), on the node's device and in its compute precision, so that
the planner balances a swarm that mixes CPUs and GPUs by what each really does. Each block's
forward and backward for one microbatch is timed a few times after a warm-up pass (the first
pass on a GPU pays for kernel selection and allocation) and the best kept, which is the least
disturbed by other work on the machine. On a CUDA device the time is the GPU's own, from CUDA
events recorded around the block's work (torch.cuda.Event: the host returns before the kernels
finish, so a host clock would time the launches); on the CPU it is `time.perf_counter`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from ravnest_node import devices
from ravnest_node.compression.transform import CODER_COLUMNS
from ravnest_node.models import get_model
from ravnest_node.proto import control_pb2 as pb

REPEATS = 3
WARMUP = 1
"""Untimed passes before the timed ones."""


def available_memory_bytes() -> int:
    """The CPU's memory available for new work (MemAvailable), 0 if unknown."""
    return devices.available_memory_bytes(torch.device("cpu"))


Work = Callable[[], torch.Tensor]
Timer = Callable[[Work], tuple[torch.Tensor, float]]


def _timer(device: torch.device) -> Timer:
    """A function that runs its argument on `device`: its result and the seconds it took."""
    if device.type == "cuda":

        def timed_cuda(work: Work) -> tuple[torch.Tensor, float]:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            out = work()
            end.record()
            end.synchronize()
            return out, float(start.elapsed_time(end)) / 1e3  # elapsed_time is in milliseconds

        return timed_cuda

    def timed_host(work: Work) -> tuple[torch.Tensor, float]:
        started = time.perf_counter()
        out = work()
        devices.synchronize(device)  # (MPS: wait for the queued work; the CPU: nothing)
        return out, time.perf_counter() - started

    return timed_host


def _forward_backward(
    block: torch.nn.Module, inp: torch.Tensor, device: torch.device, precision: str
) -> torch.Tensor:
    with devices.autocast(device, precision):
        out: torch.Tensor = block(inp)
    if out.requires_grad:  # (a frozen block fed token ids has no backward)
        torch.autograd.backward(out, torch.ones_like(out))
    return out


def _input(model_name: str, microbatch: int, device: torch.device) -> torch.Tensor:
    model = get_model(model_name)
    spec = model.input_spec(microbatch)
    gen = torch.Generator().manual_seed(0)
    if spec.dtype.is_floating_point:
        x = torch.randn(spec.shape, generator=gen, dtype=spec.dtype)
    else:  # token ids
        x = torch.randint(0, model.vocab_size, spec.shape, generator=gen, dtype=spec.dtype)
    return x.to(device)


def time_blocks(
    model_name: str,
    microbatch: int,
    repeats: int = REPEATS,
    *,
    device: torch.device | None = None,
    precision: str = "fp32",
) -> list[float]:
    """Best-of-`repeats` seconds of forward + backward of each block for one microbatch, on
    `device` (the CPU if None) under autocast to the resolved `precision` (fp32, bf16, fp16).
    Blocks until the device has done the work."""
    device = torch.device("cpu") if device is None else device
    blocks = get_model(model_name).timing_blocks(device=device)
    first = {id(b): blocks.index(b) for b in reversed(blocks)}  # a block listed again: timed once
    x = _input(model_name, microbatch, device)
    timed = _timer(device)
    best = [float("inf")] * len(blocks)
    for attempt in range(WARMUP + repeats):
        h = x
        for i, block in enumerate(blocks):
            if first[id(block)] != i:
                continue  # (its output has its input's shape: the chain carries on with h)
            inp = h.detach().requires_grad_(h.dtype.is_floating_point)
            out, seconds = timed(
                functools.partial(_forward_backward, block, inp, device, precision)
            )
            if attempt >= WARMUP:
                best[i] = min(best[i], seconds)
            h = out.detach()
            block.zero_grad(set_to_none=True)
    return [best[first[id(b)]] for b in blocks]


def measure(
    model_name: str,
    microbatch: int,
    scale: float = 1.0,
    block_delay_s: float = 0.0,
    *,
    device: torch.device | None = None,
    precision: str = "fp32",
) -> pb.Capabilities:
    """This node's capabilities for `model_name` on `device` (the CPU if None) in the resolved
    `precision`: each block's seconds, and the memory free for new work there (the driver's
    free bytes on a GPU, MemAvailable on the CPU). `scale` multiplies the measured times and
    `block_delay_s` adds to each block's: a test's way to make one node look, or be, slower."""
    device = torch.device("cpu") if device is None else device
    times = time_blocks(model_name, microbatch, device=device, precision=precision)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the timing blocks' memory, cached by torch, is free again
    return pb.Capabilities(
        block_s=[t * scale + block_delay_s for t in times],
        memory_bytes=devices.available_memory_bytes(device),
        device=str(device),
        unpacks_deflate=True,
        decodes_klt=True,
        klt_coder=CODER_COLUMNS,
    )
