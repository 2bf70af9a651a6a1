"""A stage on a CUDA device (skipped without one; run by tests/gpu/check.sh on a GPU machine):
its forward/backward in bf16 with weights, snapshots and AdamW state on the GPU, torch's fused
AdamW, received CPU tensors moved in, a checkpoint written from the GPU that resumes on the
CPU and back, and a demo of three node processes sharing the GPU."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ravnest_node.blocks import BlockWeights
from ravnest_node.checkpoint import CheckpointDir
from ravnest_node.models import get_model
from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import HIDDEN, TARGETS, StageSpec
from ravnest_node.transport.frames import FrameLimits, parse_frame
from tests.conftest import demo_summary

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
RUN = TrainConfig(model="tiny", batch_size=4, microbatches=1, codec="none", precision="bf16")
FIRST = StageSpec(index=0, num_stages=2, first_block=0, stop_block=2)
LAST = StageSpec(index=1, num_stages=2, first_block=2, stop_block=4)
LIMITS = FrameLimits(max_message_bytes=1 << 24)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def _stage(
    pool: ThreadPoolExecutor,
    spec: StageSpec,
    device: torch.device,
    restore: dict[int, BlockWeights] | None = None,
) -> StageCompute:
    model = get_model(RUN.model)
    blocks = model.build_stage(RUN.seed, spec.first_block, spec.stop_block)
    return StageCompute(spec=spec, model=model, blocks=blocks, run=RUN, executor=pool,
                        restore=restore, device=device)  # fmt: skip


def _batch(step: int) -> dict[str, torch.Tensor]:
    data = get_model(RUN.model).dataset(seed=RUN.seed, shard=0, num_shards=1, num_samples=0)
    x, y = data.batch(step, RUN.batch_size)
    return {HIDDEN: x, TARGETS: y}  # CPU tensors, as a frame decodes them


def _train_step(first: StageCompute, last: StageCompute, step: int) -> float:
    """One step through both stages, the frames encoded and decoded between them."""
    sent = parse_frame(first.forward(step, step, _batch(step), ()).result(), LIMITS).decode()
    assert sent[HIDDEN].device == CPU and sent[HIDDEN].dtype == torch.bfloat16
    message = last.forward_loss_backward(step, step, sent)
    assert message is not None
    grad = parse_frame(message.result(), LIMITS).decode()
    first.backward(step, grad["grad"])
    first.optimizer_step()
    return last.optimizer_step()


def test_a_stage_trains_on_cuda_in_bf16(pool: ThreadPoolExecutor) -> None:
    first, last = _stage(pool, FIRST, CUDA), _stage(pool, LAST, CUDA)
    assert first.precision == last.precision == "bf16"
    losses = [_train_step(first, last, step) for step in range(6)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
    for stage in (first, last):
        optimizer = stage.weights.optimizer
        assert optimizer.param_groups[0]["fused"] is True
        for p in stage.weights.params.values():
            assert p.device.type == "cuda" and p.dtype == torch.float32
            state = optimizer.state[p]
            assert state["exp_avg"].device.type == "cuda"
            assert state["exp_avg_sq"].device.type == "cuda"
            assert state["step"].device.type == "cuda"  # the fused kernel keeps it there
        snapshot = stage.weights.snapshot(ahead=1)
        assert all(w.device.type == "cuda" and w.dtype == torch.float32 for w in snapshot.values())
    assert len(first.weights.sha256()) == 64  # (through the CPU: no .numpy() on the GPU)


def test_a_cuda_checkpoint_resumes_on_the_cpu_and_back(
    pool: ThreadPoolExecutor, tmp_path: Path
) -> None:
    first, last = _stage(pool, FIRST, CUDA), _stage(pool, LAST, CUDA)
    for step in range(3):
        _train_step(first, last, step)
    store = CheckpointDir(tmp_path)
    store.save(first.export(3), step=3, run=RUN.to_proto(""), pipeline=0, stage=0, plan_epoch=1)
    _, loaded = store.load(3, get_model(RUN.model))
    assert all(t.device == CPU for s in loaded.values() for t in s.tensors.values())

    on_cpu = _stage(pool, FIRST, CPU, restore=loaded)
    for name, p in on_cpu.weights.params.items():
        assert p.device == CPU
        assert torch.equal(p, first.weights.params[name].cpu())
        state = on_cpu.weights.optimizer.state[p]
        assert torch.equal(state["exp_avg"], first.weights.optimizer.state[
            first.weights.params[name]]["exp_avg"].cpu())  # fmt: skip

    back = _stage(pool, FIRST, CUDA, restore=on_cpu.export(3))
    for name, p in back.weights.params.items():
        assert p.device.type == "cuda"
        assert torch.equal(p, first.weights.params[name])
        state = back.weights.optimizer.state[p]
        assert state["exp_avg"].device.type == "cuda" and state["step"].device.type == "cuda"
    # and the restored stage trains on from there
    _train_step(back, last, 3)


def test_three_node_processes_train_on_cuda(tmp_path: Path) -> None:
    args = ["--model", "small", "--nodes", "3", "--steps", "30", "--device", "cuda",
            "--precision", "auto", "--codec", "none"]  # fmt: skip
    summary = demo_summary(tmp_path, "cuda", *args)
    history = summary["loss_history"]
    assert sum(history[-5:]) / 5 < 0.8 * history[0], history
    for stage in summary["stages"]:
        assert stage["device"].startswith("cuda:0"), stage
        assert stage["precision"] == ("bf16" if torch.cuda.is_bf16_supported(False) else "fp32")
        assert stage["steps_skipped"] == 0
