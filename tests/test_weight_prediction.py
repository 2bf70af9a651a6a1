"""Weight prediction: a forward that runs ahead of its step's update uses the weights AdamW's
moments predict for that step, and every microbatch of a step uses the same snapshot."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.stage import StageRuntime
from ravnest_node.transport.frames import FrameLimits, parse_frame

from .conftest import tiny_middle_stage

M = 4  # microbatches per step
Grads = dict[str, torch.Tensor]


def _stage(pool: ThreadPoolExecutor, predict: bool) -> StageRuntime:
    """The middle stage of tiny, asynchronous from the first step."""
    run = TrainConfig(
        model="tiny", steps=8, batch_size=16, microbatches=M, max_staleness=2,
        staleness_warmup_steps=0, weight_prediction=predict, codec="none",
    )  # fmt: skip
    return tiny_middle_stage(pool, run)


def _step(stage: StageRuntime, grads: Grads) -> None:
    """One optimizer step with these gradients, as the stage applies it."""
    for name, p in stage._params.items():
        p.grad = grads[name].clone()
    stage._optimizer_step()
    stage.version += 1


def _stepped(pool: ThreadPoolExecutor, predict: bool) -> tuple[StageRuntime, Grads]:
    """A stage (seed 0) one step into training, AdamW's moments set, and that step's gradients."""
    torch.manual_seed(0)
    stage = _stage(pool, predict)
    grads = {name: torch.randn_like(p) for name, p in stage._params.items()}
    _step(stage, grads)
    return stage, grads


def _params(stage: StageRuntime) -> Grads:
    return {name: p.detach().clone() for name, p in stage._params.items()}


@pytest.mark.parametrize("ahead", [1, 2])
def test_under_a_constant_gradient_the_prediction_is_the_step_it_predicts(ahead: int) -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, grads = _stepped(pool, predict=True)
        plain, _ = _stepped(pool, predict=False)  # the same weights and moments
        before = _params(stage)
        # The first microbatch of step 1 + ahead runs forward at version 1.
        seq = (1 + ahead) * M
        version, predicted = stage._weights(seq)
        _, unpredicted = plain._weights(seq)
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
        version, weights = stage._weights(1 * M)  # step 1 at version 1: synchronous
        assert version == 1
        for name, p in stage._params.items():
            assert torch.equal(weights[name], p.detach())


def test_every_microbatch_of_a_step_uses_one_snapshot_until_the_step_is_fed() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, grads = _stepped(pool, predict=True)
        first = stage._weights(2 * M)  # step 2 at version 1: predicted one step ahead
        _step(stage, grads)  # version 2 before the step's other microbatches run
        for i in range(1, M):
            assert stage._weights(2 * M + i) is first  # the same version and tensors
        assert stage._live_versions == 0  # released once its last microbatch ran forward
        fresh = stage._weights(3 * M)
        assert fresh is not first and fresh[0] == 2


def test_without_prediction_a_version_has_one_snapshot_dropped_at_the_update() -> None:
    with ThreadPoolExecutor(1) as pool:
        stage, grads = _stepped(pool, predict=False)
        shared = stage._weights(1 * M)
        assert stage._weights(2 * M) is shared  # steps 1 and 2 at version 1: the same weights
        _step(stage, grads)
        fresh = stage._weights(1 * M + 1)  # a later microbatch of step 1, after the update
        assert fresh is not shared and fresh[0] == 2
        for name, p in stage._params.items():
            assert torch.equal(fresh[1][name], p.detach())


def test_a_forward_runs_on_the_predicted_weights_and_its_frame_carries_their_version() -> None:
    x, targets = torch.randn(M, 32, 64), torch.zeros(M, 32, dtype=torch.uint8)
    outs = {}
    with ThreadPoolExecutor(1) as pool:
        for predict in (True, False):
            stage, _ = _stepped(pool, predict)
            seq = 2 * M  # step 2 at version 1
            message = stage._forward(seq, {"hidden": x.clone(), "targets": targets}, ())
            frame = parse_frame(message, FrameLimits(max_message_bytes=1 << 24))
            assert frame.version == 1 and stage._in_flight[seq].version == 1
            outs[predict] = frame.decode_with({})[0]["hidden"]
            weights = stage._in_flight[seq].weights
            expected = torch.func.functional_call(stage._blocks, weights, (x,))
            assert torch.equal(outs[predict], expected.detach())
    assert not torch.allclose(outs[True], outs[False])


def test_the_setting_travels_in_the_run_spec() -> None:
    for predict in (True, False):
        config = TrainConfig(model="tiny", weight_prediction=predict)
        assert TrainConfig.from_proto(config.to_proto("x")).weight_prediction is predict
