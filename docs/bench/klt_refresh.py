"""How often klt's sender should take and send a new basis: bytes and error of each boundary
stream under a refresh schedule, on bench-small's own boundary tensors.

bench-small is cut into the pipeline's three stages (blocks 0-2 | 3-4 | 5-7) and trained
synchronously for STEPS steps of 16 samples in 4 microbatches (AdamW lr 3e-4), keeping every
microbatch's two boundary activations and their gradients (the four streams a pipeline sends:
240 frames each after 60 steps). Each stream then goes through the klt codec exactly as a
sender uses it for its role, towards a peer that decodes columns (coder 2), and through the
decoder with the stream's bases; it prints each stream's bytes (all frames, and the first 80:
the 20 steps of the synchronous warm-up), its mean relative error ||x' - x|| / ||x||, and the
frames that carried a basis.

    EMA=0.9 RMAX=128 python docs/bench/klt_refresh.py [STEPS [SEED]]

EMA: the covariance average's weight of the old frames (compression/transform.py `EMA`);
RMAX: the most frames between two bases once the doubling reaches it (`REFRESH_MAX`). Both
default to the codec's own. Memory: about 8 MB a step kept (1.7 GB for 200 steps).
"""

import itertools
import os
import sys

import torch
from sim_klt import KLTStream

import ravnest_node.compression.transform as transform
from ravnest_node.compression.codecs import Role
from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models import get_model

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
transform.EMA = float(os.environ.get("EMA", transform.EMA))
transform.REFRESH_MAX = int(os.environ.get("RMAX", transform.REFRESH_MAX))
torch.manual_seed(seed)

model = get_model("bench-small")
blocks = model.build_blocks(seed)
cuts = [0, 3, 5, 8]
stages = [torch.nn.Sequential(*blocks[a:b]) for a, b in itertools.pairwise(cuts)]
opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=3e-4, weight_decay=0.01)
data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=seed)
streams: dict[tuple[Role, int], list[torch.Tensor]] = {
    (role, b): [] for role in ("activation", "gradient") for b in (0, 1)
}
for step in range(steps):
    x, y = data.batch(step, 16)
    for i in range(4):
        rows = slice(4 * i, 4 * i + 4)
        h0 = stages[0](x[rows])
        h0_in = h0.detach().requires_grad_(True)
        h1 = stages[1](h0_in)
        h1_in = h1.detach().requires_grad_(True)
        (model.loss(stages[2](h1_in), y[rows]) / 4).backward()
        h1.backward(h1_in.grad)
        h0.backward(h0_in.grad)
        for b, h in ((0, h0_in), (1, h1_in)):
            streams[("activation", b)].append(h.detach().clone())
            streams[("gradient", b)].append(h.grad.clone())
    opt.step()
    opt.zero_grad()

total, warm = 0, 0
print(f"{steps} steps, seed {seed}, EMA {transform.EMA}, REFRESH_MAX {transform.REFRESH_MAX}")
for (role, b), frames in streams.items():
    stream = KLTStream.new(role)
    sizes, errors, with_basis = [], [], []
    for i, t in enumerate(frames):
        value, params, nbytes = stream.through(t)
        sizes.append(nbytes)
        errors.append(float((value - t).norm() / t.norm()))
        if params["basis"] == 1:
            with_basis.append(i)
    total, warm = total + sum(sizes), warm + sum(sizes[:80])
    print(
        f"{role} {b}: {sum(sizes) / 1e3:.0f} KB (first 80 frames {sum(sizes[:80]) / 1e3:.0f}),"
        f" relative error {sum(errors) / len(errors):.4f}, bases with frames {with_basis}"
    )
print(f"all four streams: {total / 1e3:.0f} KB (first 80 frames of each: {warm / 1e3:.0f})")
