"""The bench where the link is the bottleneck (issue #33): the estimate of naive on a slow link,
`--gpu-like`'s dilated links in the records and the table, the warm-up/asynchronous split, the
codecs `auto` chose and the boundary bytes against naive's. Pure: no sockets, no processes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from ravnest_node.bench import link_bound
from ravnest_node.bench.config import BenchConfig
from ravnest_node.bench.efficiency import finish_scenario
from ravnest_node.bench.links import SCENARIOS, LinkSpec, dilate
from ravnest_node.bench.report import markdown_table, rounds_table
from ravnest_node.bench.scenario_links import ScenarioLinks
from ravnest_node.bench.systems import SystemRunner
from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model


def test_slow_links_are_mobile_and_dilated_ones() -> None:
    assert link_bound.slow(SCENARIOS["mobile"])
    assert link_bound.slow(dilate(SCENARIOS["internet"], 10))  # 1 Mbit/s
    assert not link_bound.slow(SCENARIOS["internet"])
    assert not link_bound.slow(None)  # compute-bound has no link


def test_the_estimate_extrapolates_the_steady_step_and_says_so() -> None:
    measured = {"system": "naive", "steps": 3, "step_s": 4.0, "samples_per_s": 8.0,
                "activation_bytes_per_sample": 100.0}  # fmt: skip
    est = link_bound.estimated(measured, 40)
    assert est["estimated_wall_s"] == 160.0 and est["estimated_steps"] == 40
    assert "ran 3 steps" in est["estimated"] and "extrapolated to 40" in est["estimated"]
    assert est["samples_per_s"] == 8.0 and est["steps"] == 3  # what ran, kept


def test_phase_split_times_warmup_and_asynchronous_steps_apart() -> None:
    # Steps 1..6 end at these times; step 1 connects. Warm-up: steps 1-3 (2 and 3 timed, 2 s
    # each); asynchronous: 4-6 (1 s each).
    ends = {1: 10.0, 2: 12.0, 3: 14.0, 4: 15.0, 5: 16.0, 6: 17.0}
    assert link_bound.phase_step_s(ends, 3, 1) == (2.0, 1.0)
    # Synchronous throughout: no asynchronous steps.
    assert link_bound.phase_step_s(ends, 3, 0) == (1.4, None)
    assert link_bound.phase_step_s(ends, 20, 1) == (1.4, None)  # the run within its warm-up
    # No warm-up: every timed step is asynchronous.
    assert link_bound.phase_step_s(ends, 0, 1) == (None, 1.4)
    assert link_bound.phase_step_s({}, 3, 1) == (None, None)


def test_codec_choice_per_stage_and_role() -> None:
    stages = [
        {"index": 0, "activation_codec_frames": {"int4-block": 20, "klt": 220}},
        {"index": 1, "activation_codec_frames": {"klt": 240},
         "gradient_codec_frames": {"bf16": 240}},
        {"index": 2, "gradient_codec_frames": {"int8-block": 240}},
    ]  # fmt: skip
    choice = link_bound.codec_choice(stages)
    assert choice[0] == {"stage": 0, "activation": {"int4-block": 20, "klt": 220}, "gradient": {}}
    assert link_bound.codec_text(choice) == (
        "s0 act: klt 220, int4-block 20; s1 act: klt 240 grad: bf16 240; s2 grad: int8-block 240"
    )


def _run(system: str, **fields: Any) -> dict[str, Any]:
    return {
        "system": system, "scenario": "mobile", "steps": 10, "step_s": 1.0,
        "samples_per_s": 32.0, "bytes_per_sample": 1000.0, "initial_loss": 5.0,
        "final_loss": 4.0, "loss_history": [5.0] * 10, "link": None, **fields,
    }  # fmt: skip


def test_boundary_bytes_against_naive_and_equal_samples_skip_an_estimate() -> None:
    link = {"rate_mbit": 2.0, "delay_ms": 80.0, "emulation": "relay"}
    naive = link_bound.estimated(
        _run("naive", steps=3, loss_history=[5.0, 4.9, 4.8], link=link,
             activation_bytes_per_sample=8000.0, gradient_bytes_per_sample=8000.0),
        10,
    )  # fmt: skip
    ours = _run("ours", link=link, activation_bytes_per_sample=600.0,
                gradient_bytes_per_sample=400.0, loss_history=[5.0] * 9 + [3.5])  # fmt: skip
    cb = _run("compute-bound", activation_bytes_per_sample=0.0, gradient_bytes_per_sample=0.0)
    records = [cb, naive, ours]
    finish_scenario(records, get_model("tiny"), BenchConfig().run_train)
    assert ours["boundary_bytes_per_sample"] == 1000.0
    assert ours["fewer_boundary_bytes_than_naive"] == 16.0
    assert "fewer_boundary_bytes_than_naive" not in cb  # sends none
    # The estimate ran 3 steps: the others are compared at their 10.
    assert ours["loss_at_equal_samples"] == 3.5 and "loss_at_equal_samples" not in naive


def test_gpu_like_must_be_at_least_one() -> None:
    assert BenchConfig().gpu_like == 1.0  # off
    with pytest.raises(ConfigError, match="gpu_like"):
        BenchConfig(gpu_like=0.5)


def test_a_gpu_like_record_keeps_the_emulated_link_and_names_the_nominal_one(
    tmp_path: Path,
) -> None:
    cfg = BenchConfig(scenario="internet", gpu_like=10)
    runner = SystemRunner(cfg, io.StringIO())
    links = ScenarioLinks(dilate(SCENARIOS["internet"], 10), "netns", tmp_path)
    base = runner._base("ours", "internet", links)
    assert base["link"]["rate_mbit"] == pytest.approx(1.0) and base["link"]["delay_ms"] == 500
    assert base["gpu_like"] == 10
    assert base["nominal_link"] == {"rate_mbit": 10, "delay_ms": 50}
    plain = SystemRunner(BenchConfig(scenario="internet"), io.StringIO())
    assert "nominal_link" not in plain._base("ours", "internet", links)


def test_the_table_says_gpu_like_and_est() -> None:
    link = {"rate_mbit": 1.0, "delay_ms": 500.0, "emulation": "netns"}
    nominal = {"rate_mbit": 10.0, "delay_ms": 50.0}
    cb = _run("compute-bound", gpu_like=10.0)
    naive = link_bound.estimated(
        _run("naive", steps=3, link=link, gpu_like=10.0, nominal_link=nominal), 10
    )
    ours = _run("ours", link=link, gpu_like=10.0, nominal_link=nominal,
                warmup_step_s=1.5, async_step_s=1.0,
                codec_frames=[{"stage": 0, "activation": {"klt": 40}, "gradient": {}}])  # fmt: skip
    table = markdown_table([cb, naive, ours])
    assert table.startswith("gpu-like x 10: links at rate/10 and delay x 10; times are this")
    assert "1 Mbit/s, 500 ms (gpu-like x 10 of 10 Mbit/s, 50 ms)" in table
    assert "32.00 est. (3 steps run)" in table
    assert "| 1.500 / 1.000 |" in table and "s0 act: klt 40" in table
    header = next(line for line in table.splitlines() if line.startswith("| scenario"))
    assert all(line.count("|") == header.count("|") for line in table.splitlines()
               if line.startswith("| "))  # fmt: skip


def test_all_scenarios_include_mobile() -> None:
    assert BenchConfig(scenario="all").scenario_names[-1] == "mobile"
    assert SCENARIOS["mobile"] == LinkSpec(2, 80)


def test_held_out_gaps_and_rounds_against_compute_bound_of_the_same_round() -> None:
    # Two rounds of one scenario: each round's ours against that round's compute-bound.
    rounds = []
    for i, (cb_speed, ours_speed, cb_loss, ours_loss) in enumerate(
        [(40.0, 36.0, 2.0, 2.04), (30.0, 30.0, 2.0, 2.01), (32.0, 24.0, 2.0, 2.1)]
    ):
        cb = _run("compute-bound", samples_per_s=cb_speed, held_out_loss=cb_loss, round=i)
        ours = _run("ours", samples_per_s=ours_speed, held_out_loss=ours_loss, round=i)
        finish_scenario([cb, ours], get_model("tiny"), BenchConfig().run_train)
        assert ours["held_out_gap"] == pytest.approx(ours_loss / cb_loss - 1)
        assert cb["held_out_gap"] == 0
        rounds += [cb, ours]
    table = markdown_table(rounds)
    assert "| 0.90 |" in table and "| 1.00 |" in table and "| 0.75 |" in table  # per round
    assert "2.0400 (+2.00%)" in table and "2.0000 (+0.00%)" in table
    summary = rounds_table(rounds)
    assert "| mobile | ours | 3 | 0.90 (0.75 to 1.00) | +2.00% (+0.50% to +5.00%) |" in summary
    assert "compute-bound" not in summary.split("\n", 2)[2]  # (the ceiling is not a row)
