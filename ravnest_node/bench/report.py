"""Benchmark output for people: a markdown table and a PNG plot from the JSONL records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Record = dict[str, Any]


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def markdown_table(records: Sequence[Record]) -> str:
    """One row per record (skipped systems included, with their reason)."""
    baseline = {
        r["scenario"]: r for r in records if r["system"] == "compute-bound" and "skipped" not in r
    }
    rows = [
        "| scenario | link | system | samples/s | vs compute-bound | step s | bytes/sample "
        "| efficiency | efficiency (this machine) | initial loss | final loss "
        "| loss at equal samples |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        link = r.get("link") or {}
        link_text = (
            f"{link['rate_mbit']:g} Mbit/s, {link['delay_ms']:g} ms"
            if link.get("rate_mbit")
            else "-"
        )
        if "skipped" in r:
            cells = [r["scenario"], link_text, r["system"], f"skipped: {r['skipped']}"]
            rows.append("| " + " | ".join(cells) + " |" + " |" * 8)
            continue
        base = baseline.get(r["scenario"])
        ratio = r["samples_per_s"] / base["samples_per_s"] if base else None
        rows.append(
            f"| {r['scenario']} | {link_text} | {r['system']} | {_fmt(r['samples_per_s'], '.2f')} "
            f"| {_fmt(ratio, '.2f')} | {_fmt(r['step_s'], '.3f')} "
            f"| {_fmt(r['bytes_per_sample'], ',.0f')} | {_fmt(r.get('efficiency'), '.2f')} "
            f"| {_fmt(r.get('efficiency_this_machine'), '.2f')} "
            f"| {_fmt(r['initial_loss'], '.4f')} | {_fmt(r['final_loss'], '.4f')} "
            f"| {_fmt(r.get('loss_at_equal_samples'), '.4f')} |"
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
            style = {"label": r["system"], "color": colors[r["system"]]}
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
