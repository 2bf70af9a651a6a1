"""One-process simulation of the asynchronous pipeline's staleness, to study its cost on loss.

bench-small is cut into stages; the stages named in STAGES compute their forward and backward at
the weights of `delay` optimizer steps ago (what weight stashing gives a stage whose forward ran
`delay` versions before its backward), the others at the current weights; every gradient is
applied to the current weights with AdamW, as the stage runtime does. At the end the final
weights are evaluated on 8 batches that training never drew.

    python docs/bench/staleness_sim.py DELAY [STEPS [LR]]

Environment knobs (all optional):
  CUTS="0,3,5,8"  block boundaries of the stages (default: the pipeline's three stages)
  STAGES="01"     indices of the stages that see the delay (default: all but the last)
  WU=20           synchronous warm-up steps before the delay applies
  CD=10           the last CD steps synchronous again (a cool-down)
  WU0=0           the first stage's own warm-up (default WU): it sees the delay from this step
                  on while the others wait for WU (a warm-up that hides the first link's round
                  trip)
  WUL=0.6         instead, a measured end: the warm-up lasts until the mean training loss of
                  the last 5 steps is at most WUL x the first step's (printed: the step it ended)
  PRED=1          forwards of delayed stages use weights predicted PRED steps ahead from
                  AdamW's moments (w - PRED * lr * (m_hat / (sqrt(v_hat) + eps) + wd * w))
  LRS, ELRS       learning-rate multipliers of the middle stages and of the first stage
  B1, SB1         AdamW beta1 of all stages, and of all but the last
  B2, SB2         AdamW beta2 of all stages, and of all but the last
  RAMP=40         the delayed stages' learning rate rises linearly over the first RAMP steps
                  (PipeMare's learning-rate rescheduling, Yang et al. arXiv 1910.05124)
  DC=1 [DCA=1]    delay compensation (DC-ASGD, Zheng et al. arXiv 1609.08326): the delayed
                  stages' gradient g becomes g + DC * g * g * (w_now - w_used), with DCA=1
                  divided by sqrt of AdamW's second moment (the adaptive variant)
  FRESHBW=1       the delayed stages' backward runs at the current weights on the stale
                  forward's input (no weight stashing; activations recomputed)
  COS=0.1         cosine learning-rate decay over the run, from lr to COS x lr (all stages;
                  not with RAMP)
  KLT=ag          the boundaries' activations (a) and/or gradients (g) go through the klt codec
                  as a sender uses it for the role (a stream per boundary and direction, towards
                  a peer that decodes columns), as frames would carry them; FINE=1: activations
                  at klt's fine step; GALPHA=0.2: gradients at that step (of the tensor's rms)
                  instead of 0.35
  START=2         with KLT: the first START steps' boundaries go through int4-block instead (the
                  sender's variant of each role: gradients with stochastic rounding), as `auto`
                  sent before it started with klt towards a peer that decodes it
  STALEMB=2       of each step's 4 microbatches, only the first STALEMB run at the delayed
                  weights on a delayed stage (the rest at the current ones: a stage that
                  forwards only that many microbatches ahead of its update; default 4, all)
  STALEMB_STEPS=20  STALEMB only for the steps before this one (all 4 after)
  WUA=2           the stages in STAGES run the first WUA_N (default 1) microbatches of each
                  synchronous step from step WUA_FROM (default 1) to the warm-up's end (WU;
                  WU=STEPS makes the whole run so) ahead of the update they follow, on AdamW's
                  step with the gradient of that update's first WUA microbatches scaled to the
                  whole step (the runtime's `stale_after_backwards`); WUA=4 is synchronous
                  training exactly. WUA_FILL=m: the missing microbatches' share from the first
                  moment instead of scaling
  PARTIAL_STAGES=1  with WUA, these delayed stages use that prediction after the warm-up too,
                  instead of the moments' alone
  TRACE=1         also print the training loss of every step
  SEED=0          model and data seed
"""

import copy
import dataclasses
import math
import os
import sys

import torch
from sim_klt import KLTStream
from sim_report import report

from ravnest_node.compression.codecs import Role, encoder
from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models import get_model

torch.set_num_threads(1)
delay = int(sys.argv[1])
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
lr = float(sys.argv[3]) if len(sys.argv) > 3 else 3e-4
env = os.environ.get
seed = int(env("SEED", "0"))
model = get_model("bench-small")
blocks = model.build_blocks(seed)
bounds = [int(c) for c in env("CUTS", "0,3,5,8").split(",")]
stages = [torch.nn.Sequential(*blocks[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
delayed = env("STAGES", "".join(str(i) for i in range(len(stages) - 1)))
warmup, predict = int(env("WU", "0")), float(env("PRED", "0"))
cooldown = int(env("CD", "0"))
first_warmup = int(env("WU0", str(warmup)))
loss_ratio = float(env("WUL", "0"))
if loss_ratio:
    warmup = 1 << 30  # until the loss says otherwise
beta1 = float(env("B1", "0.9"))
stale_beta1 = float(env("SB1", str(beta1)))
beta2 = float(env("B2", "0.999"))
stale_beta2 = float(env("SB2", str(beta2)))
opt = torch.optim.AdamW(
    [
        {"params": list(stages[0].parameters()), "lr": lr * float(env("ELRS", "1")),
         "betas": (stale_beta1, stale_beta2)},
        {"params": [p for s in stages[1:-1] for p in s.parameters()],
         "lr": lr * float(env("LRS", "1")), "betas": (stale_beta1, stale_beta2)},
        {"params": list(stages[-1].parameters())},
    ],
    lr=lr, weight_decay=0.01, betas=(beta1, beta2),
)  # fmt: skip
data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=seed)


def predicted(stage: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The stage's weights, moved `predict` AdamW steps ahead along its current moments."""
    weights = copy.deepcopy(stage.state_dict())
    for name, p in stage.named_parameters():
        state, group = (
            opt.state.get(p),
            next(g for g in opt.param_groups if any(p is q for q in g["params"])),
        )
        if state:
            k, (b1, b2) = float(state["step"]), group["betas"]
            m = state["exp_avg"] / (1 - b1**k)
            v = state["exp_avg_sq"] / (1 - b2**k)
            weights[name] = p.detach() - predict * group["lr"] * (
                m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p.detach()
            )
    return weights


dc, dca = float(env("DC", "0")), env("DCA") == "1"
cos_floor = float(env("COS", "-1"))
base_lrs = [g["lr"] for g in opt.param_groups]


def lr_factor(step: int) -> float:
    """The cosine schedule's multiplier at `step` (1 without COS)."""
    if cos_floor < 0:
        return 1.0
    return cos_floor + (1 - cos_floor) * 0.5 * (1 + math.cos(math.pi * step / steps))


ramp, fresh = int(env("RAMP", "0")), env("FRESHBW") == "1"
stale_rows = 4 * int(env("STALEMB", "4"))
stale_rows_until = int(env("STALEMB_STEPS", str(1 << 30)))
klt_roles = env("KLT", "")
klt_streams: dict[tuple[Role, int], KLTStream] = {}
int4_start = int(env("START", "0"))
int4_states: dict[tuple[Role, int], object] = {}


def through_klt(role: Role, boundary: int, t: torch.Tensor) -> torch.Tensor:
    """`t` as the receiver decodes it after klt (unchanged unless KLT names the role)."""
    if role[0] not in klt_roles:
        return t
    if step < int4_start:
        codec = encoder("int4-block", role)
        state = int4_states.setdefault((role, boundary), codec.new_state())
        out = []
        for mb in t.detach().split(4):
            params, payload = codec.encode(mb, state)
            out.append(codec.decode(memoryview(payload), mb.shape, mb.dtype, params))
        return torch.cat(out)
    stream = klt_streams.get((role, boundary))
    if stream is None:
        fine = role == "activation" and env("FINE") == "1"
        stream = klt_streams[role, boundary] = KLTStream.new(role, fine=fine)
        if role == "gradient" and env("GALPHA"):  # another step for the gradients
            stream.codec = dataclasses.replace(stream.codec, alpha=float(env("GALPHA")))
    # A frame per microbatch of 4, as the pipeline sends.
    return torch.cat([stream.through(mb)[0] for mb in t.detach().split(4)])


wua = int(env("WUA", "0"))
wua_n = int(env("WUA_N", "1"))
wua_from = int(env("WUA_FROM", "1"))
ahead_next: dict[int, dict[str, torch.Tensor]] = {}


def predict_partial(i: int, leaves_i: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stage i's next weights as AdamW's step makes them from the gradient of the step's first
    `wua` microbatches (leaves_i: each microbatch's weight leaves), scaled to the step."""
    weights = copy.deepcopy(stages[i].state_dict())
    for name, p in stages[i].named_parameters():
        group = next(g for g in opt.param_groups if any(p is q for q in g["params"]))
        gs = [leaves_i[j][name].grad for j in range(wua) if leaves_i[j][name].grad is not None]
        if not gs:
            continue
        state = opt.state.get(p)
        if env("WUA_FILL") == "m" and state:
            m_hat = state["exp_avg"] / (1 - group["betas"][0] ** float(state["step"]))
            g = sum(gs) + (4 - wua) / 4 * m_hat
        else:
            g = sum(gs) * (4 / wua)
        b1, b2 = group["betas"]
        if state:
            k, m, v = float(state["step"]), state["exp_avg"], state["exp_avg_sq"]
        else:
            k, m, v = 0.0, torch.zeros_like(g), torch.zeros_like(g)
        m2, v2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        mh, vh = m2 / (1 - b1 ** (k + 1)), v2 / (1 - b2 ** (k + 1))
        w = p.detach()
        weights[name] = w * (1 - group["lr"] * group["weight_decay"]) - group["lr"] * mh / (
            vh.sqrt() + group["eps"]
        )
    return weights


history: list[list[dict[str, torch.Tensor]]] = []  # per step: the weights a delayed forward uses
losses = []
for step in range(steps):
    for g, base in zip(opt.param_groups, base_lrs, strict=True):
        g["lr"] = base * lr_factor(step)  # this step's update, and the prediction of it
    x, y = data.batch(step, 16)
    current = [copy.deepcopy(s.state_dict()) for s in stages]
    history.append([predicted(s) for s in stages] if predict else current)
    cooling = step >= steps - cooldown
    lags = [delay if str(i) in delayed and not cooling and delay <= step
            and step >= (first_warmup if i == 0 else warmup) else 0
            for i in range(len(stages))]  # fmt: skip
    pstages = env("PARTIAL_STAGES", "")
    useds = [
        (
            ahead_next[i]
            if str(i) in pstages and lag == 1 and i in ahead_next
            else history[step - lag][i]
        )
        if lag
        else current[i]
        for i, lag in enumerate(lags)
    ]
    ins, outs, leaves = [], [], []
    h = x
    for i, stage in enumerate(stages):
        used = useds[i]
        hin = h.detach().requires_grad_(h.dtype.is_floating_point)
        parts = [(used, slice(0, None))]
        if lags[i] and stale_rows < len(hin) and step < stale_rows_until:
            parts = [(used, slice(0, stale_rows)), (current[i], slice(stale_rows, None))]
        if wua:
            look = str(i) in delayed and wua_from <= step < warmup and not lags[i]
            parts = [
                ((ahead_next[i] if look and j < wua_n else used), slice(4 * j, 4 * j + 4))
                for j in range(4)
            ]
        ws, pieces = [], []
        for weights, rows in parts:
            w = {k: t.clone().requires_grad_(True) for k, t in weights.items()
                 if t.dtype.is_floating_point}  # fmt: skip
            pieces.append(torch.func.functional_call(stage, {**weights, **w}, (hin[rows],)))
            ws.append(w)
        out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        ins.append(hin)
        outs.append(out)
        leaves.append(ws)
        h = through_klt("activation", i, out) if i < len(stages) - 1 else out
    loss = model.loss(h, y)
    gout = torch.autograd.grad(loss, [outs[-1]], retain_graph=True)[0]
    for i in reversed(range(len(stages))):
        stage = stages[i]
        if fresh and lags[i]:
            w = {k: t.clone().requires_grad_(True) for k, t in current[i].items()
                 if t.dtype.is_floating_point}  # fmt: skip
            out = torch.func.functional_call(stage, {**current[i], **w}, (ins[i],))
            leaves[i] = [w]
        else:
            out = outs[i]
        out.backward(gout)
        gout = through_klt("gradient", i - 1, ins[i].grad) if i else None
    for i, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            g = sum(w[name].grad for w in leaves[i] if w[name].grad is not None)
            if dc and lags[i]:
                g = g + dc * g * g * (p.detach() - useds[i][name]) / (
                    opt.state[p]["exp_avg_sq"]
                    .div(1 - 0.999 ** float(opt.state[p]["step"]))
                    .sqrt()
                    .add(1e-8)
                    if dca
                    else 1.0
                )
            p.grad = g
    if wua:
        for i in range(len(stages)):
            if str(i) in delayed and len(leaves[i]) == 4:
                ahead_next[i] = predict_partial(i, leaves[i])
    if ramp:
        f = min(1.0, (step + 1) / ramp)
        opt.param_groups[0]["lr"] = lr * float(env("ELRS", "1")) * f
        opt.param_groups[1]["lr"] = lr * float(env("LRS", "1")) * f
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
    recent = losses[-5:]
    if (
        loss_ratio
        and warmup > step
        and len(recent) == 5
        and (sum(recent) / 5 <= loss_ratio * losses[0])
    ):
        warmup = step + 1
        print(f"warm-up ended after step {warmup} (loss {sum(recent) / 5:.3f})")

if env("TRACE"):
    print(" ".join(f"{v:.3f}" for v in losses))
report(stages, model, data, losses)
