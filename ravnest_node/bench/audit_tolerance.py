"""How far apart two honest computations of one stage land, and how far a lie lands: the
tolerance an audit that recomputes a stage's microbatch needs (issue #35, docs/benchmarks.md).
`python -m ravnest_node.bench.audit_tolerance [--model bench-small --first 2 --stop 6]`.

A stage's blocks (built from the run's seed) take a microbatch of real activations (the data
through the blocks before the stage); its output and its input's gradient (backward from one
fixed output gradient) are computed as a reference (fp32, one torch thread) and again: at two
threads (another machine's BLAS splits sums otherwise), in bf16 autocast at one and two threads
(a swarm may mix precisions), and once more as the reference (is the CPU deterministic?). Each
is printed as the relative distance ||a - ref|| / ||ref|| of the output and of the gradient,
beside the distance of each lie of pipeline/lies.py from the reference. With `--device cuda`
the stage is also computed on the GPU (fp32 twice, TF32 matmuls, bf16 autocast): what an
auditor on a CPU finds of an honest GPU node (cuBLAS sums, atomics in backward kernels).
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ravnest_node.devices import autocast, torch_threads
from ravnest_node.models import get_model
from ravnest_node.models.base import Chain
from ravnest_node.pipeline.lies import LIES, lie

__all__ = ["distances", "main"]


def _stage_io(
    chain: Chain, x: torch.Tensor, grad_out: torch.Tensor, precision: str, threads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage's output and its input's gradient, as float32 on the CPU (computed where
    `chain`'s parameters are)."""
    device = next(chain.parameters()).device
    x = x.detach().to(device).requires_grad_(True)
    with torch_threads(threads), autocast(device, precision):
        out = chain(x)
    with torch_threads(threads):
        out.backward(grad_out.to(device, out.dtype))
    assert x.grad is not None
    return out.detach().float().cpu(), x.grad.float().cpu()


def _on_device(
    chain: Chain, x: torch.Tensor, grad_out: torch.Tensor, device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The ways a GPU node computes the stage: fp32 (TF32 off) twice, TF32, bf16."""
    moved = copy.deepcopy(chain).to(device)
    found = {}
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    ways = (("gpu fp32", "fp32", False), ("gpu fp32 again", "fp32", False),
            ("gpu tf32", "fp32", True), ("gpu bf16", "bf16", False))  # fmt: skip
    try:
        for name, precision, allow in ways:
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = allow
            found[name] = _stage_io(moved, x, grad_out, precision, 1)
            moved.zero_grad(set_to_none=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return found


def distances(
    model_name: str, first: int, stop: int, batch: int, seed: int = 0, device: str = "cpu"
) -> dict[str, Any]:
    """Relative distances from the reference (fp32, one thread) of each honest way of
    computing blocks [first, stop) of `model_name` on a `batch`-row microbatch (on `device`
    too, when it is not the CPU), and of each lie: {name: (output distance, gradient
    distance)}."""
    model = get_model(model_name)
    blocks = model.build_blocks(seed)
    data = model.dataset(seed=seed)
    x, _ = data.batch(0, batch)
    with torch.no_grad():
        hidden = Chain(*blocks[:first])(x) if first else x
    if not hidden.is_floating_point():
        raise ValueError("audit the stages after the first: they take activations")
    chain = Chain(*blocks[first:stop])
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        shape = chain(hidden).shape
    grad_out = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
    ref_out, ref_grad = _stage_io(chain, hidden, grad_out, "fp32", 1)
    chain.zero_grad(set_to_none=True)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    out: dict[str, Any] = {}
    ways = (("fp32 again", "fp32", 1), ("fp32, 2 threads", "fp32", 2), ("bf16", "bf16", 1),
            ("bf16, 2 threads", "bf16", 2))  # fmt: skip
    for name, precision, threads in ways:
        y, g = _stage_io(chain, hidden, grad_out, precision, threads)
        chain.zero_grad(set_to_none=True)
        out[name] = (rel(y, ref_out), rel(g, ref_grad))
    if torch.device(device).type != "cpu":
        for name, (y, g) in _on_device(chain, hidden, grad_out, torch.device(device)).items():
            out[name] = (rel(y, ref_out), rel(g, ref_grad))
    for kind in LIES:
        out[f"lie: {kind}"] = (rel(lie(ref_out, kind), ref_out), rel(lie(ref_grad, kind), ref_grad))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ravnest_node.bench.audit_tolerance",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--model", default="bench-small")
    parser.add_argument("--first", type=int, default=2)
    parser.add_argument("--stop", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="also compute the stage there (cuda)")
    args = parser.parse_args(argv)
    found = distances(args.model, args.first, args.stop, args.batch, device=args.device)
    print(f"{args.model} blocks [{args.first}, {args.stop}), a microbatch of {args.batch}; "
          "relative distance from fp32 at one thread:")  # fmt: skip
    print(f"{'computed as':<18} {'output':>10} {'input grad':>11}")
    for name, (y, g) in found.items():
        print(f"{name:<18} {y:10.2e} {g:11.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
