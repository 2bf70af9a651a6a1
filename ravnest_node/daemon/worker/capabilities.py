"""What a node measures of itself for the planner: per-block compute time and free memory.

Runs on the node's compute thread before the plan exists, on blocks built for measuring only
(their weights are thrown away). Each block's forward and backward for one microbatch is timed
a few times and the best kept, which is the least disturbed by other work on the machine.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ravnest_node.models import get_model
from ravnest_node.proto import control_pb2 as pb

REPEATS = 3
MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(meminfo: Path = MEMINFO) -> int:
    """Memory the kernel says is available for new work (MemAvailable), 0 if unknown."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def time_blocks(model_name: str, microbatch: int, repeats: int = REPEATS) -> list[float]:
    """Best-of-`repeats` seconds of forward + backward of each block for one microbatch."""
    model = get_model(model_name)
    blocks = model.timing_blocks()
    spec = model.input_spec(microbatch)
    gen = torch.Generator().manual_seed(0)
    if spec.dtype.is_floating_point:
        x = torch.randn(spec.shape, generator=gen, dtype=spec.dtype)
    else:  # token ids
        x = torch.randint(0, model.vocab_size, spec.shape, generator=gen, dtype=spec.dtype)
    best = [float("inf")] * len(blocks)
    first = {id(b): blocks.index(b) for b in reversed(blocks)}  # a block listed again: timed once
    for _ in range(repeats):
        h = x
        for i, block in enumerate(blocks):
            if first[id(block)] != i:
                continue  # (its output has its input's shape: the chain carries on with h)
            inp = h.detach().requires_grad_(h.dtype.is_floating_point)
            started = time.perf_counter()
            out = block(inp)
            if out.requires_grad:  # (a frozen block fed token ids has no backward)
                out.backward(torch.ones_like(out))
            best[i] = min(best[i], time.perf_counter() - started)
            h = out.detach()
            block.zero_grad(set_to_none=True)
    return [best[first[id(b)]] for b in blocks]


def measure(
    model_name: str, microbatch: int, scale: float = 1.0, block_delay_s: float = 0.0
) -> pb.Capabilities:
    """This node's capabilities for `model_name` (`scale` multiplies the measured times and
    `block_delay_s` adds to each block's: a test's way to make one node look, or be, slower)."""
    block_s = [t * scale + block_delay_s for t in time_blocks(model_name, microbatch)]
    return pb.Capabilities(
        block_s=block_s, memory_bytes=available_memory_bytes(), device="cpu", unpacks_deflate=True
    )
