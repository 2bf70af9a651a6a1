"""One-process simulation of codecs at bench-small's stage boundaries, to study their cost on loss.

bench-small is cut into the pipeline's three stages and trained synchronously for STEPS steps of
16 samples in 4 microbatches (AdamW lr 3e-4, seed 0), as `ravnest-node bench codecs` trains it
on three node processes; the activation each boundary carries forward goes through the real
blockwise codec (`BlockQuant.quantise` / `dequantise`, round to nearest), its gradient back
through the same codec with stochastic rounding, which is what the frames would carry. At the
end the final weights are evaluated on 8 batches that training never drew.

    FWD=4 BWD=2 python docs/bench/boundary_codec_sim.py [STEPS]

FWD, BWD: none, 8, 4 or 2 (2 bits: ternary codes, the ones aq-delta2 sends); 3, 5 or 6: codes
-3..3, -2..2 or -1..1 in int4-block payloads (`BlockQuant.codes`, what `auto` sends gradients
with over a bottleneck link is 3); sub: the experimental transform codec of subspace_codec.py
(ALPHA, RANK, REFRESH, ITERS set it); klt: the klt codec (compression/transform.py) as a
sender uses it for the role, a stream per boundary and direction. BLOCK=64 elements per scale,
FBLOCK the activations' own (default BLOCK); SEED=0 the model's and the data's seed. Bits per
element are of the payloads packed with deflate (the subspace and klt codecs pack their own).
With FWD=none BWD=none it reproduces the three-process run's losses (mean of the last 5 steps
2.8911 after 40 steps); FWD=4 BWD=4 gives 2.8951 (+0.14%; the processes: +0.17%).
"""

import itertools
import os
import sys
import zlib
from typing import Any

import torch
from sim_klt import KLTStream
from sim_report import report
from subspace_codec import Subspace, SubspaceBases, SubspaceState

from ravnest_node.compression.quant import BlockQuant
from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models import get_model

torch.set_num_threads(1)
env = os.environ.get
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
block = int(env("BLOCK", "64"))
alpha, rank, refresh = float(env("ALPHA", "0.5")), int(env("RANK", "32")), int(env("REFRESH", "8"))


Coder = BlockQuant | KLTStream | tuple[Subspace, SubspaceState, SubspaceBases] | None


def codec(bits: str, stochastic: bool, block: int = block) -> Coder:
    if bits == "sub":
        sub = Subspace(alpha=alpha, rank=rank, refresh=refresh, stochastic=stochastic,
                       iterations=int(env("ITERS", "1")))  # fmt: skip
        return sub, sub.new_state(), SubspaceBases()
    if bits == "none":
        return None
    if bits == "klt":  # (towards a peer of coder 1, as when this simulation was written)
        return KLTStream.new("gradient" if stochastic else "activation", columns=False)
    coarse = {"3": 3, "5": 2, "6": 1}.get(bits, 0)  # codes -c..c in int4 payloads
    return BlockQuant("sim", 4 if coarse else int(bits), block, stochastic, codes=coarse)


# One coder per boundary (a stateful codec keeps a stream per boundary and direction).
forward_codecs = [codec(env("FWD", "none"), False, int(env("FBLOCK", str(block)))) for _ in "01"]
backward_codecs = [codec(env("BWD", "none"), True) for _ in "01"]
generator = torch.Generator().manual_seed(1)
wire_bits = {"fwd": 0.0, "bwd": 0.0}
elements = {"fwd": 0, "bwd": 0}


def through(c: Coder, x: torch.Tensor, way: str) -> torch.Tensor:
    """`x` as the receiver decodes it after `c` encoded it."""
    elements[way] += x.numel()
    if c is None:
        wire_bits[way] += 32 * x.numel()
        return x
    if isinstance(c, KLTStream):
        out, _, nbytes = c.through(x)
        wire_bits[way] += 8 * nbytes
        return out
    if isinstance(c, tuple):
        sub, state, bases = c
        params, payload = sub.encode(x, state)
        wire_bits[way] += 8 * len(payload)
        out, commit = sub.decode_with(bases, way, memoryview(payload), x.shape, x.dtype, params)
        commit()
        return out
    flat = x.detach().reshape(-1).float()
    scales, codes = c.quantise(flat, generator if c.stochastic else None)
    packer = zlib.compressobj(1, zlib.DEFLATED, -15)
    raw = c.pack(scales, codes)
    wire_bits[way] += 8 * len(packer.compress(raw) + packer.flush())
    return c.dequantise(scales, codes)[: flat.numel()].view_as(x).to(x.dtype)


class Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, i: int) -> torch.Tensor:
        ctx.i = i
        return through(forward_codecs[i], x, "fwd")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return through(backward_codecs[ctx.i], grad, "bwd"), None


model = get_model("bench-small")
seed = int(env("SEED", "0"))
blocks = model.build_blocks(seed)
stages = [torch.nn.Sequential(*blocks[a:b]) for a, b in itertools.pairwise([0, 3, 5, 8])]
opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=3e-4, weight_decay=0.01)
data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=seed)
losses = []
for step in range(steps):
    x, y = data.batch(step, 16)
    step_loss = 0.0
    for mb in range(4):
        h = x[mb * 4 : (mb + 1) * 4]
        for i, stage in enumerate(stages):
            h = stage(h)
            if i < len(stages) - 1:
                h = Boundary.apply(h, i)
        loss = model.loss(h, y[mb * 4 : (mb + 1) * 4]) / 4
        loss.backward()
        step_loss += loss.item()
    opt.step()
    opt.zero_grad()
    losses.append(step_loss)

report(stages, model, data, losses)
fwd, bwd = (wire_bits[w] / max(1, elements[w]) for w in ("fwd", "bwd"))
print(
    f"bits per element: activations {fwd:.2f}, gradients {bwd:.2f}, "
    f"both {(wire_bits['fwd'] + wire_bits['bwd']) / max(1, sum(elements.values())):.2f}"
)
