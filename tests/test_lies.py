"""A dishonest stage for the tests and benchmarks of audited computation (`--fault-lie-stage S
--fault-lie-after N`, pipeline/lies.py): what it sends instead of what it computed, and what
that does to a swarm that does not check (`--audit-share 0`; the audits that catch it:
tests/test_audit_live.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ravnest_node.bench.audit_tolerance import distances
from ravnest_node.errors import ConfigError
from ravnest_node.pipeline.lies import LIES, lie
from ravnest_node.pipeline.run import TrainConfig

from .conftest import demo_summaries


def test_each_lie_is_plausible_and_wrong() -> None:
    honest = torch.randn(4, 32, 64)
    rotated = lie(honest, "rotate")
    # Every value one the stage computed, the same norm, another direction.
    assert torch.equal(rotated.sort(dim=-1).values, honest.sort(dim=-1).values)
    assert torch.isclose(rotated.norm(), honest.norm())
    cosine = torch.nn.functional.cosine_similarity(rotated.flatten(), honest.flatten(), dim=0)
    assert abs(float(cosine)) < 0.1
    assert torch.equal(lie(honest, "negate"), -honest)
    assert torch.equal(lie(honest, "scale"), 2 * honest)
    assert torch.equal(honest, honest.clone())  # (unchanged: a new tensor each time)
    with pytest.raises(ValueError, match="unknown lie"):
        lie(honest, "shout")


def test_the_settings() -> None:
    run = TrainConfig(model="tiny", fault_lie_stage=1, fault_lie_after=30, fault_lie_kind="negate")
    back = TrainConfig.from_proto(run.to_proto(""))
    assert (back.fault_lie_stage, back.fault_lie_after, back.fault_lie_kind) == (1, 30, "negate")
    assert TrainConfig.from_proto(TrainConfig(model="tiny").to_proto("")).fault_lie_stage is None
    with pytest.raises(ConfigError, match="choose one of " + ", ".join(LIES)):
        TrainConfig(model="tiny", fault_lie_stage=1, fault_lie_kind="shout")


def test_a_lying_stage_hurts_a_swarm_that_does_not_check(tmp_path: Path) -> None:
    """Four nodes, two pipelines of two stages; pipeline 0's last stage sends negated gradients
    from step 10 on (its own blocks train honestly). Synchronous and uncompressed, each
    averaging round applied one step after it began (`AveragingConfig.lands_after`): every run
    is deterministic, which the honest run given twice checks, so the comparison is the same
    every time. (Rounds applied whenever they arrived made the honest run's late loss vary by
    about 1.5% between runs and let the comparison fail now and then.)"""
    common = ("--nodes", "4", "--pipelines", "2", "--model", "tiny", "--steps", "60",
              "--seed", "0", "--max-staleness", "0", "--codec", "none", "--threads", "1",
              "--lr", "3e-3", "--audit-share", "0")  # fmt: skip
    runs = {"honest": common, "again": common,
            "liar": (*common, "--fault-lie-stage", "1", "--fault-lie-after", "10",
                     "--fault-lie-kind", "negate")}  # fmt: skip
    summaries = demo_summaries(tmp_path, runs)
    honest, liar = summaries["honest"], summaries["liar"]
    assert summaries["again"]["loss_history"] == honest["loss_history"]
    assert [s["averaging_rounds"] for s in honest["stages"]] == [3] * 4  # after 16, 32, 48
    # The same run up to step 10 (the lie starts with the gradients of step 10's microbatches).
    assert liar["loss_history"][:10] == honest["loss_history"][:10]
    # Measured: 3.228 against 3.002 over the last 20 steps (rotate: 3.025; it is subtler).
    late = [sum(s["loss_history"][-20:]) / 20 for s in (liar, honest)]
    assert late[0] > 1.04 * late[1], late
    logs = "".join(p.read_text() for p in (tmp_path / "liar").glob("node-*/node.log"))
    assert "fault injection: stage 1 sends negate activations and gradients from step 10" in logs


def test_honest_recomputations_land_far_closer_than_any_lie() -> None:
    """The audit tolerance's evidence (bench/audit_tolerance.py) on tiny's middle blocks:
    recomputed the same way the CPU gives the same bits; bf16 against fp32 stays within 5%;
    every lie is at least as far as the honest tensor is long."""
    found = distances("tiny", 1, 3, batch=4)
    assert found["fp32 again"] == (0.0, 0.0)
    assert all(d < 1e-5 for d in found["fp32, 2 threads"])
    assert all(0 < d < 0.05 for d in found["bf16"] + found["bf16, 2 threads"])
    assert all(d >= 0.99 for kind in LIES for d in found[f"lie: {kind}"])
