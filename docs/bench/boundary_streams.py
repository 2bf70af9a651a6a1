"""bench-small's four boundary streams, as a three-stage pipeline sends them (klt_refresh.py,
codec_error.py): the model cut into the pipeline's three stages (blocks 0-2 | 3-4 | 5-7),
trained synchronously for `steps` steps of 16 samples in 4 microbatches (AdamW lr 3e-4),
keeping every microbatch's two boundary activations and their gradients (240 frames each after
60 steps). Memory: about 8 MB a step kept."""

import itertools

import torch

from ravnest_node.compression.codecs import Role
from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models import get_model


def boundary_streams(steps: int, seed: int) -> dict[tuple[Role, int], list[torch.Tensor]]:
    """{(role, boundary): [one tensor per microbatch, in the order sent]}."""
    torch.manual_seed(seed)
    model = get_model("bench-small")
    blocks = model.build_blocks(seed)
    cuts = [0, 3, 5, 8]
    stages = [torch.nn.Sequential(*blocks[a:b]) for a, b in itertools.pairwise(cuts)]
    params = [p for s in stages for p in s.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01)
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
    return streams
