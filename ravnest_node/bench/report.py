"""Benchmark output for people: a markdown table and a PNG plot from the JSONL records."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ravnest_node.bench.link_bound import codec_text

Record = dict[str, Any]


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def gpu_like_note(factor: float) -> str:
    """What a `--gpu-like` run's figures are, for the table and the output."""
    return (
        f"gpu-like x {factor:g}: links at rate/{factor:g} and delay x {factor:g}; times are this "
        f"machine's (ratios to compute-bound are those of a node {factor:g}x faster on the "
        f"nominal link)"
    )


def _link_text(r: Record) -> str:
    link = r.get("link") or {}
    if not link.get("rate_mbit"):
        return "-"
    text = f"{link['rate_mbit']:g} Mbit/s, {link['delay_ms']:g} ms"
    if (nominal := r.get("nominal_link")) and r.get("gpu_like", 1) > 1:
        text += (
            f" (gpu-like x {r['gpu_like']:g} of {nominal['rate_mbit']:g} Mbit/s, "
            f"{nominal['delay_ms']:g} ms)"
        )
    return text


def _held_out(r: Record) -> str:
    if "held_out_loss" not in r:
        return "-"
    gap = r.get("held_out_gap")
    if gap is None:
        return f"{r['held_out_loss']:.4f}"
    return f"{r['held_out_loss']:.4f} ({0.0 if abs(gap) < 5e-5 else gap:+.2%})"  # (no -0.00%)


def _codecs(r: Record) -> str:
    return codec_text(r.get("codec_frames") or []) or "-"


_HEADER = (
    "| scenario | link | system | samples/s | vs compute-bound | step s | warm-up / async step s "
    "| bytes/sample | act+grad B/sample | x fewer than naive | codecs (frames per stage) "
    "| efficiency | efficiency (this machine) | initial loss | final loss "
    "| loss at equal samples | held-out loss (vs compute-bound) |"
)


def _key(r: Record) -> tuple[str, int]:
    return r["scenario"], r.get("round", 0)


def _baselines(records: Sequence[Record]) -> dict[tuple[str, int], Record]:
    """Compute-bound's record of each scenario and round (`--rounds`)."""
    return {_key(r): r for r in records if r["system"] == "compute-bound" and "skipped" not in r}


def _spread(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    middle = statistics.median(ordered)
    return f"{format(middle, spec)} ({format(ordered[0], spec)} to {format(ordered[-1], spec)})"


def rounds_table(records: Sequence[Record]) -> str:
    """Per scenario and system over the rounds of `--rounds`: how many, and the median and
    range of samples/s against compute-bound's of the same round and of the held-out gap."""
    baseline = _baselines(records)
    groups: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        if "skipped" not in r and r["system"] != "compute-bound":
            groups.setdefault((r["scenario"], r["system"]), []).append(r)
    rows = [
        "| scenario | system | rounds | vs compute-bound: median (range) "
        "| held-out gap: median (range) |",
        "|---|---|---|---|---|",
    ]
    for (scenario, system), runs in groups.items():
        ratios = [r["samples_per_s"] / base["samples_per_s"]
                  for r in runs if (base := baseline.get(_key(r)))]  # fmt: skip
        gaps = [r["held_out_gap"] for r in runs if "held_out_gap" in r]
        rows.append(f"| {scenario} | {system} | {len(runs)} | {_spread(ratios, '.2f')} "
                    f"| {_spread(gaps, '+.2%')} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def markdown_table(records: Sequence[Record]) -> str:
    """One row per record (skipped systems included, with their reason); estimated rows say
    "est.", and a gpu-like run's note comes first."""
    baseline = _baselines(records)
    columns = _HEADER.count("|") - 1
    notes = sorted({r["gpu_like"] for r in records if r.get("gpu_like", 1) > 1})
    rows = [gpu_like_note(f) + "\n" for f in notes]
    rows += [_HEADER, "|" + "---|" * columns]
    for r in records:
        link_text = _link_text(r)
        if "skipped" in r:
            cells = [r["scenario"], link_text, r["system"], f"skipped: {r['skipped']}"]
            rows.append("| " + " | ".join(cells) + " |" + " |" * (columns - len(cells)))
            continue
        base = baseline.get(_key(r))
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else None
        est = f" est. ({r['steps']} steps run)" if "estimated" in r else ""
        phases = f"{_fmt(r.get('warmup_step_s'), '.3f')} / {_fmt(r.get('async_step_s'), '.3f')}"
        rows.append(
            f"| {r['scenario']} | {link_text} | {r['system']} "
            f"| {_fmt(r['samples_per_s'], '.2f')}{est} "
            f"| {_fmt(ratio, '.2f')} | {_fmt(r['step_s'], '.3f')} | {phases} "
            f"| {_fmt(r['bytes_per_sample'], ',.0f')} "
            f"| {_fmt(r.get('boundary_bytes_per_sample'), ',.0f')} "
            f"| {_fmt(r.get('fewer_boundary_bytes_than_naive'), '.1f')} | {_codecs(r)} "
            f"| {_fmt(r.get('efficiency'), '.2f')} "
            f"| {_fmt(r.get('efficiency_this_machine'), '.2f')} "
            f"| {_fmt(r['initial_loss'], '.4f')} | {_fmt(r['final_loss'], '.4f')} "
            f"| {_fmt(r.get('loss_at_equal_samples'), '.4f')} "
            f"| {_held_out(r)} |"
        )
    return "\n".join(rows) + "\n"


def plot(records: Sequence[Record], path: Path) -> str | None:
    """Loss against wall-clock time and against bytes on wire, one line per system and
    scenario. Returns None when written, or why it was not (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]')"
    runs = [r for r in records if "skipped" not in r and r.get("curve")]
    scenarios = list(dict.fromkeys(r["scenario"] for r in runs))
    systems = list(dict.fromkeys(r["system"] for r in runs))
    colors = {system: f"C{i % 10}" for i, system in enumerate(systems)}
    fig, axes = plt.subplots(
        max(1, len(scenarios)), 2, figsize=(12, 4 * max(1, len(scenarios))), squeeze=False
    )
    for row, scenario in enumerate(scenarios):
        by_time, by_bytes = axes[row]
        for r in (r for r in runs if r["scenario"] == scenario):
            label = r["system"] + (f", round {r['round'] + 1}" if "round" in r else "")
            style = {"label": label, "color": colors[r["system"]]}
            _samples, wall, nbytes, loss = zip(*r["curve"], strict=True)
            by_time.plot(wall, loss, **style)
            if any(nbytes):
                by_bytes.plot([b / 1e6 for b in nbytes], loss, **style)
        link = next((r["link"] for r in runs if r["scenario"] == scenario and r.get("link")), None)
        where = f"{scenario}" + (
            f" ({link['rate_mbit']:g} Mbit/s, {link['delay_ms']:g} ms)" if link else ""
        )
        by_time.set(
            xlabel="wall-clock time (s)", ylabel="training loss", title=f"{where}: loss vs time"
        )
        by_bytes.set(
            xlabel="bytes on wire (MB)", ylabel="training loss", title=f"{where}: loss vs bytes"
        )
        for ax in (by_time, by_bytes):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
