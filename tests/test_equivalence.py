"""The strongest correctness check: with max_staleness=0 and codec none, a swarm of node
processes trains exactly what one process trains, and what a plain PyTorch loop trains: every
loss and every final tensor (parameters and AdamW's moments) equal to the bit, at equal torch
threads per process (tests/training.py says why that matters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import demo_summaries
from .training import (
    Trained,
    assert_same_tensors,
    assert_same_training,
    demo_run,
    plain_training,
)

SYNC = ("--seed", "0", "--max-staleness", "0", "--codec", "none", "--threads", "1")


def _demos(
    tmp_path: Path, runs: dict[str, tuple[str, ...]]
) -> tuple[dict[str, dict[str, Any]], dict[str, Trained]]:
    """Synchronous fp32 runs side by side (what they train does not depend on timing): their
    summaries, and what each trained, by name."""
    summaries = demo_summaries(tmp_path, {name: (*SYNC, *args) for name, args in runs.items()})
    return summaries, {name: demo_run(s, tmp_path / name) for name, s in summaries.items()}


def _check_summary(s: dict[str, Any], nodes: int, steps: int) -> None:
    keys = "nodes steps samples wall_s initial_loss final_loss loss_history bytes_on_wire"
    for key in (*keys.split(), "bytes_per_sample", "final_params_l2"):
        assert key in s
    assert s["nodes"] == nodes and s["steps"] == steps and s["samples"] == steps * 16
    assert s["final_loss"] < s["initial_loss"]
    assert (s["bytes_on_wire"] > 0) == (nodes > 1)


def test_three_nodes_train_exactly_like_one_and_like_a_plain_loop(tmp_path: Path) -> None:
    args = ("--model", "tiny", "--steps", "12")
    summaries, runs = _demos(
        tmp_path,
        {
            "one": ("--nodes", "1", *args),
            "three": ("--nodes", "3", *args),
            "recompute": ("--nodes", "3", "--recompute", *args),
            "broken": ("--nodes", "3", "--fault-skip-step-stage", "1", *args),
        },
    )
    _check_summary(summaries["one"], 1, 12)
    _check_summary(summaries["three"], 3, 12)
    plain = plain_training("tiny", 12)  # at one torch thread, as every node had
    assert_same_training(runs["one"], plain)
    assert_same_training(runs["three"], plain)
    # Activation recomputation runs each forward again in the backward: the same training.
    assert_same_training(runs["recompute"], plain)
    # Bytes on wire are counted, not estimated: tiny's boundaries carry [4, 32, 64] float32
    # activations forward and gradients back, per microbatch, plus targets and headers.
    activation = 4 * 32 * 64 * 4
    per_step = 4 * 2 * 2 * activation  # 4 microbatches, 2 boundaries, both directions
    assert 12 * per_step < summaries["three"]["bytes_on_wire"] < 12 * per_step * 1.05
    # The check has teeth: a stage that skips its optimizer step is caught by its parameters
    # alone (its blocks keep their initial ones), as by its losses and its missing moments;
    # so is one parameter one float32 step away.
    with pytest.raises(AssertionError, match="tensors differ"):
        assert_same_tensors(runs["broken"].only("param"), plain.only("param"))
    with pytest.raises(AssertionError, match="losses differ"):
        assert_same_training(runs["broken"], plain)
    nudged = {**plain.tensors}
    key = (0, "param", next(name for block, _, name in nudged if block == 0))
    nudged[key] = nudged[key].clone()
    nudged[key].view(-1)[0] = torch.nextafter(nudged[key].view(-1)[0], torch.tensor(torch.inf))
    with pytest.raises(AssertionError, match=f"1 of {len(nudged)} tensors differ"):
        assert_same_tensors(runs["three"], Trained(plain.losses, nudged))


@pytest.mark.slow
def test_bench_small_as_the_issue_states_it(tmp_path: Path) -> None:
    """`demo --nodes 3 --steps 40 --seed 0 --max-staleness 0 --codec none` == `--nodes 1`
    (both with `--threads 1`: the same torch threads in every process)."""
    summaries, runs = _demos(tmp_path, {"one": ("--nodes", "1", "--steps", "40"),
                                        "three": ("--nodes", "3", "--steps", "40")})  # fmt: skip
    three = summaries["three"]
    _check_summary(three, 3, 40)
    assert three["model"] == "bench-small"
    assert_same_training(runs["three"], runs["one"])
    # 2 boundaries x (activation + gradient) x 128 x 256 x 4 bytes per sample, plus targets.
    assert 524_288 <= three["bytes_per_sample"] < 524_288 * 1.01
