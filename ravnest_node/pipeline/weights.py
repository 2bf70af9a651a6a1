"""A stage's weights: its parameters, the optimizers that change them, and the snapshots its
forwards run with. Everything here runs on the compute thread.

**Weight stashing** (PipeDream, Narayanan et al., arXiv 1806.03377): a microbatch's backward uses
the very weights its forward used. Forward runs with `torch.func.functional_call` on a snapshot
of the parameters (at most S + 1 alive); gradients are moved from the snapshot into the
optimizer's parameters after each backward, and AdamW updates those in place.

**Weight prediction** (`weight_prediction`, on by default; SpecTrain, Chen et al., arXiv
1809.02839): a step t whose first forward runs at version v < t has its gradient applied
t - v updates later, to weights that have moved meanwhile. Its snapshot, taken at its first
microbatch and used by all of them, is therefore not the weights of version v but AdamW's
prediction of version t: w - (t - v) lr (m_hat / (sqrt(v_hat) + eps) + wd w), the update
AdamW's current moments would apply, repeated. Under a constant gradient that is the weights
step t will have (up to weight decay compounding, a term of order (t - v)^2 lr^2 wd); after
the synchronous warm-up on bench-small it takes 40-45% off the loss that staleness costs
(docs/benchmarks.md). Synchronous steps (t = v) use the weights unchanged. Without prediction a
snapshot is the current version's, taken at its first forward and shared by the steps that
run forward with it.

**The update's own gradients** (`stale_after_backwards` P > 0): a stage then runs a step ahead
only once P of the current update's microbatches have run backward here, and the snapshot of
a step one ahead is AdamW's step itself with the gradient those P give, scaled to the whole
step (g = sum x microbatches / P): the update that lands differs from it only by the rest of
the step's microbatches. The moments alone miss the step's own gradient, which AdamW weighs by
1 - beta1 and which, early in training, sets the sign of most coordinates' move; in the
one-process simulation (docs/bench/staleness_sim.py, `WUA`) two microbatches run ahead this way
once two are in cost +0.01% of held-out loss against synchronous training, where the whole step
ahead on the moments' prediction cost +1.34% (seeds 0-3, mean; docs/benchmarks.md).

**On a device** the parameters, AdamW's moments and the snapshots all live on the stage's
device, in float32 whatever the compute precision (autocast casts in the matmuls); AdamW is
torch's fused kernel on CUDA. **Loss scaling** (fp16, run.py's FP16_LOSS_SCALE): `step`
divides the gradients by the run's scale and skips a step whose gradients are not finite.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from ravnest_node.averaging import AveragingConfig, OuterOptimizer
from ravnest_node.blocks import BlockWeights, restore_blocks
from ravnest_node.pipeline.run import TrainConfig

Weights = dict[str, torch.Tensor]


def _fused_adamw(device: torch.device) -> bool | None:
    """Whether AdamW runs torch's fused kernel on `device`: yes on CUDA (one launch for all
    parameters); elsewhere None, torch's default as always (the CPU stays bit-for-bit)."""
    return True if device.type == "cuda" else None


_THIS_VERSION = -1
"""Key of the snapshot of the current version in `StageWeights._step_weights` (no
prediction)."""


class StageWeights:
    """The parameters of a stage's blocks with their AdamW optimizer, the outer (DiLoCo)
    optimizer of a replicated stage, and the weight snapshots of forwards (the stash).
    Call everything from the compute thread."""

    def __init__(
        self,
        blocks: torch.nn.Sequential,
        run: TrainConfig,
        *,
        first_block: int,
        restore: Mapping[int, BlockWeights] | None = None,
        averaging: AveragingConfig | None = None,
        device: torch.device | None = None,
        loss_scale: float = 1.0,
    ) -> None:
        """`restore`: states to load into the blocks and their optimizer (by block index);
        `averaging`: the replica group's settings, if the stage averages; `device`: where the
        blocks are (the CPU if None); `loss_scale`: what the gradients are multiplied by."""
        device = torch.device("cpu") if device is None else device
        self.params = dict(blocks.named_parameters())
        # A stage of frozen blocks only (LoRA's embeddings) has no parameters: its optimizer
        # then holds one empty placeholder, and its steps change nothing.
        trained = list(self.params.values()) or [torch.nn.Parameter(torch.empty(0, device=device))]
        self.optimizer = torch.optim.AdamW(
            trained, lr=run.lr, weight_decay=run.weight_decay, fused=_fused_adamw(device)
        )
        self.loss_scale = loss_scale
        if restore:
            restore_blocks(blocks, first_block, self.optimizer, restore)
        self.outer = OuterOptimizer(list(self.params.values()), averaging) if averaging else None
        self._microbatches = run.microbatches
        self._prediction = run.weight_prediction
        # With stale_microbatches, a step's later microbatches wait for the update and run
        # with a snapshot of it, not with the one its first ones ran ahead with.
        self._run = run
        self._refresh = run.stale_microbatches > 0
        # step -> (version it was taken at, weight snapshot) for steps whose microbatches are
        # still running forward (weight stashing), or _THIS_VERSION -> the current version's
        # without weight prediction; microbatches in flight hold theirs.
        self._step_weights: dict[int, tuple[int, Weights]] = {}
        self._with_gradients = run.ahead_after > 0
        self._backwards = 0
        """Microbatches whose gradients `release` moved in since the last step."""

    def for_forward(self, seq: int, version: int) -> tuple[int, Weights]:
        """The version and snapshot microbatch `seq` runs forward with, the weights being at
        `version` (leaves that collect the gradients of the microbatches that used them).
        With weight prediction: its step's, taken when the step's first microbatch came and
        released for new forwards after its last (retaken, with stale_microbatches, for those
        that come after an update); without: the current version's, taken at its first
        forward."""
        m = self._microbatches
        step = seq // m
        if self._prediction:
            key, ahead = step, step - version
        else:  # one snapshot per version, shared by every step that runs forward with it
            key, ahead = _THIS_VERSION, 0
        held = self._step_weights.get(key)
        if held is None or (self._refresh and held[0] != version):
            partial = ahead == 1 and self._with_gradients and self._backwards > 0 and self._finite()
            held = (version, self.snapshot(ahead, with_gradients=partial))
            self._step_weights[key] = held
        if key != _THIS_VERSION and seq % m == m - 1:
            del self._step_weights[key]
        return held

    def whole_step_ahead(self, on: bool) -> None:
        """From now on predict every step that runs ahead from the moments alone, and keep a
        step's snapshot for all its microbatches (`on`, as with stale_microbatches =
        stale_after_backwards = 0; pipeline/ahead.py), or as the run says again."""
        self._refresh = not on and self._run.stale_microbatches > 0
        self._with_gradients = not on and self._run.ahead_after > 0

    def snapshot(self, ahead: int, *, with_gradients: bool = False) -> Weights:
        """Copies of the parameters, moved `ahead` AdamW updates along its current moments
        (decoupled weight decay, then the moments' update with bias correction, as `step`
        applies it). `with_gradients`: the moments first take in the gradients moved in so
        far, scaled to the whole step, so that one update ahead is the step those gradients
        would make (a parameter without a gradient then stays, as AdamW leaves it)."""
        group = self.optimizer.param_groups[0]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        scale = self._microbatches / max(self._backwards, 1) / self.loss_scale
        snapshot = {}
        with torch.no_grad():
            for name, p in self.params.items():
                w = p.detach().clone()
                state = self.optimizer.state.get(p)
                moves = p.grad is not None if with_gradients else bool(state)
                if ahead and moves:
                    if with_gradients:
                        assert p.grad is not None
                        g = p.grad * scale
                        k = float(state["step"]) + 1 if state else 1.0
                        m, v = (1 - beta1) * g, (1 - beta2) * g * g
                        if state:
                            m += beta1 * state["exp_avg"]
                            v += beta2 * state["exp_avg_sq"]
                    else:
                        assert state  # (moves)
                        k, m, v = float(state["step"]), state["exp_avg"], state["exp_avg_sq"]
                    update = (m / (1 - beta1**k)) / ((v / (1 - beta2**k)).sqrt() + eps)
                    w -= ahead * lr * (update + wd * w)
                snapshot[name] = w.requires_grad_(True)
        return snapshot

    def _finite(self) -> bool:
        """Whether the gradients moved in so far are finite: always without loss scaling (a
        float32 or bfloat16 run's are, or the run fails anyway); with it (fp16), checked, and a
        step whose gradients overflowed is predicted from the moments instead."""
        return self.loss_scale == 1.0 or _all_finite(self._grads())

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params.values() if p.grad is not None]

    def live_versions(self, held: Iterable[Weights]) -> int:
        """Weight snapshots alive: those of steps still running forward and those `held` by
        microbatches in flight."""
        alive = {id(weights) for weights in held}
        alive.update(id(weights) for _, weights in self._step_weights.values())
        return len(alive)

    def release(self, snapshot: Weights) -> None:
        """Move the snapshot's gradients into the optimizer's parameters (the step's gradient
        sums microbatches in the order their backwards ran). A snapshot is freed when no
        microbatch in flight holds it and its step has no forwards left to run."""
        with torch.no_grad():
            for name, p in self.params.items():
                g = snapshot[name].grad
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad += g
                snapshot[name].grad = None
        self._backwards += 1

    def step(self, *, skip: bool = False) -> bool:
        """Apply the gradients collected since the last step, divided by the loss scale
        (`skip`: drop them instead, the fault injection of a stage that skips its update).
        False if the step was not applied: skipped, or (loss scaling) a gradient is not
        finite, which changes no weight and no optimizer state."""
        applied = not skip and self._unscale()
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._backwards = 0
        self._step_weights.pop(_THIS_VERSION, None)  # stale now; microbatches in flight keep it
        return applied

    def _unscale(self) -> bool:
        """Divide the gradients by the loss scale; False if any of them is not finite. Without
        loss scaling nothing is checked (an fp32 step is what it always was)."""
        if self.loss_scale == 1.0:
            return True
        grads = self._grads()
        with torch.no_grad():
            for g in grads:
                g.mul_(1.0 / self.loss_scale)  # a power of 2: exact
        return _all_finite(grads)

    def begin_round(self) -> torch.Tensor:
        """This replica's delta for an averaging round (`OuterOptimizer.begin_round`)."""
        assert self.outer is not None
        return self.outer.begin_round(list(self.params.values()))

    def apply_round(self, mean: torch.Tensor) -> None:
        """Apply a round's mean delta (`OuterOptimizer.apply`)."""
        assert self.outer is not None
        self.outer.apply(list(self.params.values()), mean)
        self._step_weights.clear()  # the next forward sees the averaged weights

    def stats(self) -> tuple[float, int]:
        """The sum of the parameters' squares (in float64), and their count."""
        with torch.no_grad():
            total = sum(float(p.double().square().sum()) for p in self.params.values())
            count = sum(p.numel() for p in self.params.values())
        return total, count

    def sha256(self) -> str:
        """sha256 of the parameters' bytes."""
        digest = hashlib.sha256()
        with torch.no_grad():
            for p in self.params.values():
                digest.update(p.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()


def _all_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every gradient is finite: one device-to-host read for the whole stage, not one
    per parameter."""
    with torch.no_grad():
        return not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
