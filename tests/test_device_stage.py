"""The stage on its device, without a GPU: no tensor of the forward/backward path is created
without a device (it would land on the CPU beside CUDA weights), block state leaves a stage as
CPU tensors and comes back onto the stage's device, and `--device` is checked at start-up.
The same paths on CUDA: tests/gpu/test_cuda_stage.py."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ravnest_node.blocks import export_blocks, restore_blocks
from ravnest_node.daemon.config import ComputeConfig
from ravnest_node.errors import ConfigError
from ravnest_node.launch.demo import DemoConfig
from ravnest_node.models import get_model
from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import HIDDEN, TARGETS, StageSpec

MODELS = ["tiny", "small", "bench-small"]
"""Models whose stages must create no tensor without a device (the lead extends this list with
the pretrained families once their blocks pass)."""

FACTORIES = frozenset({
    torch.arange, torch.empty, torch.eye, torch.full, torch.linspace, torch.ones, torch.rand,
    torch.randint, torch.randn, torch.randperm, torch.tensor, torch.zeros, torch.as_tensor,
})  # fmt: skip
"""torch functions that make a tensor from nothing, on the CPU unless told a device."""


class FactoryWatch(TorchFunctionMode):
    """Records every call of a FACTORIES function that names no device, with where it came
    from (the torch function mode sees each call made from Python while it is active)."""

    def __init__(self) -> None:
        super().__init__()
        self.undeviced: list[str] = []

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = traceback.extract_stack(limit=3)[0]
            self.undeviced.append(f"torch.{func.__name__} at {caller.filename}:{caller.lineno}")
        return func(*args, **kwargs)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


def _stage(pool: ThreadPoolExecutor, name: str, run: TrainConfig, spec: StageSpec) -> StageCompute:
    model = get_model(name)
    blocks = model.build_stage(run.seed, spec.first_block, spec.stop_block)
    return StageCompute(spec=spec, model=model, blocks=blocks, run=run, executor=pool)


def _two_stages(
    pool: ThreadPoolExecutor, name: str, run: TrainConfig
) -> tuple[StageCompute, StageCompute]:
    n = get_model(name).num_blocks()
    cut = n // 2
    first = _stage(pool, name, run, StageSpec(index=0, num_stages=2, first_block=0, stop_block=cut))
    last = _stage(pool, name, run, StageSpec(index=1, num_stages=2, first_block=cut, stop_block=n))
    return first, last


def _microbatch(name: str, rows: int) -> dict[str, torch.Tensor]:
    """What the first stage feeds and the last one receives, made outside any watch."""
    model = get_model(name)
    spec, hidden = model.input_spec(rows), model.output_spec(model.num_blocks() // 2 - 1, rows)
    gen = torch.Generator().manual_seed(1)
    return {
        "tokens": torch.randint(0, 256, spec.shape, generator=gen).to(spec.dtype),
        "targets": torch.randint(0, 256, model.target_spec(rows).shape, generator=gen).to(
            model.target_spec(rows).dtype
        ),
        "hidden": torch.randn(hidden.shape, generator=gen),
        "grad": torch.randn(hidden.shape, generator=gen) * 1e-3,
    }


def _one_microbatch(first: StageCompute, last: StageCompute, mb: dict[str, torch.Tensor]) -> None:
    """One microbatch through both stages: forward, forward + loss + backward, backward."""
    first.forward(0, 0, {HIDDEN: mb["tokens"], TARGETS: mb["targets"]}, ())
    last.forward_loss_backward(0, 0, {HIDDEN: mb["hidden"], TARGETS: mb["targets"]})
    first.backward(0, mb["grad"])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", [False, True], ids=["graph", "recompute"])
@pytest.mark.parametrize("name", MODELS)
def test_no_tensor_is_created_without_a_device(
    pool: ThreadPoolExecutor, name: str, recompute: bool, precision: str
) -> None:
    run = TrainConfig(model=name, batch_size=2, microbatches=1, codec="none",
                      recompute=recompute, precision=precision)  # fmt: skip
    first, last = _two_stages(pool, name, run)
    mb = _microbatch(name, 2)
    with FactoryWatch() as watch:
        _one_microbatch(first, last, mb)
    assert watch.undeviced == []
    # (and the microbatch did run: both stages hold gradients for their step)
    assert all(p.grad is not None for p in first.weights.params.values())
    assert all(p.grad is not None for p in last.weights.params.values())


def test_the_watch_catches_a_factory_without_a_device() -> None:
    """(The test above can fail: a block that makes a CPU tensor is caught.)"""

    class Careless(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[-1])

    class Careful(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[-1], device=x.device)

    x = torch.zeros(2, 3)
    with FactoryWatch() as watch:
        Careful()(x)
    assert watch.undeviced == []
    with FactoryWatch() as watch:
        Careless()(x)
    assert len(watch.undeviced) == 1 and "torch.arange" in watch.undeviced[0]


def test_exported_blocks_are_cpu_copies_and_restore_onto_the_stage_device(
    pool: ThreadPoolExecutor,
) -> None:
    run = TrainConfig(model="tiny", batch_size=2, microbatches=1, codec="none")
    first, last = _two_stages(pool, "tiny", run)
    _one_microbatch(first, last, _microbatch("tiny", 2))
    first.optimizer_step()
    exported = first.export(version=1)
    for state in exported.values():
        assert state.optimizer_step == 1.0
        for t in state.tensors.values():
            assert t.device.type == "cpu" and t.dtype == torch.float32
    # Copies, not views: the stage training on does not change what was exported.
    before = {k: t.clone() for k, t in exported[0].tensors.items()}
    with torch.no_grad():
        for p in first.weights.params.values():
            p.add_(1.0)
    assert all(torch.equal(exported[0].tensors[k], t) for k, t in before.items())

    # Restored onto a stage whose parameters live elsewhere: its moments go there too (the
    # "meta" device stands in for a GPU: no data, but every tensor says where it is).
    blocks = torch.nn.Sequential(*get_model("tiny").build_stage(0, 0, 2)).to("meta")
    optimizer = torch.optim.AdamW(blocks.parameters())
    restore_blocks(blocks, 0, optimizer, exported)
    for p in blocks.parameters():
        state = optimizer.state[p]
        assert state["exp_avg"].device.type == "meta"
        assert state["exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"  # where torch's unfused AdamW keeps it
    again = export_blocks(torch.nn.Sequential(*first.blocks), 0, first.weights.optimizer, 1)
    assert all(t.device.type == "cpu" for s in again.values() for t in s.tensors.values())


@pytest.mark.parametrize("device", ["nonsense", "tpu", "cuda:7"])
def test_a_device_the_machine_lacks_is_refused_at_start_up(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ConfigError, match="--device"):
        ComputeConfig(device=device)
    with pytest.raises(ConfigError, match="--device"):
        DemoConfig(device=device)


def test_the_stage_computes_on_the_device_it_is_given(pool: ThreadPoolExecutor) -> None:
    assert ComputeConfig(device="cpu").device == "cpu"
    run = TrainConfig(model="tiny", batch_size=2, microbatches=1, codec="none")
    stage = _stage(pool, "tiny", run, StageSpec(index=0, num_stages=1, first_block=0, stop_block=4))
    assert stage.device == torch.device("cpu")
    assert stage.precision == "fp32"  # auto on the CPU
    assert all(p.device.type == "cpu" for p in stage.blocks.parameters())
