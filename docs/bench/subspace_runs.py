"""Bytes and loss of the subspace model (models/subspace.py) against the plain bench-small,
with fp32 and klt at both stage boundaries, trained from scratch in one process.

The model is cut into the pipeline's three stages (bench-small [0, 3, 5, 8): embedding + 2
layers, 2 layers, 2 layers + head; bench-small-subspace [0, 2, 4, 7): the same layers per
stage) and trained synchronously, as a pipeline with no staleness computes: 16 samples a step
in 4 microbatches, AdamW lr 3e-4 (weight decay 0.01), seed s for the weights and the data.
The activation each boundary carries forward and its gradient back go through the real codec
objects (`compression.encoder(name, role)`, a sender's state and, for klt, a receiver's
bases per boundary and direction): encoded, their payload bytes counted, decoded. The
subspace model's forward frames also carry the token ids (uint8, 1 byte each), counted in
its bytes; the targets, which both models carry to the last stage, are left out of both.

At each checkpoint step (60 and the last) a JSONL line records the boundary bytes per sample
(activations + gradients, both boundaries, so far / samples trained), the ratio of the
fp32 plain model's to them, the training loss (mean of the last 10 steps) and the eval loss
of the weights at that step on 8 batches of 16 the training never draws (sim_report.UNSEEN).
With a constant learning rate and synchronous steps, step 60 of a 200-step run *is* a
60-step run.

    python docs/bench/subspace_runs.py RUN SEED STEPS [OUT.jsonl]

RUN: plain-none, plain-klt, sub-none, sub-klt, sub-int8-block (MODEL-CODEC, plain being
bench-small, sub bench-small-subspace, sub32 the same with k = 32).
`python docs/bench/subspace_runs.py table FILE` prints the table of a JSONL.
"""

import itertools
import json
import sys
import time
from collections import defaultdict
from typing import Any

import torch
from sim_report import UNSEEN

from ravnest_node.compression import encoder
from ravnest_node.compression.transform import KLT, KLTBases
from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models import get_model, run_blocks
from ravnest_node.models.bytelm import PRESETS
from ravnest_node.models.subspace import SubspaceLM

torch.set_num_threads(1)
CHECKPOINTS = (60,)
MODELS = {
    "plain": ("bench-small", [0, 3, 5, 8]),
    "sub": ("bench-small-subspace", [0, 2, 4, 7]),
    "sub32": ("bench-small-subspace k=32", [0, 2, 4, 7]),
}
FP32_BYTES_PER_SAMPLE = 2 * 2 * 128 * 256 * 4
"""bench-small's boundaries in fp32: 2 boundaries x (activation + gradient) x T x d x 4."""


class Stream:
    """One boundary's stream in one direction through a real codec."""

    def __init__(self, name: str, role: Any) -> None:
        self.codec = encoder(name, role)
        self.state = self.codec.new_state()
        self.bases = KLTBases()
        self.bytes = 0

    def through(self, x: torch.Tensor) -> torch.Tensor:
        params, payload = self.codec.encode(x.detach(), self.state)
        self.bytes += len(payload)
        view = memoryview(payload)
        if isinstance(self.codec, KLT):
            out, commit = self.codec.decode_stream(self.bases, view, x.shape, x.dtype, params)
            commit()
            return out
        return self.codec.decode(view, x.shape, x.dtype, params)


class Boundary(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: Stream, bwd: Stream) -> torch.Tensor:
        ctx.bwd = bwd
        return fwd.through(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.bwd.through(grad), None, None


def run(kind: str, seed: int, steps: int, out_path: str) -> None:
    which, codec = kind.split("-", 1)
    name, cuts = MODELS[which]
    model = get_model(name) if which != "sub32" else SubspaceLM(PRESETS["bench-small"], 32)
    carries = model.carries_tokens
    blocks = model.build_blocks(seed)
    stages = [blocks[a:b] for a, b in itertools.pairwise(cuts)]
    fwd = [Stream(codec, "activation") for _ in stages[1:]]
    bwd = [Stream(codec, "gradient") for _ in stages[1:]]
    params = [p for b in blocks for p in b.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01)
    data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=seed)
    token_bytes = 0
    losses: list[float] = []
    started = time.perf_counter()

    def forward(x: torch.Tensor, boundaries: bool) -> torch.Tensor:
        nonlocal token_bytes
        tokens = x if carries else None
        h = x
        for i, stage in enumerate(stages):
            if i and boundaries:
                h = Boundary.apply(h, fwd[i - 1], bwd[i - 1])
                token_bytes += x.numel() if carries else 0
            h = run_blocks(stage, h, tokens)
        return h

    for step in range(1, steps + 1):
        x, y = data.batch(step - 1, 16)
        step_loss = 0.0
        for mb in range(4):
            rows = slice(mb * 4, (mb + 1) * 4)
            loss = model.loss(forward(x[rows], True), y[rows]) / 4
            loss.backward()
            step_loss += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(step_loss)
        if step in CHECKPOINTS or step == steps:
            with torch.no_grad():
                held_out = [data.batch(UNSEEN + k, 16) for k in range(8)]
                evals = [model.loss(forward(xe, False), ye).item() for xe, ye in held_out]
            samples = 16 * step
            act, grad = sum(s.bytes for s in fwd), sum(s.bytes for s in bwd)
            per_sample = (act + grad + token_bytes) / samples
            record = {
                "run": kind, "model": name, "codec": codec, "seed": seed, "step": step,
                "activation_bytes_per_sample": act / samples,
                "gradient_bytes_per_sample": grad / samples,
                "token_bytes_per_sample": token_bytes / samples,
                "boundary_bytes_per_sample": per_sample,
                "fp32_plain_ratio": FP32_BYTES_PER_SAMPLE / per_sample,
                "train_loss_last10": sum(losses[-10:]) / len(losses[-10:]),
                "eval_loss": sum(evals) / len(evals),
                "seconds": round(time.perf_counter() - started, 1),
            }  # fmt: skip
            with open(out_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(json.dumps(record), flush=True)


def table(path: str) -> None:
    """Per run and step: the mean over seeds (and the seeds' spread) of every figure."""
    rows: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            rows[(r["run"], r["step"])].append(r)
    print(f"{'run':16} {'step':>4} {'seeds':>5} {'B/sample':>10} {'x fp32':>7} "
          f"{'train':>14} {'eval':>14}")  # fmt: skip
    for (kind, step), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        def stat(key: str, rs: list[dict[str, Any]] = rs) -> tuple[float, float]:
            vals = [r[key] for r in rs]
            return sum(vals) / len(vals), max(vals) - min(vals)

        b, _ = stat("boundary_bytes_per_sample")
        (t, ts), (e, es) = stat("train_loss_last10"), stat("eval_loss")
        print(f"{kind:16} {step:>4} {len(rs):>5} {b:>10.0f} {524288 / b:>7.1f} "
              f"{t:>8.4f}±{ts / 2:.3f} {e:>8.4f}±{es / 2:.3f}")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1] == "table":
        table(sys.argv[2])
    else:
        out = sys.argv[4] if len(sys.argv) > 4 else "docs/bench/subspace-runs.jsonl"
        run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), out)
