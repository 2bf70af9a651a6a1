"""The block contract, held by the ByteLM presets, and the model registry.

(`torch.autograd.backward(t)` is `t.backward()`, spelled so that mypy --strict sees a typed call.)
"""

from __future__ import annotations

import pytest
import torch

from ravnest_node.coordination.planning.planner import partition
from ravnest_node.data import StdlibBytes
from ravnest_node.errors import ConfigError
from ravnest_node.models import (
    MODEL_PRESETS,
    BlockModel,
    ByteLM,
    ByteLMConfig,
    get_model,
    model_names,
    run_blocks,
)

BATCH = 2


def _params(blocks: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p for block in blocks for p in block.parameters()]


def _inputs(model: BlockModel, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x_spec, y_spec = model.input_spec(batch), model.target_spec(batch)
    x = torch.randint(0, 256, x_spec.shape, generator=gen, dtype=x_spec.dtype)
    y = torch.randint(0, 256, y_spec.shape, generator=gen, dtype=y_spec.dtype)
    return x, y


@pytest.fixture(scope="module")
def bench() -> BlockModel:
    return get_model("bench-small")


def test_registry() -> None:
    assert {"tiny", "small", "bench-small"} <= set(model_names())
    assert model_names() == sorted(MODEL_PRESETS)
    model = get_model("tiny")
    assert isinstance(model, ByteLM) and model.name == "tiny"
    assert get_model("tiny") is not model


def test_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'nope'; choose one of: .*bench-small"):
        get_model("nope")
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        get_model("")


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="must divide d_model"):
        ByteLMConfig(d_model=10, n_layers=1, n_heads=3, seq_len=8)
    with pytest.raises(ConfigError, match="n_layers must be a positive int"):
        ByteLMConfig(d_model=8, n_layers=0, n_heads=2, seq_len=8)


def test_bench_small_matches_benchmarks_md(bench: BlockModel) -> None:
    assert isinstance(bench, ByteLM)
    assert bench.cfg == ByteLMConfig(d_model=256, n_layers=6, n_heads=4, seq_len=128, mlp_ratio=4)
    assert bench.num_blocks() == 8
    assert 4_800_000 <= bench.num_parameters() <= 5_000_000
    # Per sample, each boundary carries 128 x 256 fp32 each way (BENCHMARKS.md: 2 x 131,072 B).
    assert bench.output_spec(2, 1).size_bytes == 128 * 256 * 4


def test_bench_small_three_way_plan(bench: BlockModel) -> None:
    # embedding + layers 0-1 | layers 2-3 | layers 4-5 + head
    assert partition(bench.block_costs(), 3) == [(0, 3), (3, 5), (5, 8)]


@pytest.mark.parametrize("name", ["tiny", "small", "bench-small"])
def test_costs_are_positive_and_one_per_block(name: str) -> None:
    model = get_model(name)
    costs = model.block_costs()
    assert len(costs) == model.num_blocks() == len(model.build_blocks(0))
    assert all(c > 0 for c in costs)


def test_tiny_splits_three_ways() -> None:
    model = get_model("tiny")
    assert model.num_blocks() >= 4
    assert len(partition(model.block_costs(), 3)) == 3


@pytest.mark.parametrize("name", ["tiny", "bench-small"])
def test_shapes_match_specs(name: str) -> None:
    model = get_model(name)
    blocks = model.build_blocks(0)
    x, y = _inputs(model, BATCH)
    assert x.shape == model.input_spec(BATCH).shape
    with torch.no_grad():
        for i, block in enumerate(blocks):
            x = block(x)
            spec = model.output_spec(i, BATCH)
            assert (tuple(x.shape), x.dtype) == (spec.shape, spec.dtype), f"block {i}"
        loss = model.loss(x, y)
    assert loss.shape == () and torch.isfinite(loss)
    # Fresh model, bytes uniform: loss near ln(256).
    assert abs(loss.item() - 5.545) < 0.5
    with pytest.raises(ValueError, match="out of range"):
        model.output_spec(model.num_blocks(), BATCH)


def test_int64_tokens_are_accepted() -> None:
    model = get_model("tiny")
    blocks = model.build_blocks(0)
    x, _ = _inputs(model, BATCH)
    with torch.no_grad():
        assert torch.equal(run_blocks(blocks, x), run_blocks(blocks, x.long()))


def test_build_is_deterministic(bench: BlockModel) -> None:
    torch.manual_seed(99)
    before = torch.rand(4)
    torch.manual_seed(99)
    a = _params(bench.build_blocks(0))
    after = torch.rand(4)
    assert torch.equal(before, after), "build_blocks must not disturb the global RNG"

    b = _params(bench.build_blocks(0))
    c = _params(bench.build_blocks(1))
    assert len(a) == len(b) == len(c)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not any(torch.equal(p, q) for p, q in zip(a, c, strict=True) if p.std() > 0)


def test_build_stage_keeps_the_same_parameters(bench: BlockModel) -> None:
    full = bench.build_blocks(5)
    stage = bench.build_stage(5, 3, 5)
    assert all(torch.equal(p, q) for p, q in zip(_params(full[3:5]), _params(stage), strict=True))
    with pytest.raises(ValueError, match="non-empty range"):
        bench.build_stage(5, 4, 4)


def test_blocks_share_no_parameters(bench: BlockModel) -> None:
    blocks = bench.build_blocks(0)
    seen: set[int] = set()
    for block in blocks:
        ptrs = {t.data_ptr() for t in [*block.parameters(), *block.buffers()]}
        assert not ptrs & seen
        seen |= ptrs


@pytest.mark.parametrize("name", ["tiny", "bench-small"])
def test_cut_backward_equals_one_backward(name: str) -> None:
    """Backward stage by stage, passing boundary gradients, equals one backward through all."""
    model = get_model(name)
    x, y = _inputs(model, BATCH, seed=1)

    reference = model.build_blocks(0)
    torch.autograd.backward(model.loss(run_blocks(reference, x), y))
    expected = [p.grad for p in _params(reference)]
    assert all(g is not None for g in expected)

    for cut in range(1, model.num_blocks()):
        blocks = model.build_blocks(0)
        boundary = run_blocks(blocks[:cut], x)
        received = boundary.detach().requires_grad_()  # what the next stage receives
        torch.autograd.backward(model.loss(run_blocks(blocks[cut:], received), y))
        assert received.grad is not None
        # what the previous stage receives back
        torch.autograd.backward(boundary, received.grad)
        for p, g in zip(_params(blocks), expected, strict=True):
            assert p.grad is not None and g is not None
            torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6, msg=f"cut at {cut}")


def test_tiny_trains_on_stdlib_bytes() -> None:
    model = get_model("tiny")
    assert isinstance(model, ByteLM)
    data = StdlibBytes(seq_len=model.cfg.seq_len, seed=0)
    blocks = model.build_blocks(0)
    opt = torch.optim.AdamW(_params(blocks), lr=1e-3)
    losses = []
    for step in range(30):
        x, y = data.batch(step, 8)
        loss = model.loss(run_blocks(blocks, x), y)
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
