"""The cost model of `ravnest-node plan` against real runs on this machine.

``python -m ravnest_node.bench.plan_check [MODEL ...] [--nodes 3] [--steps 40]`` does, for each
small preset (tiny, small, bench-small):

1. calibrate this machine, never a figure from a table: two blocks of the model, forward and
   backward the way a stage runs them (`torch.func.functional_call` on a weight snapshot,
   gradients moved to the parameters), timed on one thread: the block with the fewest FLOPs
   gives the fixed cost of any block, the one with the most gives the FLOP/s. An AdamW step of
   the latter gives the optimizer's seconds per parameter, and a frame of the boundary tensor
   through an in-process gRPC stream what a stage's frames cost per microbatch;
2. predict samples/s with `coordination.estimate` (the planner's own cut and cost model) for a
   local swarm of `--nodes` node processes, one thread each, sharing this machine's cores;
3. run that swarm for real (`demo`'s machinery: node processes on loopback, gRPC, the
   asynchronous pipeline from the first step) and measure samples/s from a quarter of the run
   to its end;
4. print predicted against measured and their ratio.

Before the models, one single-node run of `tiny` (whose FLOPs are negligible) measures what the
node runtime costs per microbatch beyond its blocks (scheduling, the event loop, the optimizer
step's bookkeeping); every stage of every prediction pays it.

Figures on a machine shared with other work are noisy: the table gives the cores other work
took during each run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
import torch

from ravnest_node.compression.codecs import get_codec
from ravnest_node.coordination.planning.estimate import (
    Estimate,
    NodeGroup,
    SharedHost,
    Training,
    estimate,
    stage_memory,
)
from ravnest_node.coordination.planning.negotiate import STASH_BYTES_PER_PARAM
from ravnest_node.coordination.planning.placement import Link
from ravnest_node.coordination.planning.shapes import LlamaConfig, model_shape
from ravnest_node.daemon.worker.capabilities import available_memory_bytes
from ravnest_node.devices import resolve_device, torch_threads
from ravnest_node.launch.demo import Demo, DemoConfig
from ravnest_node.models import BlockModel, TensorSpec, get_model, run_blocks
from ravnest_node.models.base import to_device
from ravnest_node.models.lora import LoRAConfig, freeze
from ravnest_node.models.pretrained.llama import LlamaLayer
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.frames import FrameKind, FrameLimits, encode_frame, parse_frame

MODELS = ("tiny", "small", "bench-small")
REPEATS = 15
LOOPBACK = Link(bandwidth_bps=1e10, rtt_s=1e-4)
"""Loopback as the planner sees it: fast enough never to be the bottleneck here."""
Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Calibration:
    """What one block's timing says about this machine, for one model."""

    flops_per_s: float
    """FLOPs (in the model's `block_costs` units) per second of forward + backward."""
    block_overhead_s: float
    """Seconds per block and microbatch that do not grow with its size."""
    optimizer_s_per_param: float
    """Seconds of an AdamW step per parameter."""
    runtime_s: float
    """Seconds per microbatch the node runtime takes beyond its blocks and frames."""
    frame_s: float
    """Seconds of one frame of the boundary tensor there and an answer back over a gRPC stream
    on loopback, both ends in one process: encode, send, receive, parse, decode in a worker
    thread. Roughly what a stage spends per microbatch on its frames, off the blocks."""
    threads: int


def _median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: allocations, lazy initialisation
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _block_path(block: torch.nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """Forward and backward of `block` on `x` as a stage runs them: on a fresh weight snapshot
    through `torch.func.functional_call`, the gradients then moved to the parameters."""
    params = dict(block.named_parameters())

    def run() -> None:
        snapshot = {k: p.detach().clone().requires_grad_(True) for k, p in params.items()}
        inp = x.detach().requires_grad_(x.dtype.is_floating_point)
        out = torch.func.functional_call(block, snapshot, (inp,))
        torch.autograd.backward(out, torch.ones_like(out))
        for name, p in params.items():
            p.grad = snapshot[name].grad

    return run


def _block_input(model: BlockModel, index: int, batch: int) -> torch.Tensor:
    if index == 0:
        spec = model.input_spec(batch)
        return torch.zeros(spec.shape, dtype=spec.dtype)
    spec = model.output_spec(index - 1, batch)
    return torch.randn(spec.shape, generator=torch.Generator().manual_seed(0))


def calibrate(
    model_name: str, microbatch: int, threads: int = 1, repeats: int = REPEATS
) -> Calibration:
    """Time blocks of `model_name` on `threads` threads: the cheapest in FLOPs (its time is
    the fixed cost of any block) and the most expensive (its time beyond that fixed cost gives
    the FLOP/s); an AdamW step of the latter; a frame on loopback. A few seconds for the
    presets here; blocks the calling thread."""
    model = get_model(model_name)
    blocks = model.build_blocks(seed=0)
    costs = model.block_costs()
    heavy = max(range(len(blocks)), key=lambda i: (costs[i], -i))
    light = min(range(len(blocks)), key=lambda i: (costs[i], i))
    with torch_threads(threads):
        fixed_s = _median_s(
            _block_path(blocks[light], _block_input(model, light, microbatch)), repeats
        )
        heavy_s = _median_s(
            _block_path(blocks[heavy], _block_input(model, heavy, microbatch)), repeats
        )
        optimizer = torch.optim.AdamW(blocks[heavy].parameters())
        params = list(blocks[heavy].parameters())

        def step() -> None:
            for p in params:
                p.grad = torch.ones_like(p)
            optimizer.step()

        step_s = _median_s(step, repeats)
    light_work = 3 * costs[light] * microbatch  # forward + backward, in block_costs units
    heavy_work = 3 * costs[heavy] * microbatch
    # Noise must not make the FLOP/s negative or absurd: the fixed cost is at most half.
    flops_per_s = (heavy_work - light_work) / max(heavy_s - fixed_s, heavy_s / 2)
    fixed_s = max(0.0, min(fixed_s - light_work / flops_per_s, heavy_s / 2))
    count = sum(p.numel() for p in params)
    frame_s = frame_cost_s(model_name, microbatch)
    return Calibration(flops_per_s, fixed_s, step_s / max(1, count), 0.0, frame_s, threads)


async def _frame_echo_s(frame: bytes, repeats: int) -> float:
    """Median seconds of `frame` to an in-process gRPC server and an answer back (see
    `Calibration.frame_s`)."""
    limits = FrameLimits(max_message_bytes=2 * len(frame) + (1 << 20))
    options = [
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", limits.max_message_bytes),
    ]

    def decode(message: bytes) -> None:
        parse_frame(message, limits).decode()

    async def echo(requests: Any, context: Any) -> Any:
        async for message in requests:
            await asyncio.to_thread(decode, message)
            yield b"ok"

    handler = grpc.method_handlers_generic_handler(
        "ravnest.plancheck.Echo", {"Frames": grpc.stream_stream_rpc_method_handler(echo)}
    )
    server = grpc.aio.server(options=options)
    server.add_generic_rpc_handlers([handler])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.stream_stream("/ravnest.plancheck.Echo/Frames")()
            times = []
            for i in range(repeats + 3):  # three to warm the stream up
                started = time.perf_counter()
                await call.write(frame)
                await call.read()
                if i >= 3:
                    times.append(time.perf_counter() - started)
            await call.done_writing()
            await call.code()
    finally:
        await server.stop(None)
    return statistics.median(times)


def frame_cost_s(model_name: str, microbatch: int, repeats: int = 30) -> float:
    """`Calibration.frame_s` for the largest boundary tensor of `model_name` (fp32, codec
    none, as on loopback)."""
    model = get_model(model_name)
    last = model.num_blocks() - 1
    spec = max((model.output_spec(i, microbatch) for i in range(last)), key=lambda t: t.numel)
    tensor = torch.randn(spec.shape, generator=torch.Generator().manual_seed(0))
    frame = encode_frame(FrameKind.FORWARD, 1, 0, [("hidden", tensor, get_codec("none"))])
    return asyncio.run(_frame_echo_s(frame, repeats))


def predict(
    model_name: str,
    nodes: int,
    train: TrainConfig,
    calibration: Calibration,
    cores: float | None = None,
) -> Estimate:
    """The cost model's samples/s for `nodes` local node processes (one thread each) training
    `train`, on this machine as calibrated, with `cores` of it (default: all)."""
    shape = model_shape(get_model(model_name))
    group = NodeGroup(
        count=nodes,
        memory_bytes=float(available_memory_bytes() or 2**33) / nodes,
        flops_per_s=calibration.flops_per_s,
        label=f"local node ({calibration.threads} thread)",
        block_overhead_s=calibration.block_overhead_s,
        optimizer_s_per_param=calibration.optimizer_s_per_param,
    )
    training = Training(
        mode="full",
        base="fp32",
        batch_size=train.batch_size,
        microbatches=train.microbatches,
        max_staleness=train.max_staleness,
        recompute="off",
        audits=train.audit_share > 0,
    )
    overhead = calibration.runtime_s + (calibration.frame_s if nodes > 1 else 0.0)
    host = SharedHost(cores=cores or os.cpu_count() or 1, stage_overhead_s=overhead)
    return estimate(shape, [group], LOOPBACK, training, codec="auto", host=host)


def _machine_busy_s() -> float:
    """CPU seconds every process of this machine has used since boot (0 if unknown)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / (os.sysconf("SC_CLK_TCK") or 100)


def _our_cpu_s() -> float:
    """CPU seconds of this process and its finished children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(train: TrainConfig, nodes: int, work_dir: Path) -> Record:
    """Run `nodes` node processes on loopback and measure their steady samples/s, and how many
    cores other work on the machine took meanwhile (the noise in the figure)."""
    cfg = DemoConfig(nodes=nodes, work_dir=work_dir, compute_threads=1, train=train)
    work_dir.mkdir(parents=True, exist_ok=True)
    busy, ours, started = _machine_busy_s(), _our_cpu_s(), time.monotonic()
    with open(work_dir / "progress.log", "w") as log:
        demo = Demo(cfg, log, every=1)
        summary = asyncio.run(demo.run())
    wall_s = time.monotonic() - started
    others = (_machine_busy_s() - busy) - (_our_cpu_s() - ours)
    if summary is None:
        raise RuntimeError(f"the run in {work_dir} was stopped")
    by_step = {e.step: e for e in demo.events if not e.done}
    first = max(2, train.steps // 4)
    a, b = by_step[first], by_step[train.steps]
    return {
        "samples_per_s": (b.samples - a.samples) / (b.wall_s - a.wall_s),
        "from_step": first,
        "stages": [list(s["blocks"]) for s in summary["stages"]],
        "codec": summary["codec"],
        "other_load_cores": max(0.0, others / wall_s),
    }


def _train(model_name: str, steps: int) -> TrainConfig:
    return TrainConfig(model=model_name, steps=steps, staleness_warmup_steps=0, checkpoint_every=0)


def runtime_cost_s(steps: int, work_dir: Path) -> tuple[float, Record]:
    """`Calibration.runtime_s`: a one-node run of `tiny`, its seconds per microbatch less what
    the calibrated blocks predict for it; and that run's record."""
    train = _train("tiny", steps)
    calibration = calibrate("tiny", train.microbatch_size)
    blocks_s = predict("tiny", 1, train, calibration).step_s
    measured = measure(train, 1, work_dir / "runtime-tiny-1-node")
    per_microbatch_s = train.microbatch_size / measured["samples_per_s"]
    return max(0.0, per_microbatch_s - blocks_s), measured | {"blocks_s": blocks_s}


def check_model(
    model_name: str, nodes: int, steps: int, work_dir: Path, runtime_s: float
) -> Record:
    """Predicted against measured samples/s for one model."""
    train = _train(model_name, steps)
    calibration = dataclasses.replace(
        calibrate(model_name, train.microbatch_size), runtime_s=runtime_s
    )
    predicted = predict(model_name, nodes, train, calibration)
    measured = measure(train, nodes, work_dir / model_name)
    free = max(1.0, (os.cpu_count() or 1) - measured["other_load_cores"])
    predicted_free = predict(model_name, nodes, train, calibration, cores=free)
    return {
        "model": model_name,
        "nodes": nodes,
        "cores": os.cpu_count(),
        "steps": steps,
        "calibration": dataclasses.asdict(calibration),
        "predicted_samples_per_s": predicted.samples_per_s,
        "predicted_stages": [[s.first_block, s.stop_block] for s in predicted.stages],
        "predicted_bottleneck": predicted.bottleneck,
        "measured": measured,
        "ratio": predicted.samples_per_s / measured["samples_per_s"],
        "cores_left_free": free,
        "predicted_free_samples_per_s": predicted_free.samples_per_s,
        "ratio_free": predicted_free.samples_per_s / measured["samples_per_s"],
    }


def run_plan_check(
    models: Sequence[str] = MODELS,
    nodes: int = 3,
    steps: int = 40,
    jsonl: Path | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Check every model; print the table (and write JSON lines to `jsonl`)."""
    work_dir = Path(tempfile.mkdtemp(prefix="ravnest-plan-check-"))
    print(
        f"plan-check: {nodes} local node processes (1 thread each) on {os.cpu_count()} "
        f"cores, {steps} steps each; work dir {work_dir}",
        file=out,
        flush=True,
    )
    runtime_s, runtime_run = runtime_cost_s(steps, work_dir)
    print(
        f"node runtime: {runtime_s * 1e3:.2f} ms per microbatch beyond the blocks (one node of "
        f"tiny: {runtime_run['samples_per_s']:.0f} samples/s, blocks "
        f"{runtime_run['blocks_s'] * 1e3:.2f} ms a microbatch; other load "
        f"{runtime_run['other_load_cores']:.2f} cores)\n",
        file=out,
        flush=True,
    )
    records: list[Record] = [{"runtime_s": runtime_s, "run": runtime_run}]
    print(
        "| model | GFLOP/s (1 thread) | predicted samples/s | measured samples/s | predicted "
        "/ measured | other work's cores | predicted with the cores left | its ratio | "
        "bottleneck |",
        file=out,
    )
    print("|---|---|---|---|---|---|---|---|---|", file=out, flush=True)
    for name in models:
        r = check_model(name, nodes, steps, work_dir, runtime_s)
        records.append(r)
        print(
            f"| {name} | {r['calibration']['flops_per_s'] / 1e9:.1f} | "
            f"{r['predicted_samples_per_s']:.1f} | {r['measured']['samples_per_s']:.1f} | "
            f"{r['ratio']:.2f} | {r['measured']['other_load_cores']:.2f} | "
            f"{r['predicted_free_samples_per_s']:.1f} | {r['ratio_free']:.2f} | "
            f"{r['predicted_bottleneck']} |",
            file=out,
            flush=True,
        )
    if jsonl is not None:
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


MEMORY_LLAMA = LlamaConfig(layers=3, hidden=64, heads=4, kv_heads=2, mlp_hidden=128, vocab=256,
                           seq_len=64)  # fmt: skip
"""The Llama-shaped stage of the memory check: small enough for a CPU, every matrix a
multiple of nf4's blocks."""
GPU_MEMORY_LLAMA = LlamaConfig(layers=3, hidden=1024, heads=16, kv_heads=4, mlp_hidden=2816,
                               vocab=256, seq_len=256)  # fmt: skip
"""The stage of the memory check on a GPU: three layers of llama-300m (llama_bench.py), large
enough that the allocator's own rounding is noise."""
MEMORY_TRAIN = Training(
    batch_size=4, microbatches=2, max_staleness=1, recompute="off", audits=False
)
"""(Without audits: the loop measured here keeps no audit records.)"""
"""Microbatches of 2 samples, 4 in flight."""
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _forward_backward(
    blocks: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Forward of every input through `blocks`, then backward of each: the outputs."""
    outputs = []
    for x in inputs:
        inp = x.detach().requires_grad_(x.dtype.is_floating_point)
        outputs.append(run_blocks(blocks, inp))
    for out in outputs:
        torch.autograd.backward(out, torch.ones_like(out))
    return outputs


def measure_stage_memory(
    blocks: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor], max_staleness: int
) -> dict[str, float]:
    """Bytes a stage of `blocks` keeps with `inputs` (one per microbatch) in flight, counted
    tensor by tensor (on any device): its frozen buffers (weights), its parameters with their
    gradients, AdamW moments and `max_staleness` stashed copies (trainable), and the distinct
    tensors autograd saves for the backward of every microbatch (activations, not counting the
    stage's own parameters and buffers). Blocks the calling thread."""
    params = [p for b in blocks for p in b.parameters()]
    own = {t.untyped_storage().data_ptr() for b in blocks for t in (*b.parameters(), *b.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _forward_backward(blocks, inputs)
    optimizer = torch.optim.AdamW(params)
    optimizer.step()
    moments = sum(t.nbytes for st in optimizer.state.values() for t in st.values() if t.dim())
    grads = sum(p.grad.nbytes for p in params if p.grad is not None)
    stash = STASH_BYTES_PER_PARAM * max_staleness * sum(p.numel() for p in params)
    return {
        "weights": float(sum(t.nbytes for b in blocks for t in b.buffers())),
        "trainable": float(sum(p.nbytes for p in params) + grads + moments + stash),
        "activations": float(sum(saved.values())),
    }


def allocator_peak_bytes(
    blocks: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor], max_staleness: int
) -> float:
    """What the CUDA allocator says the same stage needs in its steady state (`measure_stage_
    memory`'s schedule after a first step: AdamW's moments already there, every input in
    flight, their backward, an AdamW step): the stage's own tensors and moments, plus the
    allocator's peak over that schedule above what was allocated before it (after the first
    step, which also allocates the libraries' workspaces), plus the stash, which this does not
    allocate. Blocks on a CUDA device only; blocks the calling thread."""
    device = inputs[0].device
    params = [p for b in blocks for p in b.parameters()]
    optimizer = torch.optim.AdamW(params, fused=True)  # as the stage's (blocks.py)
    _forward_backward(blocks, inputs[:1])  # the first step: moments, workspaces, kernels
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    outputs = _forward_backward(blocks, inputs)
    optimizer.step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del outputs
    own = sum(t.nbytes for b in blocks for t in (*b.parameters(), *b.buffers()))
    moments = sum(t.nbytes for st in optimizer.state.values() for t in st.values() if t.dim())
    stash = STASH_BYTES_PER_PARAM * max_staleness * sum(p.numel() for p in params)
    return float(own + moments + peak + stash)


def memory_stage(
    kind: str, device: torch.device | None = None, llama: LlamaConfig = MEMORY_LLAMA
) -> tuple[dict[str, float], list[torch.nn.Module], list[torch.Tensor]]:
    """(plan bytes, blocks on `device`, one input a microbatch in flight on `device`) of one
    stage kind: "full" (blocks 1..3 of bench-small), or "lora-BASE" (`llama`'s layers,
    adapters on every linear layer, the base as BASE)."""
    t, gen = MEMORY_TRAIN, torch.Generator().manual_seed(0)
    if kind == "full":
        model = get_model("bench-small")
        blocks = model.build_stage(0, 1, 4, device=device)
        spec = model.output_spec(0, t.microbatch)
        shape, first, stop, train = model_shape(model), 1, 4, t
    else:
        base = kind.removeprefix("lora-")
        c = llama
        config = {"hidden_size": c.hidden, "intermediate_size": c.mlp_hidden,
                  "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads,
                  "max_position_embeddings": c.seq_len, "rms_norm_eps": 1e-6,
                  "rope_theta": 1e4}  # fmt: skip
        lora = LoRAConfig(rank=t.lora_rank, alpha=16.0, targets=LLAMA_LINEARS, base=base)
        blocks = []
        for i in range(c.layers):  # one layer at a time on the host, stored as `base` says
            layer = LlamaLayer(config)
            freeze(layer, lora, seed=0, index=i + 1)
            blocks.append(to_device(layer, device))
        shape, first, stop = c.shape("memory-llama", torch.float32), 1, 1 + c.layers
        train = dataclasses.replace(t, mode="lora", base=base)  # type: ignore[arg-type]
        spec = TensorSpec("hidden", (t.microbatch, c.seq_len, c.hidden), torch.float32)
    inputs = [
        torch.randn(spec.shape, generator=gen).to(device or "cpu") for _ in range(t.in_flight)
    ]
    return stage_memory(shape, train, first, stop), blocks, inputs


MEMORY_KINDS = ("full", "lora-bf16", "lora-nf4")


def run_memory_check(
    out: TextIO = sys.stdout, device: torch.device | None = None, jsonl: Path | None = None
) -> list[Record]:
    """The plan's bytes against the measured ones for each stage kind, on `device` (default
    the CPU; on CUDA the Llama stages have llama-300m's shape and the allocator's peak is
    measured too); prints the table, writes JSON lines to `jsonl`."""
    cuda = device is not None and device.type == "cuda"
    llama = GPU_MEMORY_LLAMA if cuda else MEMORY_LLAMA
    print("| stage | plan bytes | measured bytes | plan / measured | weights | trainable | "
          "activations (plan / measured) |" + (" allocator peak | plan / peak |" if cuda else ""),
          file=out)  # fmt: skip
    print("|---|---|---|---|---|---|---|" + ("---|---|" if cuda else ""), file=out)
    records = []
    for kind in MEMORY_KINDS:
        plan, blocks, inputs = memory_stage(kind, device, llama)
        measured = measure_stage_memory(blocks, inputs, MEMORY_TRAIN.max_staleness)
        total_plan, total = sum(plan.values()), sum(measured.values())
        record: Record = {"stage": kind, "plan": plan, "measured": measured,
                          "ratio": total_plan / total, "device": str(device or "cpu")}  # fmt: skip
        parts = [f"{plan[k]:,.0f} / {measured[k]:,.0f}" for k in plan]
        if cuda:
            peak = allocator_peak_bytes(blocks, inputs, MEMORY_TRAIN.max_staleness)
            record |= {"allocator_peak": peak, "ratio_peak": total_plan / peak}
            parts += [f"{peak:,.0f}", f"{total_plan / peak:.3f}"]
        print(f"| {kind} | {total_plan:,.0f} | {total:,.0f} | {total_plan / total:.3f} | "
              + " | ".join(parts) + " |", file=out, flush=True)  # fmt: skip
        records.append(record)
    if jsonl is not None:
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ravnest_node.bench.plan_check``."""
    parser = argparse.ArgumentParser(prog="python -m ravnest_node.bench.plan_check")
    parser.add_argument("models", nargs="*", default=list(MODELS), help="presets to check")
    parser.add_argument("--nodes", type=int, default=3, help="node processes (default 3)")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    parser.add_argument("--jsonl", type=Path, help="write the records here")
    parser.add_argument(
        "--memory", action="store_true", help="check the plan's memory per stage against a run's"
    )
    parser.add_argument(
        "--device", default="cpu", help="with --memory: the device the stages run on (cpu)"
    )
    args = parser.parse_args(argv)
    if args.memory:
        run_memory_check(device=resolve_device(args.device), jsonl=args.jsonl)
        return 0
    return run_plan_check(args.models, args.nodes, args.steps, args.jsonl)


if __name__ == "__main__":
    sys.exit(main())
