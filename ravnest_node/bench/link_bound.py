"""What the bench reports where the link is the bottleneck (issue #33): which systems run in
full on a slow link and how naive's full run is estimated from a few steps, the warm-up and
asynchronous step times, the codecs `auto` chose, and the boundary bytes against naive's.

Pure functions of records and settings; `systems` and `efficiency` apply them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ravnest_node.bench.links import LinkSpec

Record = dict[str, Any]
"""A bench record (as `report.Record`, which imports this module)."""

SLOW_LINK_MBIT = 5.0
"""On links below this rate naive (fp32 frames, one microbatch at a time) and torch-pipelining
take minutes per step of bench-small: mobile (2 Mbit/s) and `--gpu-like` dilated links."""
ESTIMATE_STEPS = 3
"""Steps naive runs on a slow link: the first connects and probes, the other two are timed."""


def slow(link: LinkSpec | None) -> bool:
    """Whether `link` is too slow for naive and torch-pipelining to run in full."""
    return link is not None and link.rate_mbit < SLOW_LINK_MBIT


def estimated(record: Record, full_steps: int) -> Record:
    """`record`, of naive run for a few steps, as the estimate of a `full_steps` run: its steady
    step time (steps after the first) stands for every step, and its bytes per sample, which are
    the same every step with fp32 frames, are kept as measured. Its losses are of the steps run
    only: `estimated` says so, and the loss at equal samples skips it."""
    ran = record["steps"]
    return record | {
        "estimated": (
            f"ran {ran} steps on this link and extrapolated to {full_steps}: step time of steps "
            f"2-{ran} (step 1 connects), bytes per sample as measured (fp32 frames, the same "
            f"every step); losses are of the {ran} steps run"
        ),
        "estimated_steps": full_steps,
        "estimated_wall_s": record["step_s"] * full_steps,
    }


def phase_step_s(
    wall_s_by_step: Mapping[int, float], warmup_steps: int, max_staleness: int
) -> tuple[float | None, float | None]:
    """(mean seconds of a warm-up step, of an asynchronous one) from when each step (1-based)
    ended. The first `warmup_steps` steps are synchronous; step 1 is left out (it connects).
    None where a phase has no timed step (no warm-up, max_staleness 0, or a run within it)."""
    if not wall_s_by_step:
        return None, None
    last = max(wall_s_by_step)
    if max_staleness == 0:
        warmup_steps = last  # every step is synchronous
    end = min(warmup_steps, last)

    def mean(first: int, stop: int) -> float | None:
        """Mean duration of steps first+1..stop, from their end times."""
        if stop <= first or first not in wall_s_by_step or stop not in wall_s_by_step:
            return None
        return (wall_s_by_step[stop] - wall_s_by_step[first]) / (stop - first)

    warm = mean(1, end)
    later = mean(max(1, end), last) if end < last else None
    return warm, later


def codec_choice(stages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per stage of a run summary: the frames it sent per codec, activations and gradients."""
    return [
        {
            "stage": s.get("index", i),
            "activation": dict(s.get("activation_codec_frames") or {}),
            "gradient": dict(s.get("gradient_codec_frames") or {}),
        }
        for i, s in enumerate(stages)
    ]


def codec_text(choice: Sequence[Mapping[str, Any]]) -> str:
    """`codec_choice` for the table: "s0 act: klt 220, int4-block 20; s1 act: ... grad: ..."."""

    def frames(by_codec: Mapping[str, int]) -> str:
        ranked = sorted(by_codec.items(), key=lambda kv: (-kv[1], kv[0]))
        return ", ".join(f"{codec} {n}" for codec, n in ranked)

    parts = []
    for s in choice:
        roles = [
            f"{role}: {frames(s[key])}"
            for role, key in (("act", "activation"), ("grad", "gradient"))
            if s[key]
        ]
        if roles:
            parts.append(f"s{s['stage']} " + " ".join(roles))
    return "; ".join(parts)


def boundary_bytes(record: Record) -> float | None:
    """Activation plus gradient bytes per sample: what issue #33 counts."""
    a, g = record.get("activation_bytes_per_sample"), record.get("gradient_bytes_per_sample")
    return None if a is None or g is None else a + g


def versus_naive(records: Sequence[Record]) -> None:
    """Sets `boundary_bytes_per_sample` on each run and, where the scenario has a naive run
    (measured or estimated), `fewer_boundary_bytes_than_naive` = naive's / this run's."""
    naive = next((r for r in records if r["system"] == "naive" and "skipped" not in r), None)
    naive_bytes = boundary_bytes(naive) if naive else None
    for r in records:
        if "skipped" in r or (mine := boundary_bytes(r)) is None:
            continue
        r["boundary_bytes_per_sample"] = mine
        if naive_bytes and mine > 0 and r is not naive:  # compute-bound sends none
            r["fewer_boundary_bytes_than_naive"] = naive_bytes / mine
