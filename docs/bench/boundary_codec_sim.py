"""One-process simulation of codecs at bench-small's stage boundaries, to study their cost on loss.

bench-small is cut into the pipeline's three stages and trained synchronously for STEPS steps of
16 samples in 4 microbatches (AdamW lr 3e-4, seed 0), as `ravnest-node bench codecs` trains it
on three node processes; the activation each boundary carries forward goes through the real
blockwise codec (`BlockQuant.quantise` / `dequantise`, round to nearest), its gradient back
through the same codec with stochastic rounding, which is what the frames would carry. At the
end the final weights are evaluated on 8 batches that training never drew.

    FWD=4 BWD=2 python docs/bench/boundary_codec_sim.py [STEPS]

FWD, BWD: none, 8, 4 or 2 (2 bits: ternary codes, the ones aq-delta2 sends); BLOCK=64 elements
per scale. With FWD=none BWD=none it reproduces the three-process run's losses (mean of the last
5 steps 2.8911 after 40 steps); FWD=4 BWD=4 gives 2.8951 (+0.14%; the processes: +0.17%).
"""

import itertools
import os
import sys
from typing import Any

import torch
from sim_report import report

from ravnest_node.compression.quant import BlockQuant
from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models.base import get_model

torch.set_num_threads(1)
env = os.environ.get
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
block = int(env("BLOCK", "64"))


def codec(bits: str, stochastic: bool) -> BlockQuant | None:
    return None if bits == "none" else BlockQuant("sim", int(bits), block, stochastic)


forward_codec, backward_codec = codec(env("FWD", "none"), False), codec(env("BWD", "none"), True)
generator = torch.Generator().manual_seed(1)


def through(c: BlockQuant | None, x: torch.Tensor) -> torch.Tensor:
    """`x` as the receiver decodes it after `c` encoded it."""
    if c is None:
        return x
    flat = x.detach().reshape(-1).float()
    scales, codes = c.quantise(flat, generator if c.stochastic else None)
    return c.dequantise(scales, codes)[: flat.numel()].view_as(x).to(x.dtype)


class Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return through(forward_codec, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return through(backward_codec, grad)


model = get_model("bench-small")
blocks = model.build_blocks(0)
stages = [torch.nn.Sequential(*blocks[a:b]) for a, b in itertools.pairwise([0, 3, 5, 8])]
opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=3e-4, weight_decay=0.01)
data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=0)
losses = []
for step in range(steps):
    x, y = data.batch(step, 16)
    step_loss = 0.0
    for mb in range(4):
        h = x[mb * 4 : (mb + 1) * 4]
        for i, stage in enumerate(stages):
            h = stage(h)
            if i < len(stages) - 1:
                h = Boundary.apply(h)
        loss = model.loss(h, y[mb * 4 : (mb + 1) * 4]) / 4
        loss.backward()
        step_loss += loss.item()
    opt.step()
    opt.zero_grad()
    losses.append(step_loss)

report(stages, model, data, losses)
