"""The planner's memory per stage agrees with what a run keeps (bench/plan_check.py
--memory), and a 70B LoRA on an nf4 base fits four 24 GB cards."""

from __future__ import annotations

import io

from ravnest_node.bench.plan_check import MEMORY_KINDS, run_memory_check
from ravnest_node.coordination.planning.estimate import NodeGroup, Training, estimate
from ravnest_node.coordination.planning.placement import Link
from ravnest_node.coordination.planning.shapes import LLAMA_PRESETS


def test_plan_and_measured_memory_agree_within_15_percent() -> None:
    out = io.StringIO()
    records = run_memory_check(out)
    assert [r["stage"] for r in records] == list(MEMORY_KINDS)
    for r in records:
        assert 0.85 <= r["ratio"] <= 1.15, (r["stage"], r["ratio"])
    nf4, bf16 = records[2]["measured"]["weights"], records[1]["measured"]["weights"]
    assert nf4 < 0.3 * bf16  # the base itself: 4 bits and scales against 16 bits
    assert "| lora-nf4 |" in out.getvalue()


def test_llama_70b_lora_on_nf4_fits_four_24gb_cards() -> None:
    shape = LLAMA_PRESETS["llama-70b"].shape("llama-70b")
    cards = [NodeGroup(count=4, memory_bytes=24 * 2**30, flops_per_s=71e12 * 0.4,
                       label="24 GiB", reserve_bytes=2**30)]  # fmt: skip
    t = Training(mode="lora", base="nf4", batch_size=4, microbatches=4)
    plan = estimate(shape, cards, Link(1e9), t)
    assert len(plan.stages) == 4
    for stage in plan.stages:
        assert stage.memory["total"] <= stage.memory["usable"]
