"""`ravnest-node plan`: would this model train on these machines, and how fast?

Reads a model (a Llama preset or shape, a registered preset, or a local Hugging Face directory
``hf:DIR,...``: its config.json gives the shape, no weight is read), nodes (``16x24gb``,
``16xrtx4090``, ``8x24gb@165,8x12gb``), a link (``1gbit``, ``50mbit,20ms``) and how to train
(full or LoRA), and prints the plan of `coordination.estimate`: the stages and what each node
holds, the bytes per step on a link for every codec, and the predicted samples/s with what bounds
them; `--json` prints the same as one JSON object.

Exit status: 0 for a plan that fits; 1 when nothing fits in memory (the output says by how much);
2 for bad arguments (one line on standard error).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any, TextIO

from ravnest_node.coordination.planning.estimate import (
    ADAMW_BYTES_MOVED,
    CODECS,
    DoesNotFit,
    Estimate,
    NodeGroup,
    Training,
    estimate,
)
from ravnest_node.coordination.planning.placement import Link
from ravnest_node.coordination.planning.shapes import (
    LLAMA_PRESETS,
    LlamaConfig,
    ModelShape,
    model_shape,
)
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model, model_names
from ravnest_node.models.pretrained import PretrainedModel, parse_spec, without_lora
from ravnest_node.models.pretrained.llama import FAMILIES
from ravnest_node.transport.options import TransportConfig
from ravnest_node.units import rate_text

GIB = 2**30
TERA = 1e12


@dataclass(frozen=True, slots=True)
class Gpu:
    """A GPU's memory, dense bf16 tensor throughput and memory bandwidth."""

    memory_bytes: float
    bf16_tflops: float
    """Dense (no sparsity) bf16 tensor-core TFLOP/s with fp32 accumulation."""
    bandwidth_gbps: float
    """Memory bandwidth, GB/s."""


# Vendor figures. GeForce: NVIDIA Ampere GA102 GPU Architecture whitepaper (Table 1/Appendix,
# "Peak FP16 Tensor TFLOPS with FP32 Accumulate", dense: RTX 3080 59.5, RTX 3090 71; bf16 runs
# at the same rate) and NVIDIA Ada GPU Architecture whitepaper (Appendix A, same column: RTX 4080
# 97.5, RTX 4090 165.2). Data centre: the NVIDIA A100, A10, L4 and H100 datasheets, "BF16 Tensor
# Core", halving the figures quoted with sparsity (A100 312, A10 125, L4 121, H100 SXM 989,
# H100 PCIe 756). Memory sizes as sold (GDDR/HBM capacities are binary: a 24 GB card has
# 24 GiB); bandwidths from the same documents.
GPUS: dict[str, Gpu] = {
    "rtx3080": Gpu(10 * GIB, 59.5, 760),
    "rtx3090": Gpu(24 * GIB, 71.0, 936),
    "rtx4080": Gpu(16 * GIB, 97.5, 717),
    "rtx4090": Gpu(24 * GIB, 165.2, 1008),
    "a10": Gpu(24 * GIB, 125.0, 600),
    "l4": Gpu(24 * GIB, 121.0, 300),
    "a100-40gb": Gpu(40 * GIB, 312.0, 1555),
    "a100-80gb": Gpu(80 * GIB, 312.0, 2039),
    "h100": Gpu(80 * GIB, 989.0, 3350),
    "h100-pcie": Gpu(80 * GIB, 756.0, 2000),
}
DEFAULT_GPU = "rtx3090"
"""Whose TFLOP/s and bandwidth a node given by memory alone (``24gb``) is assumed to have."""
MFU = 0.4
"""Share of the peak a training step reaches: Llama 3 reports 38-43% bf16 MFU on H100s
(Dubey et al., arXiv 2407.21783, Table 4); `--mfu` changes it."""
RESERVE_BYTES = 1 * GIB
"""Memory a GPU node loses before any block: the CUDA context (300-600 MiB) and the cuBLAS
workspaces and allocator slack."""

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(t|g|m)i?b?", re.IGNORECASE)
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(k|m|g)(?:bit(?:/s)?|bps|b/s)", re.IGNORECASE)
_TIME = re.compile(r"(\d+(?:\.\d+)?)\s*(us|ms|s)", re.IGNORECASE)
_UNITS = {"t": 2**40, "g": 2**30, "m": 2**20, "k": 1e3}


def parse_nodes(spec: str, mfu: float = MFU) -> list[NodeGroup]:
    """Node groups from ``COUNTxWHAT[@TFLOPS]`` items separated by commas: WHAT is a GPU of
    `GPUS` (``rtx4090``) or a memory size (``24gb``, ``12GiB``), TFLOP/s is the dense bf16
    peak. ConfigError with what is wrong otherwise."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu}: give the share of the peak reached, in (0, 1]")
    groups = []
    for item in (part.strip() for part in spec.split(",")):
        match = re.fullmatch(
            r"(?:(\d+)\s*[x*]\s*)?([\w.-]+?)(?:@(\d+(?:\.\d+)?)(?:tflops)?)?", item, re.IGNORECASE
        )
        if not item or match is None:
            raise ConfigError(
                f"--nodes {spec!r}: {item!r} is not COUNTxGPU or COUNTxMEMORY[@TFLOPS], "
                "e.g. 16xrtx4090, 16x24gb, 8x24gb@165"
            )
        count = int(match.group(1) or 1)
        what, tflops = match.group(2).lower(), match.group(3)
        gpu = GPUS.get(what)
        if gpu is None:
            size = _SIZE.fullmatch(what)
            if size is None:
                raise ConfigError(
                    f"--nodes: unknown GPU {what!r}; give one of {', '.join(GPUS)} or a memory "
                    "size such as 24gb"
                )
            memory = float(size.group(1)) * _UNITS[size.group(2).lower()]
            gpu = replace(GPUS[DEFAULT_GPU], memory_bytes=memory)
            what = f"{memory / GIB:g} GiB GPU"
        peak = float(tflops) if tflops is not None else gpu.bf16_tflops
        if count < 1 or peak <= 0 or gpu.memory_bytes <= 0:
            raise ConfigError(f"--nodes {item!r}: count, memory and TFLOP/s must be positive")
        label = f"{what} ({gpu.memory_bytes / GIB:g} GiB, {peak:g} TFLOP/s bf16"
        if what not in GPUS and tflops is None:
            label += f" assumed: an {DEFAULT_GPU}'s; give e.g. 24gb@165"
        label += ")"
        groups.append(
            NodeGroup(
                count=count,
                memory_bytes=gpu.memory_bytes,
                flops_per_s=peak * TERA * mfu,
                label=label,
                optimizer_s_per_param=ADAMW_BYTES_MOVED / (gpu.bandwidth_gbps * 1e9),
                reserve_bytes=RESERVE_BYTES,
            )
        )
    return groups


def parse_link(spec: str) -> Link:
    """A link from ``RATE[,RTT]``: ``1gbit``, ``100mbit``, ``50mbit,20ms`` (rates in bits per
    second, decimal; the round trip in s, ms or us; 0 if not given)."""
    rate, _, rtt = (part.strip() for part in spec.partition(","))
    found = _RATE.fullmatch(rate)
    if found is None:
        raise ConfigError(
            f"--link {spec!r}: give a rate such as 1gbit, 100mbit or 50mbit,20ms (bits/s)"
        )
    bandwidth = float(found.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[found.group(2).lower()]
    rtt_s = 0.0
    if rtt:
        when = _TIME.fullmatch(rtt)
        if when is None:
            raise ConfigError(f"--link {spec!r}: the round trip {rtt!r} is not like 20ms")
        rtt_s = float(when.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[when.group(2).lower()]
    if bandwidth <= 0:
        raise ConfigError(f"--link {spec!r}: the rate must be more than 0")
    return Link(bandwidth_bps=bandwidth, rtt_s=rtt_s)


SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "mlp_hidden", "vocab", "seq_len")


def resolve_model(args: argparse.Namespace) -> ModelShape:
    """The model's shape: a Llama preset (its fields overridden by any shape flag), ``llama``
    with every shape flag, or a registered preset (no shape flags)."""
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if args.model in LLAMA_PRESETS:
        return replace(LLAMA_PRESETS[args.model], **given).shape(args.model)
    if args.model == "llama":
        missing = [
            f"--{k.replace('_', '-')}"
            for k in ("layers", "hidden", "heads", "vocab")
            if k not in given
        ]
        if missing:
            raise ConfigError(f"--model llama: give the shape: {' '.join(missing)}")
        given.setdefault("kv_heads", given["heads"])
        # Meta's Llama code: 2/3 of 4 x hidden, rounded up to a multiple of 256.
        given.setdefault("mlp_hidden", -(-(8 * given["hidden"] // 3) // 256) * 256)
        return LlamaConfig(**given).shape("llama")
    if given:
        raise ConfigError(f"shape flags apply to llama models, not to {args.model!r}")
    if args.model.startswith("hf:"):
        return pretrained_shape(args.model)
    if args.model not in model_names():
        raise ConfigError(
            f"unknown model {args.model!r}; choose one of "
            f"{', '.join([*LLAMA_PRESETS, 'llama', *model_names()])}"
        )
    return model_shape(get_model(args.model))


def pretrained_shape(name: str) -> ModelShape:
    """The shape of a local Hugging Face model (`models/pretrained/`), before any LoRA (the
    plan's --mode says how it trains): a Llama-shaped decoder (Llama, Mistral, Qwen) by the
    presets' formulas from its config.json; a BERT-style encoder, or a decoder whose head_dim
    is not hidden/heads (Qwen3's), measured like a registered model, on its timing blocks (one
    layer, initial values: no weight is read)."""
    spec = parse_spec(name)
    c = spec.config
    heads = int(c.get("num_attention_heads") or 1)
    head_dim = int(c.get("head_dim") or 0)
    if spec.family in FAMILIES and head_dim in (0, int(c["hidden_size"]) // heads):
        llama = LlamaConfig(
            layers=int(c["num_hidden_layers"]),
            hidden=int(c["hidden_size"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            mlp_hidden=int(c["intermediate_size"]),
            vocab=int(c["vocab_size"]),
            seq_len=spec.seq_len,
        )
        return llama.shape(name)
    return model_shape(PretrainedModel(without_lora(name)))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `plan` command's flags."""
    _add_swarm_arguments(parser)
    _add_training_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _add_swarm_arguments(parser: argparse.ArgumentParser) -> None:
    """What is planned: the model (a preset, a llama shape or a local model), the nodes and the
    link between them."""
    parser.add_argument(
        "--model",
        default="llama-8b",
        help=f"{', '.join(LLAMA_PRESETS)}, llama (give its shape), a registered model "
        f"({', '.join(model_names())}), or hf:DIR[,seq=N,lora=R,base=B...] (a local Hugging "
        "Face model, as `start --model` takes it; its LoRA options are the default --mode, "
        "--lora-rank and --base); default llama-8b",
    )
    for name in SHAPE_FLAGS:
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            metavar="N",
            help=f"llama shape: {name.replace('_', ' ')}",
        )
    parser.add_argument(
        "--nodes",
        required=True,
        metavar="SPEC",
        help="COUNTxGPU or COUNTxMEMORY[@TFLOPS], comma-separated: 16xrtx4090, "
        f"16x24gb, 8x24gb@165,8x12gb (GPUs: {', '.join(GPUS)})",
    )
    parser.add_argument(
        "--link",
        default="1gbit",
        metavar="RATE[,RTT]",
        help="the link between nodes: 1gbit, 100mbit, 50mbit,20ms (default 1gbit)",
    )


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """How the swarm trains (defaults: `Training`'s) and what a step reaches (--mfu)."""
    defaults = Training()
    parser.add_argument(
        "--mode",
        choices=["full", "lora"],
        help=f"full: train every parameter; lora: adapters, frozen base (default "
        f"{defaults.mode}, or an hf: model's lora=)",
    )
    parser.add_argument("--lora-rank", type=int, metavar="R", help=f"default {defaults.lora_rank}")
    parser.add_argument(
        "--base",
        choices=["fp32", "bf16", "int8", "nf4"],
        help=f"lora: storage of the frozen base (default {defaults.base})",
    )
    parser.add_argument(
        "--codec",
        choices=["auto", *CODECS],
        default="auto",
        help="codec of the prediction (the table shows all); default auto",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        help=f"samples per step (default {defaults.batch_size}, or where that does not fit the "
        "largest power of two below it that does)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        help=f"microbatches per step (default {defaults.microbatches}, at most the batch size)",
    )
    parser.add_argument("--max-staleness", type=int, default=defaults.max_staleness)
    parser.add_argument(
        "--audit-share",
        type=float,
        default=0.02,
        help="the run's --audit-share (its default: 0.02); stages that audit keep one more "
        "weight copy (0: no audits)",
    )
    parser.add_argument("--pipelines", type=int, default=defaults.pipelines)
    parser.add_argument(
        "--stages",
        type=int,
        default=defaults.stages,
        help="stages per pipeline (default 0: the planner chooses and may leave nodes spare)",
    )
    parser.add_argument(
        "--recompute",
        choices=["auto", "on", "off"],
        default=defaults.recompute,
        help="recompute activations in the backward (auto: only if needed)",
    )
    parser.add_argument(
        "--mfu",
        type=float,
        default=MFU,
        help=f"share of the GPUs' peak a step reaches (default {MFU})",
    )
    parser.add_argument(
        "--margin",
        type=float,
        default=defaults.margin,
        help=f"share of each node's memory kept free (default {defaults.margin})",
    )


def _training_mode(args: argparse.Namespace) -> tuple[Any, int, Any]:
    """--mode, --lora-rank and --base; where not given, an hf: model's LoRA options, then
    Training's defaults."""
    defaults = Training()
    mode, rank, base = defaults.mode, defaults.lora_rank, str(defaults.base)
    lora = parse_spec(args.model).lora if args.model.startswith("hf:") else None
    if lora is not None:
        mode, rank = "lora", lora.rank
    mode = args.mode if args.mode is not None else mode
    if lora is not None and mode == "lora":
        base = lora.base
    return (
        mode,
        args.lora_rank if args.lora_rank is not None else rank,
        args.base if args.base is not None else base,
    )


def run_plan(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """The `plan` command, printing to `out` (standard output); ConfigError for bad arguments
    (the caller exits 2)."""
    out = out or sys.stdout
    shape = resolve_model(args)
    groups = parse_nodes(args.nodes, args.mfu)
    link = parse_link(args.link)
    mode, rank, base = _training_mode(args)
    defaults = Training()
    batch = args.batch_size if args.batch_size is not None else defaults.batch_size
    training = Training(
        mode=mode,
        lora_rank=rank,
        base=base,
        batch_size=batch,
        microbatches=args.microbatches or min(defaults.microbatches, batch),
        max_staleness=args.max_staleness,
        audits=args.audit_share > 0,
        pipelines=args.pipelines,
        stages=args.stages,
        recompute=args.recompute,
        margin=args.margin,
    )
    found, shortfall, training = _fitting(shape, groups, link, training, args)
    head = _header(shape, groups, link, training, args.mfu)
    if found is None:
        hint = _hint(training)
        if args.json:
            print(
                json.dumps(head | {"fits": False, "shortfall": shortfall, "hint": hint}), file=out
            )
        else:
            _print_header(head, out)
            print(f"\n{shortfall}.\n{hint}", file=out)
        return 1
    if shortfall:  # the default batch did not fit; a smaller one does
        head["smaller_batch"] = shortfall
    record = head | to_json(found)
    if args.json:
        print(json.dumps(record), file=out)
    else:
        _print_header(head, out)
        _print_plan(record, out)
    return 0


def _fitting(
    shape: ModelShape, groups: list[NodeGroup], link: Link, t: Training, args: argparse.Namespace
) -> tuple[Estimate | None, str, Training]:
    """The estimate of `t`; where it does not fit and the batch size was not given, of the
    largest power-of-two batch below it that fits (its microbatches at most as many as before,
    at most one per sample). (estimate or None, why the first did not fit or "", the training
    estimated)."""
    try:
        return estimate(shape, groups, link, t, codec=args.codec), "", t
    except DoesNotFit as exc:
        first = str(exc)
    tried = t
    while args.batch_size is None and tried.batch_size > 1:
        batch = tried.batch_size // 2
        tried = replace(tried, batch_size=batch, microbatches=min(tried.microbatches, batch))
        try:
            found = estimate(shape, groups, link, tried, codec=args.codec)
        except DoesNotFit:
            continue
        why = first.removeprefix("does not fit: ")
        return found, f"the default batch of {t.batch_size} samples does not fit ({why})", tried
    return None, first, t


def _hint(t: Training) -> str:
    """What would need less memory."""
    if t.mode == "full":
        return "Try --mode lora (a frozen base needs no optimizer state), or more nodes."
    if t.base != "nf4":
        return "Try --base nf4 (a quarter of bf16), a smaller --batch-size, or more nodes."
    # Each stage may hold (max staleness + 1) x batch size samples between forward and
    # backward: smaller microbatches of the same batch hold as much.
    return "Try a smaller --batch-size, a shorter --seq-len, or more nodes."


def _header(
    shape: ModelShape, groups: list[NodeGroup], link: Link, t: Training, mfu: float
) -> dict[str, Any]:
    return {
        "model": {
            "name": shape.name,
            "params": shape.params,
            "blocks": len(shape.blocks),
            "tokens_per_sample": shape.tokens_per_sample,
            "activation_dtype": str(shape.activation_dtype).removeprefix("torch."),
        },
        "training": asdict(t) | {"microbatch": t.microbatch, "in_flight": t.in_flight},
        "nodes": [
            {
                "label": g.label,
                "count": g.count,
                "memory_bytes": g.memory_bytes,
                "effective_flops_per_s": g.flops_per_s,
                "mfu": mfu,
            }
            for g in groups
        ],
        "link": {"bandwidth_bps": link.bandwidth_bps, "rtt_s": link.rtt_s},
    }


def to_json(found: Estimate) -> dict[str, Any]:
    """The estimate as plain JSON values."""
    limit = TransportConfig().max_message_bytes
    frame = max((s.frame_bytes for s in found.stages), default=0)
    return {
        "fits": True,
        "recompute": found.recompute,
        "stages": [
            {
                "blocks": [s.first_block, s.stop_block],
                "owners": list(s.owners),
                "compute_s": s.compute_s,
                "send_s": s.send_s,
                "memory_bytes": s.memory,
            }
            for s in found.stages
        ],
        "spare": list(found.spare),
        "pipelines": found.training.pipelines,
        "links": found.links,
        "auto_choices": list(found.auto_choices),
        "codec": found.codec,
        "cut_for": found.cut_for,
        "largest_frame_bytes": frame,
        "frame_limit_bytes": limit,
        "predicted": {
            "samples_per_s": found.samples_per_s,
            "tokens_per_s": found.tokens_per_s,
            "step_s_per_microbatch": found.step_s,
            "bottleneck": found.bottleneck,
        },
    }


def _print_header(head: dict[str, Any], out: TextIO) -> None:
    m, t, link = head["model"], head["training"], head["link"]
    print(
        f"model    {m['name']}: {m['params'] / 1e9:.2f} B parameters in {m['blocks']} blocks, "
        f"{m['tokens_per_sample']} tokens a sample, {m['activation_dtype']} activations",
        file=out,
    )
    mode = "full fine-tuning (AdamW on every parameter)"
    if t["mode"] == "lora":
        mode = f"LoRA rank {t['lora_rank']} on every linear layer, frozen {t['base']} base"
    print(
        f"training {mode}; steps of {t['batch_size']} samples in {t['microbatches']} "
        f"microbatches, max staleness {t['max_staleness']} ({t['in_flight']} microbatches in "
        f"flight), {t['pipelines']} pipeline(s)",
        file=out,
    )
    for g in head["nodes"]:
        print(
            f"nodes    {g['count']} x {g['label']}: {g['effective_flops_per_s'] / TERA:.1f} "
            f"TFLOP/s at {g['mfu']:.0%} MFU",
            file=out,
        )
    rate, rtt_ms = rate_text(link["bandwidth_bps"]), link["rtt_s"] * 1e3
    print(f"link     {rate}, round trip {rtt_ms:g} ms", file=out)
    if "smaller_batch" in head:
        print(f"\nbatch    {head['smaller_batch']}: {t['batch_size']} samples fit", file=out)


def _codec_text(r: dict[str, Any]) -> str:
    """The prediction's codec: under `auto`, the cut it was planned for and what it sends."""
    if r["cut_for"] == r["codec"]:
        return str(r["codec"])
    return f"auto (stages cut as for {r['cut_for']}; it would send {r['codec']})"


def _print_plan(r: dict[str, Any], out: TextIO) -> None:
    recompute = "on (the backward recomputes each block's forward)" if r["recompute"] else "off"
    print(f"\nactivation recomputation: {recompute}", file=out)
    print(
        "stage  blocks     s/microbatch  link s  weights  trainable  activations  "
        "work+reserve  total / usable GiB",
        file=out,
    )
    for i, s in enumerate(r["stages"]):
        mem = {k: v / GIB for k, v in s["memory_bytes"].items()}
        print(
            f"{i:>5}  [{s['blocks'][0]:>2}, {s['blocks'][1]:>2})  {s['compute_s']:>12.3f}  "
            f"{s['send_s']:>6.3f}  {mem['weights']:>7.1f}  {mem['trainable']:>9.2f}  "
            f"{mem['activations']:>11.2f}  {mem['workspace'] + mem['reserve']:>12.1f}  "
            f"{mem['total']:>5.1f} / {mem['usable']:.1f}",
            file=out,
        )
    if r["spare"]:
        why = "would not make it faster"
        if r["training"]["stages"]:
            why = "not in the --stages asked for"
        print(f"spare nodes ({why}): {', '.join(r['spare'])}", file=out)
        used = len(r["stages"]) * r["pipelines"]
        more = (used + len(r["spare"])) // len(r["stages"])
        if more > r["pipelines"]:
            print(
                f"  try --pipelines {more}: pipelines of their own (each on its own data, "
                "replicas averaging in the background)",
                file=out,
            )
    print(
        "\ncodec        bits/elem  MB/step each way  link s/microbatch  stages  samples/s", file=out
    )
    for codec, row in r["links"].items():
        mark = " <- prediction" if codec == r["cut_for"] else ""
        print(
            f"{codec:<11}  {row['bits_per_element']:>9.2f}  "
            f"{row['bytes_per_step_each_way'] / 1e6:>16.1f}  "
            f"{row['link_s_per_microbatch']:>17.3f}  {row['stages']:>6.0f}  "
            f"{row['samples_per_s']:>9.3f}{mark}",
            file=out,
        )
    if r["auto_choices"]:
        print(f"auto would send: {', '.join(sorted(set(r['auto_choices'])))}", file=out)
    p = r["predicted"]
    print(
        f"\npredicted {p['samples_per_s']:.3f} samples/s ({p['tokens_per_s']:,.0f} tokens/s) "
        f"with {_codec_text(r)}; bottleneck: {p['bottleneck']}",
        file=out,
    )
    if r["largest_frame_bytes"] > r["frame_limit_bytes"]:
        print(
            f"note: frames of {r['largest_frame_bytes'] / 2**20:,.0f} MiB exceed the default "
            f"message limit ({r['frame_limit_bytes'] / 2**20:.0f} MiB): start the nodes with "
            f"--max-message-bytes {r['largest_frame_bytes'] + 2**20} or use smaller "
            "microbatches",
            file=out,
        )
