"""The strongest correctness check: with max_staleness=0 and codec none, a swarm of node
processes trains exactly what one process trains."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from .conftest import demo_summaries, demo_summary

RTOL = 1e-5


SYNC = ("--seed", "0", "--max-staleness", "0", "--codec", "none")


def _demo(tmp_path: Path, name: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    return demo_summary(tmp_path, name, *SYNC, *args, timeout=timeout)


def _demos(tmp_path: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, dict[str, Any]]:
    """Synchronous fp32 runs side by side: what they train does not depend on timing."""
    return demo_summaries(tmp_path, {name: (*SYNC, *args) for name, args in runs.items()})


def assert_same_training(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Loss histories and final parameter norms agree to RTOL (relative)."""
    assert len(a["loss_history"]) == len(b["loss_history"]) == a["steps"]
    for step, (x, y) in enumerate(zip(a["loss_history"], b["loss_history"], strict=True), 1):
        assert math.isclose(x, y, rel_tol=RTOL), f"step {step}: loss {x} vs {y}"
    assert math.isclose(a["final_params_l2"], b["final_params_l2"], rel_tol=RTOL), (
        f"final_params_l2 {a['final_params_l2']} vs {b['final_params_l2']}"
    )


def _check_summary(s: dict[str, Any], nodes: int, steps: int) -> None:
    keys = "nodes steps samples wall_s initial_loss final_loss loss_history bytes_on_wire"
    for key in (*keys.split(), "bytes_per_sample", "final_params_l2"):
        assert key in s
    assert s["nodes"] == nodes and s["steps"] == steps and s["samples"] == steps * 16
    assert s["final_loss"] < s["initial_loss"]
    assert (s["bytes_on_wire"] > 0) == (nodes > 1)


def test_three_nodes_train_exactly_like_one(tmp_path: Path) -> None:
    args = ("--model", "tiny", "--steps", "12")
    runs = _demos(
        tmp_path,
        {
            "one": ("--nodes", "1", *args),
            "three": ("--nodes", "3", *args),
            "recompute": ("--nodes", "3", "--recompute", *args),
            "broken": ("--nodes", "3", "--fault-skip-step-stage", "1", *args),
        },
    )
    one, three, broken = runs["one"], runs["three"], runs["broken"]
    _check_summary(one, 1, 12)
    _check_summary(three, 3, 12)
    assert_same_training(three, one)
    # Activation recomputation runs each forward again in the backward: the same training.
    assert_same_training(runs["recompute"], one)
    # Bytes on wire are counted, not estimated: tiny's boundaries carry [4, 32, 64] float32
    # activations forward and gradients back, per microbatch, plus targets and headers.
    activation = 4 * 32 * 64 * 4
    per_step = 4 * 2 * 2 * activation  # 4 microbatches, 2 boundaries, both directions
    assert 12 * per_step < three["bytes_on_wire"] < 12 * per_step * 1.05
    # The check has teeth: a stage that skips its optimizer step is caught.
    with pytest.raises(AssertionError):
        assert_same_training(broken, one)


@pytest.mark.slow
def test_bench_small_as_the_issue_states_it(tmp_path: Path) -> None:
    """`demo --nodes 3 --steps 40 --seed 0 --max-staleness 0 --codec none` == `--nodes 1`."""
    runs = _demos(tmp_path, {"one": ("--nodes", "1", "--steps", "40"),
                             "three": ("--nodes", "3", "--steps", "40")})  # fmt: skip
    one, three = runs["one"], runs["three"]
    _check_summary(three, 3, 40)
    assert three["model"] == "bench-small"
    assert_same_training(three, one)
    # 2 boundaries x (activation + gradient) x 128 x 256 x 4 bytes per sample, plus targets.
    assert 524_288 <= three["bytes_per_sample"] < 524_288 * 1.01
