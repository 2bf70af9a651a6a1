"""`ravnest-node bench codecs`: what each codec costs and what it saves, on this machine.

Two tables:
- **micro**: for every registered codec, on a real bench-small activation and its gradient
  (batch 16, 128 x 256 values each): bits per element on the wire (lz4 included when it pays;
  the block quantisers also packed with deflate, as `auto` sends them over a bottleneck link),
  encode+decode throughput on one core, and the relative error of one round trip; and, for the
  codecs of replica averaging, the same on the parameter delta of a two-block stage;
- **convergence**: the default model trained on a local 3-node swarm for the same samples with
  each codec on activations and gradients, final loss against fp32;
- **epochs**: a multi-epoch run on a fixed dataset (what aq-delta is for), each activation codec
  against fp32: activation bytes per sample over the whole run (warm-up epoch included) and loss;
  optionally (`held_out`) the final model's loss on samples outside the dataset (held_out.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from ravnest_node.averaging import delta_codec
from ravnest_node.bench.held_out import held_out_loss
from ravnest_node.bench.suite import Suite
from ravnest_node.compression import (
    ACTIVATION_ONLY,
    CODECS,
    GRADIENT_ONLY,
    SampleReferences,
    encoder,
    get_codec,
)
from ravnest_node.compression.codecs import variant_label
from ravnest_node.compression.transform import KLT, REFRESH_FIRST, KLTBases
from ravnest_node.data import StdlibBytes
from ravnest_node.launch.demo import DemoConfig, train_quietly
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.transport.frames import (
    FrameKind,
    FrameLimits,
    Outgoing,
    TensorHeader,
    encode_frame,
    parse_frame,
)
from ravnest_node.transport.options import TransportConfig

Record = dict[str, Any]

DELTA_BLOCKS = slice(1, 3)
"""The stage whose parameter delta the micro table compresses: two transformer blocks (1.58 M
parameters in bench-small)."""
MEASURED_DELTA_CODECS = ("none", "int8-block", "int4-block", "powersgd")
DEFLATED_CODECS = ("int8-block", "int4-block")
"""Codecs the micro table also measures packed with deflate as `auto` sends them over a
bottleneck link (int4-block: activations with one scale per 256 elements, gradients with codes
-3..3; compression/codecs.py)."""


def sample_tensors(
    model_name: str = "bench-small", seed: int = 0, later_steps: int = 8
) -> dict[str, torch.Tensor]:
    """A real activation at the first stage boundary of the model, its gradient, the
    activation of the same batch `later_steps` AdamW steps later (the next visit of those
    samples in a multi-epoch run: what aq-delta compresses against the first), and the flat
    parameter delta of the DELTA_BLOCKS stage over those steps (what replicas average)."""
    model = get_model(model_name)
    blocks = torch.nn.Sequential(*model.build_blocks(seed))
    data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=seed)
    x, y = data.batch(0, 16)
    cut = max(1, model.num_blocks() // 3)
    hidden = blocks[:cut](x).detach().requires_grad_(True)
    torch.autograd.backward(model.loss(blocks[cut:](hidden), y))
    assert hidden.grad is not None
    out = {"activation": hidden.detach(), "gradient": hidden.grad.detach()}
    stage = list(blocks[DELTA_BLOCKS].parameters())
    start = torch.cat([p.detach().reshape(-1) for p in stage])
    optimizer = torch.optim.AdamW(blocks.parameters(), lr=3e-4, weight_decay=0.01)
    for step in range(1, later_steps + 1):
        optimizer.zero_grad()
        bx, by = data.batch(step, 16)
        torch.autograd.backward(model.loss(blocks(bx), by))
        optimizer.step()
    with torch.no_grad():
        out["activation_revisited"] = blocks[:cut](x)
    out["delta"] = start - torch.cat([p.detach().reshape(-1) for p in stage])
    return out


def _delta_round_trip(
    codec_name: str, x: torch.Tensor, layout: list[tuple[int, ...]], repeats: int
) -> Record:
    """Bits, throughput and error of a parameter delta through the averaging codec (codec
    payload only: the frame header adds ~130 bytes, lz4 nothing to these payloads)."""
    codec = delta_codec(codec_name, layout)
    decoder = codec if codec_name == "powersgd" else get_codec(codec_name)
    state = codec.new_state()

    def send() -> tuple[int, torch.Tensor]:
        params, payload = codec.encode(x, state)
        return len(payload), decoder.decode(memoryview(payload), x.shape, x.dtype, params)

    nbytes, decoded = send()  # from a fresh state: the residual would add to later rounds
    err = float((decoded - x).norm() / x.norm())
    started = time.perf_counter()
    for _ in range(repeats):
        send()
    seconds = (time.perf_counter() - started) / repeats
    return {
        "role": "parameter delta",
        "codec": codec_name,
        "bits_per_element": nbytes * 8 / x.numel(),
        "lz4": False,
        "deflate": False,
        "encode_decode_mb_s": x.numel() * 4 / seconds / 1e6,
        "relative_error": err,
    }


def _round_trip(
    codec_name: str,
    role: str,
    x: torch.Tensor,
    before: torch.Tensor | None,
    repeats: int,
    deflate: bool = False,
) -> Record:
    """Bits, throughput and error of `x` through frames (packed with deflate if asked). For
    aq-delta, `before` (the same samples' previous activation) is sent first, so `x` travels as
    a delta."""
    limits = FrameLimits(max_message_bytes=1 << 28)
    # Deflated rows are what `auto` sends over a bottleneck link: its int4-block variants.
    codec = encoder(
        codec_name, "activation" if role == "activation" else "gradient", bottleneck=deflate
    )
    samples = list(range(x.shape[0])) if codec_name in ACTIVATION_ONLY else []
    state = codec.new_state()
    refs: dict[str, SampleReferences | KLTBases] = {
        "t": KLTBases() if isinstance(codec, KLT) else SampleReferences()
    }

    def send(t: torch.Tensor) -> tuple[int, TensorHeader, torch.Tensor]:
        message = encode_frame(
            FrameKind.FORWARD, 0, 0, [Outgoing("t", t, codec, state, deflate)], samples=samples
        )
        frame = parse_frame(message, limits)
        tensors, commit = frame.decode_with(refs)
        commit()
        return frame.nbytes, frame.headers[0], tensors["t"]

    if before is not None:
        send(before)  # the warm-up visit
    if isinstance(codec, KLT):  # a basis learned on this tensor (in-sample: optimistic)
        for _ in range(REFRESH_FIRST + 1):
            send(x)
    # Error of one round trip from a fresh state (a residual would add to it).
    nbytes, header, decoded = send(x)
    err = float((decoded - x).norm() / x.norm())
    started = time.perf_counter()
    for _ in range(repeats):
        send(x)
    seconds = (time.perf_counter() - started) / repeats
    return {
        "role": role,
        "codec": codec_name + (variant_label(codec) + " + deflate" if deflate else ""),
        "bits_per_element": nbytes * 8 / x.numel(),
        "lz4": header.lz4,
        "deflate": header.deflate,
        "encode_decode_mb_s": x.numel() * 4 / seconds / 1e6,
        "relative_error": err,
    }


def micro_table(repeats: int = 10) -> list[Record]:
    """Bits per element, MB/s and error of every codec on real tensors, one thread. aq-delta
    is measured on a revisit: the same samples' activation 8 training steps after the first;
    the averaging codecs on the delta of a bench-small stage over those 8 steps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tensors = sample_tensors()
        rows = []
        for role in ("activation", "gradient"):
            x = tensors[role]
            for name in CODECS:
                if (role == "activation" and name in GRADIENT_ONLY) or (
                    role == "gradient" and name in ACTIVATION_ONLY
                ):
                    continue
                if name in ACTIVATION_ONLY:
                    revisit = tensors["activation_revisited"]
                    rows.append(_round_trip(name, role, revisit, x, repeats))
                else:
                    rows.append(_round_trip(name, role, x, None, repeats))
                if name in DEFLATED_CODECS:
                    rows.append(_round_trip(name, role, x, None, repeats, deflate=True))
        blocks = get_model("bench-small").build_blocks(0)[DELTA_BLOCKS]
        layout = [tuple(p.shape) for b in blocks for p in b.parameters()]
        for name in MEASURED_DELTA_CODECS:
            rows.append(_delta_round_trip(name, tensors["delta"], layout, repeats))
        return rows
    finally:
        torch.set_num_threads(threads)


# (activation codec, gradient codec) pairs the convergence table trains with.
PAIRS = [
    ("none", "none"),
    ("fp16", "fp16"),
    ("bf16", "bf16"),
    ("int8-block", "int8-block"),
    ("int4-block", "int8-block"),
    ("int4-block", "int4-block"),
    ("int8-block", "topk-ef"),
    ("klt", "klt"),
]
QUICK_PAIRS = [("none", "none"), ("int8-block", "int8-block"), ("int4-block", "int4-block")]
"""--quick: fp32 and the two block quantisers only (each row is a swarm run of ~10 s)."""


# Activation codecs the multi-epoch table compares (gradients travel as fp32 there).
EPOCH_CODECS = ["none", "int4-block", "aq-delta", "aq-delta2"]
QUICK_EPOCH_CODECS = ["none", "aq-delta", "aq-delta2"]


def convergence_table(
    train: TrainConfig,
    work_dir: Path,
    pairs: list[tuple[str, str]],
    last: int = 5,
    transport: TransportConfig | None = None,
) -> list[Record]:
    """Train on 3 local nodes with each (activation, gradient) codec pair; loss against fp32
    (the mean of the last `last` steps' losses)."""
    rows: list[Record] = []
    for act, grad in pairs:
        name = f"{act}/{grad}"
        run_dir = work_dir / f"{act}-{grad}"
        cfg = DemoConfig(
            nodes=3,
            work_dir=run_dir,
            compute_threads=1,
            # Synchronous, so that the codec is the only difference between rows.
            train=dataclasses.replace(
                train, activation_codec=act, gradient_codec=grad, max_staleness=0
            ),
            transport=transport or TransportConfig(),
        )
        summary = train_quietly(cfg)
        if summary is None:
            break
        rows.append(
            {
                "codec": name,
                "steps": summary["steps"],
                "samples": summary["samples"],
                "epochs": summary["epochs"],
                "final_loss": summary["final_loss"],
                "mean_loss_last": _mean(summary["loss_history"][-last:]),
                "bytes_per_sample": summary["bytes_per_sample"],
                "activation_bytes_per_sample": summary["activation_bytes_per_sample"],
            }
        )
    base = next((r for r in rows if r["codec"] == "none/none"), None)
    for r in rows:
        if base is not None:
            r["loss_gap"] = r["mean_loss_last"] / base["mean_loss_last"] - 1
            r["bytes_ratio_vs_fp32"] = base["bytes_per_sample"] / r["bytes_per_sample"]
            r["activation_ratio_vs_fp32"] = (
                base["activation_bytes_per_sample"] / r["activation_bytes_per_sample"]
            )
    return rows


def epochs_table(
    train: TrainConfig,
    work_dir: Path,
    dataset_samples: int,
    epochs: int,
    codecs: list[str],
    transport: TransportConfig | None = None,
    held_out: int = 0,
) -> list[Record]:
    """The multi-epoch runs: `epochs` passes over a fixed dataset, each activation codec of
    `codecs` with fp32 gradients; loss gap over the last epoch. With `held_out` > 0, also the
    final model's loss on that many samples outside the dataset (`held_out_loss`) and its gap."""
    steps_per_epoch = dataset_samples // train.batch_size
    run = dataclasses.replace(
        train, dataset_samples=dataset_samples, steps=epochs * steps_per_epoch
    )
    pairs = [(codec, "none") for codec in codecs]
    rows = convergence_table(run, work_dir / "epochs", pairs, steps_per_epoch, transport)
    if held_out:
        for r in rows:
            act = r["codec"].split("/")[0]
            r["held_out_loss"] = held_out_loss(run, work_dir / "epochs" / f"{act}-none", held_out)
        base = next((r for r in rows if r["codec"] == "none/none"), None)
        for r in rows:
            if base is not None:
                r["held_out_gap"] = r["held_out_loss"] / base["held_out_loss"] - 1
    return rows


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


Column = tuple[str, str, str]
"""A table column: the record's key, the column's title, the format spec of its values."""
MICRO_COLUMNS: list[Column] = [
    ("role", "tensor", "s"),
    ("codec", "codec", "s"),
    ("bits_per_element", "bits/element", ".3f"),
    ("encode_decode_mb_s", "encode+decode MB/s", ".0f"),
    ("relative_error", "relative error", ".2e"),
    ("lz4", "lz4 used", ""),
    ("deflate", "deflate used", ""),
]
CONVERGENCE_COLUMNS: list[Column] = [
    ("codec", "codecs (activation/gradient)", "s"),
    ("samples", "samples", "d"),
    ("final_loss", "final loss", ".4f"),
    ("mean_loss_last", "mean loss, last 5 steps", ".4f"),
    ("loss_gap", "gap vs fp32", "+.2%"),
    ("bytes_per_sample", "bytes/sample", ",.0f"),
    ("bytes_ratio_vs_fp32", "fewer bytes than fp32", ".1f"),
]
EPOCH_COLUMNS: list[Column] = [
    ("codec", "codecs (activation/gradient)", "s"),
    ("samples", "samples", "d"),
    ("final_loss", "final loss", ".4f"),
    ("mean_loss_last", "mean loss, last epoch", ".4f"),
    ("loss_gap", "gap vs fp32", "+.2%"),
    ("activation_bytes_per_sample", "activation bytes/sample", ",.0f"),
    ("activation_ratio_vs_fp32", "fewer activation bytes than fp32", ".1f"),
]


def _md(rows: list[Record], columns: list[Column]) -> str:
    head = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = []
    for r in rows:
        cells = []
        for key, _, spec in columns:
            value = r.get(key)
            bad = value is None or (isinstance(value, float) and math.isnan(value))
            cells.append("-" if bad else format(value, spec))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([head, rule, *body]) + "\n"


def run_codec_bench(suite: Suite) -> int:
    """The `bench codecs` command (its swarms with `suite.transport`)."""
    train = suite.train
    print("codec micro-benchmark (one core, real bench-small tensors):", file=suite.out, flush=True)
    micro = micro_table(repeats=3 if suite.quick else 10)
    micro_md = _md(micro, MICRO_COLUMNS)
    print(micro_md, file=suite.out, flush=True)
    steps = 10 if suite.quick else train.steps
    print(f"convergence: {train.model}, {steps} steps, 3 nodes, codecs activation/gradient",
          file=suite.out, flush=True)  # fmt: skip
    pairs = QUICK_PAIRS if suite.quick else PAIRS
    conv = convergence_table(
        dataclasses.replace(train, steps=steps), suite.work_dir, pairs, transport=suite.transport
    )
    conv_md = _md(conv, CONVERGENCE_COLUMNS)
    print(conv_md, file=suite.out, flush=True)
    dataset, epochs = (2 * train.batch_size, 6) if suite.quick else (8 * train.batch_size, 12)
    print(f"epochs: {train.model}, {epochs} epochs of a fixed dataset of {dataset} samples, "
          "3 nodes, activation codecs (gradients fp32)", file=suite.out, flush=True)  # fmt: skip
    codecs = QUICK_EPOCH_CODECS if suite.quick else EPOCH_CODECS
    multi = epochs_table(train, suite.work_dir, dataset, epochs, codecs, suite.transport)
    multi_md = _md(multi, EPOCH_COLUMNS)
    print(multi_md, file=suite.out, flush=True)
    suite.jsonl.parent.mkdir(parents=True, exist_ok=True)
    with open(suite.jsonl, "w") as f:
        for r in micro:
            f.write(json.dumps({"table": "micro", **r}) + "\n")
        for r in conv:
            f.write(json.dumps({"table": "convergence", **r}) + "\n")
        for r in multi:
            f.write(json.dumps({"table": "epochs", **r}) + "\n")
    suite.jsonl.with_suffix(".md").write_text(micro_md + "\n" + conv_md + "\n" + multi_md)
    print(f"wrote {suite.jsonl} and {suite.jsonl.with_suffix('.md')}", file=suite.out, flush=True)
    return 0
