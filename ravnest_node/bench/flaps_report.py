"""The figures and table of `ravnest-node bench flaps` (issue #34), from what a scenario recorded.

Pure functions, no sockets: each takes what `bench.flaps` measured (a step timeline polled
from the nodes, the coordinator's summary, the daemons' logs) and derives the columns the
issue asks for. A figure whose inputs were not measured (no summary, no clean run to compare
with) stays None and prints as "-": nothing here is estimated.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

LOSS_TAIL = 10
"""The final loss is the mean of the last this many steps' losses (one step's is noisy)."""

_LOG_LEVEL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (WARNING|ERROR|CRITICAL) ")


def longest_stall_s(progress: Sequence[tuple[float, int]]) -> float:
    """The longest time (s) in which the run made no new step: between two successive moments
    at which the highest version any node had reported rose (a step redone after a restore is
    no new step). `progress`: (time s, version) pairs in any order, from every node; 0.0 with
    fewer than two rises. Its resolution is the polling period."""
    best, rises = -1, []
    for t, version in sorted(progress):
        if version > best:
            best = version
            rises.append(t)
    return max((b - a for a, b in itertools.pairwise(rises)), default=0.0)


def warning_lines(log_text: str) -> int:
    """Lines of a text-format node log at WARNING or above."""
    return sum(1 for line in log_text.splitlines() if _LOG_LEVEL.match(line))


def summary_figures(summary: dict[str, Any] | None, steps: int, batch_size: int) -> dict[str, Any]:
    """What a scenario reports from the coordinator's summary.json (None: the run never
    finished, every figure None and samples_ok False)."""
    if summary is None:
        return {
            "wall_s": None,
            "samples": None,
            "samples_expected": steps * batch_size,
            "samples_ok": False,
            "plans": [],
            "redone_microbatches": None,
            "final_loss": None,
            "samples_per_s": None,
        }
    history = summary.get("loss_history") or []
    tail = history[-LOSS_TAIL:]
    return {
        "wall_s": summary["wall_s"],
        "samples": summary["samples"],
        "samples_expected": steps * batch_size,
        "samples_ok": summary["samples"] == steps * batch_size and summary["steps"] == steps,
        "plans": [[p["epoch"], p["start_step"], p["nodes"]] for p in summary.get("plans", [])],
        "redone_microbatches": summary.get("redone_microbatches"),
        "final_loss": sum(tail) / len(tail) if tail else summary.get("final_loss"),
        "samples_per_s": summary.get("samples_per_s"),
    }


def against_clean(record: dict[str, Any], clean: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of `record` relative to the clean run's (`clean`, None if it was not run or
    did not finish): time lost (s), time lost minus the outage, final loss difference (%),
    samples/s ratio."""
    out: dict[str, Any] = {
        "lost_s": None,
        "lost_minus_outage_s": None,
        "loss_diff_pct": None,
        "rate_vs_clean": None,
    }
    if clean is None:
        return out
    if record["wall_s"] is not None and clean["wall_s"] is not None:
        out["lost_s"] = record["wall_s"] - clean["wall_s"]
        out["lost_minus_outage_s"] = out["lost_s"] - record["outage_s"]
    if record["final_loss"] is not None and clean["final_loss"]:
        out["loss_diff_pct"] = (
            100 * (record["final_loss"] - clean["final_loss"]) / clean["final_loss"]
        )
    if record["samples_per_s"] is not None and clean["samples_per_s"]:
        out["rate_vs_clean"] = record["samples_per_s"] / clean["samples_per_s"]
    return out


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEADER = (
    "| scenario | wall s | lost s | outage s | lost - outage s | longest stall s | plans "
    "(epoch:nodes) | redone mb | samples (= steps x batch) | final loss (vs clean) | "
    "samples/s (x clean) | daemons alive at end | exit codes | warning lines per node |"
)


def table(records: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the scenarios' records, one row each, in their order."""
    rows = [HEADER, "|" + "---|" * HEADER.count(" | ") + "---|"]
    for r in records:
        plans = " ".join(f"{e}:{n}" for e, _, n in r["plans"]) or "-"
        samples = (
            f"{_f(r['samples'], 'd')} {'=' if r['samples_ok'] else '!='} {r['samples_expected']}"
        )
        alive = sum(r["running_at_end"])
        outage = f"{r['outage_s']:.1f}" + (
            " (run ended in it)" if r["run_ended_during_outage"] else ""
        )
        rows.append(
            f"| {r['scenario']} | {_f(r['wall_s'], '.1f')} | {_f(r['lost_s'], '+.1f')} "
            f"| {outage} | {_f(r['lost_minus_outage_s'], '+.1f')} "
            f"| {r['longest_stall_s']:.1f} | {plans} | {_f(r['redone_microbatches'], 'd')} "
            f"| {samples} | {_f(r['final_loss'], '.4f')} ({_f(r['loss_diff_pct'], '+.2f')}%) "
            f"| {_f(r['samples_per_s'], '.1f')} (x{_f(r['rate_vs_clean'], '.2f')}) "
            f"| {alive}/{len(r['running_at_end'])} | {r['exit_codes']} "
            f"| {r['warning_lines']} |"
        )
    return "\n".join(rows)
