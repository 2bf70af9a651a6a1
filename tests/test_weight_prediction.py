"""Weight prediction: a forward that runs ahead of its step's update uses the weights AdamW's
moments predict for that step, and every microbatch of a step uses the same snapshot."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.weights import StageWeights
from ravnest_node.transport.frames import FrameLimits, parse_frame

from .conftest import tiny_middle_compute

M = 4  # microbatches per step
Grads = dict[str, torch.Tensor]


def _stage(pool: ThreadPoolExecutor, predict: bool, stale_microbatches: int = 0) -> StageCompute:
    """The compute of tiny's middle stage, asynchronous from the first step."""
    run = TrainConfig(
        model="tiny", steps=8, batch_size=16, microbatches=M, max_staleness=2,
        staleness_warmup_steps=0, weight_prediction=predict, codec="none",
        stale_microbatches=stale_microbatches,
    )  # fmt: skip
    return tiny_middle_compute(pool, run)


def _step(stage: StageCompute, grads: Grads) -> None:
    """One optimizer step with these gradients, as the stage applies it (the stage's version
    then counts one more)."""
    for name, p in stage.weights.params.items():
        p.grad = grads[name].clone()
    stage.optimizer_step()


def _stepped(
    pool: ThreadPoolExecutor, predict: bool, stale_microbatches: int = 0
) -> tuple[StageCompute, Grads]:
    """A stage (seed 0) one step into training (version 1), AdamW's moments set, and that
    step's gradients."""
    torch.manual_seed(0)
    stage = _stage(pool, predict, stale_microbatches)
    grads = {name: torch.randn_like(p) for name, p in stage.weights.params.items()}
    _step(stage, grads)
    return stage, grads


def _params(stage: StageCompute) -> Grads:
    return {name: p.detach().clone() for name, p in stage.weights.params.items()}


@pytest.mark.parametrize("ahead", [1, 2])
def test_under_a_constant_gradient_the_prediction_is_the_step_it_predicts(ahead: int) -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, grads = _stepped(pool, predict=True)
        plain, _ = _stepped(pool, predict=False)  # the same weights and moments
        before = _params(stage)
        # The first microbatch of step 1 + ahead runs forward at version 1.
        seq = (1 + ahead) * M
        version, predicted = stage.weights.for_forward(seq, version=1)
        _, unpredicted = plain.weights.for_forward(seq, version=1)
        assert version == 1
        for _ in range(ahead):
            _step(stage, grads)
        after = _params(stage)
        for name in after:
            # AdamW's moments under a constant gradient give the same update every step.
            assert torch.allclose(predicted[name], after[name], rtol=0, atol=1e-6), name
            # Without prediction the snapshot is the weights of version 1, `ahead` steps behind.
            assert torch.equal(unpredicted[name], before[name])
            assert not torch.allclose(unpredicted[name], after[name], rtol=0, atol=1e-6)


def test_a_step_that_is_not_ahead_uses_the_weights_unchanged() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, _ = _stepped(pool, predict=True)
        version, weights = stage.weights.for_forward(1 * M, version=1)  # synchronous
        assert version == 1
        for name, p in stage.weights.params.items():
            assert torch.equal(weights[name], p.detach())


def test_every_microbatch_of_a_step_uses_one_snapshot_until_the_step_is_fed() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, grads = _stepped(pool, predict=True)
        first = stage.weights.for_forward(2 * M, version=1)  # predicted one step ahead
        _step(stage, grads)  # version 2 before the step's other microbatches run
        for i in range(1, M):
            assert stage.weights.for_forward(2 * M + i, version=2) is first  # the same
        assert stage.live_versions == 0  # released once its last microbatch ran forward
        fresh = stage.weights.for_forward(3 * M, version=2)
        assert fresh is not first and fresh[0] == 2


def test_microbatches_that_waited_for_the_update_run_on_a_snapshot_of_it() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, grads = _stepped(pool, predict=True, stale_microbatches=2)
        ahead = stage.weights.for_forward(2 * M, version=1)  # predicted one step ahead
        assert stage.weights.for_forward(2 * M + 1, version=1) is ahead
        _step(stage, grads)  # the update lands before the step's other microbatches
        fresh = stage.weights.for_forward(2 * M + 2, version=2)
        assert fresh is not ahead and fresh[0] == 2
        for name, p in stage.weights.params.items():
            assert torch.equal(fresh[1][name], p.detach())  # the update's weights, unpredicted
        assert stage.weights.for_forward(2 * M + 3, version=2) is fresh
        assert stage.live_versions == 0  # released once the step's last ran forward


def test_without_prediction_a_version_has_one_snapshot_dropped_at_the_update() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, grads = _stepped(pool, predict=False)
        shared = stage.weights.for_forward(1 * M, version=1)
        # Steps 1 and 2 at version 1: the same weights.
        assert stage.weights.for_forward(2 * M, version=1) is shared
        _step(stage, grads)
        # A later microbatch of step 1, after the update.
        fresh = stage.weights.for_forward(1 * M + 1, version=2)
        assert fresh is not shared and fresh[0] == 2
        for name, p in stage.weights.params.items():
            assert torch.equal(fresh[1][name], p.detach())


def test_a_forward_runs_on_the_predicted_weights_and_its_frame_carries_their_version() -> None:
    x, targets = torch.randn(M, 32, 64), torch.zeros(M, 32, dtype=torch.uint8)
    outs = {}
    with ThreadPoolExecutor(1) as pool:
        for predict in (True, False):
            stage, _ = _stepped(pool, predict)
            seq = 2 * M  # step 2 at version 1
            message = stage.forward(seq, 1, {"hidden": x.clone(), "targets": targets}, ()).result()
            frame = parse_frame(message, FrameLimits(max_message_bytes=1 << 24))
            assert frame.version == 1 and stage.in_flight[seq].version == 1
            outs[predict] = frame.decode_with({})[0]["hidden"]
            weights = stage.in_flight[seq].weights
            expected = torch.func.functional_call(stage.blocks, weights, (x,))
            assert torch.equal(outs[predict], expected.detach())
    assert not torch.allclose(outs[True], outs[False])


def test_the_setting_travels_in_the_run_spec() -> None:
    for predict in (True, False):
        config = TrainConfig(model="tiny", weight_prediction=predict)
        assert TrainConfig.from_proto(config.to_proto("x")).weight_prediction is predict


def _weights(after: int) -> tuple[StageWeights, torch.nn.Module]:
    """Weights of a small stage (seed 0) that runs two microbatches of a step ahead, once
    `after` of the update's microbatches are in."""
    torch.manual_seed(0)
    run = TrainConfig(
        model="tiny", steps=8, batch_size=16, microbatches=M, max_staleness=1,
        staleness_warmup_steps=0, codec="none", stale_microbatches=2,
        stale_after_backwards=after,
    )  # fmt: skip
    blocks = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return StageWeights(blocks, run, first_block=0), blocks


def _backward(stage: tuple[StageWeights, torch.nn.Module], seq: int, version: int,
              x: torch.Tensor) -> None:  # fmt: skip
    """Microbatch seq's forward and backward on its snapshot, its gradients moved in."""
    weights, blocks = stage
    _, snapshot = weights.for_forward(seq, version)
    torch.func.functional_call(blocks, snapshot, (x,)).square().mean().backward()
    weights.release(snapshot)


@pytest.mark.parametrize("after", [1, 2, 3])
def test_with_the_updates_own_gradients_the_snapshot_is_the_step_they_make(after: int) -> None:
    """A step one ahead, once `after` of the update's microbatches are in, runs on AdamW's
    step with their gradient scaled to the whole step: with every microbatch alike it is
    exactly the update that lands (to float rounding), where the moments' prediction is not."""
    x = torch.randn(4, 6)
    snapshots, landed = [], []
    for setting in (after, 0):
        stage = _weights(setting)
        weights = stage[0]
        for seq in range(M):  # step 0: AdamW's moments set
            _backward(stage, seq, 0, torch.randn(4, 6))
        weights.step()
        for seq in range(M, M + after):  # step 1's first microbatches, at version 1
            _backward(stage, seq, 1, x)
        _, ahead = weights.for_forward(2 * M, version=1)  # step 2's first, one ahead
        for seq in range(M + after, 2 * M):
            _backward(stage, seq, 1, x)
        weights.step()
        snapshots.append(ahead)
        landed.append({name: p.detach().clone() for name, p in weights.params.items()})
    for name, value in landed[0].items():
        assert torch.allclose(snapshots[0][name], value, rtol=0, atol=1e-6), name
    assert any(
        not torch.allclose(snapshots[1][n], v, rtol=0, atol=1e-6) for n, v in landed[1].items()
    )


@pytest.mark.parametrize("trial_kept", [True, False])
def test_a_stage_that_stops_waiting_runs_ahead_on_the_moments(trial_kept: bool) -> None:
    """Once the stage runs the whole step ahead (pipeline/ahead.py), a step one ahead runs on
    the moments' prediction even with backwards in, and all its microbatches on that one
    snapshot; a trial undone predicts from the update's gradients again."""
    x = torch.randn(4, 6)
    stage = _weights(2)
    weights = stage[0]
    for seq in range(M):
        _backward(stage, seq, 0, torch.randn(4, 6))
    weights.step()
    weights.whole_step_ahead(True)
    if not trial_kept:
        weights.whole_step_ahead(False)
    for seq in range(M, M + 2):
        _backward(stage, seq, 1, x)
    expected = weights.snapshot(1) if trial_kept else weights.snapshot(1, with_gradients=True)
    _, ahead = weights.for_forward(2 * M, version=1)
    assert all(torch.equal(ahead[n], w) for n, w in expected.items())
    for seq in range(M + 2, 2 * M):
        _backward(stage, seq, 1, x)
    weights.step()
    later = weights.for_forward(2 * M + 2, version=2)[1]
    assert (later is ahead) == trial_kept  # (otherwise retaken: a snapshot of the update)
