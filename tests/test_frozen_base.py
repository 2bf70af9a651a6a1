"""A frozen LoRA base stored compactly (bf16, int8, nf4) stays compact while training: autograd
keeps the stored tensors, not a float32 copy; the layer trains and its gradients are those of
the dequantised weight; nf4 is torchao's layout and within QLoRA's error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ravnest_node.errors import ConfigError
from ravnest_node.models import get_model, run_blocks
from ravnest_node.models.base import shapes_only
from ravnest_node.models.lora import (
    BASE_DTYPES,
    FrozenLinear,
    LoRAConfig,
    LoRALinear,
    nf4_bytes,
    seeded_generator,
)
from tests.test_pretrained import make_llama

COMPACT = ("bf16", "int8", "nf4")
IN, OUT, RANK, BATCH = 256, 512, 4, 8


def _layer(base: str) -> LoRALinear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT)
    return LoRALinear(linear, LoRAConfig(rank=RANK, alpha=8.0, targets=("x",), base=base),
                      seeded_generator(0, "layer"))  # fmt: skip


def _saved(fn: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The distinct tensors (by storage) autograd keeps running `fn` on `x`."""
    kept: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return list(kept.values())


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("base", COMPACT)
def test_autograd_keeps_the_stored_weight_not_a_float32_copy(base: str) -> None:
    layer = _layer(base)
    x = torch.randn(BATCH, IN, requires_grad=True)
    saved = _saved(layer, x)
    stored = _nbytes(layer.base.stored())
    # The input, A x, and the adapters themselves: what the adapter's own matmuls keep.
    adapter = (BATCH * IN + BATCH * RANK + RANK * IN + OUT * RANK) * 4
    fp32_copy = OUT * IN * 4
    assert _nbytes(saved) <= stored + adapter
    assert _nbytes(saved) < fp32_copy  # the code before FrozenMatmul kept W as float32
    assert not any(t.shape == (OUT, IN) and t.dtype == torch.float32 for t in saved)


@pytest.mark.parametrize("base", COMPACT)
def test_gradients_are_those_of_the_dequantised_weight(base: str) -> None:
    layer = _layer(base)
    torch.nn.init.normal_(layer.lora_b)  # (zero at the start: its gradient would be trivial)
    x = torch.randn(BATCH, IN, requires_grad=True)
    layer(x).square().mean().backward()
    dense = layer.base.dense_weight()
    ref_x = x.detach().requires_grad_(True)
    a, b = (p.detach().requires_grad_(True) for p in (layer.lora_a, layer.lora_b))
    out = F.linear(ref_x, dense, layer.base.bias) + F.linear(F.linear(ref_x, a), b) * 2.0
    out.square().mean().backward()
    for ours, ref in (
        (x.grad, ref_x.grad),
        (layer.lora_a.grad, a.grad),
        (layer.lora_b.grad, b.grad),
    ):
        assert ours is not None and ref is not None
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("base", "tol"), [("fp32", 0.0), ("bf16", 0.01), ("int8", 0.02),
                                           ("nf4", 0.2)])  # fmt: skip
def test_input_gradients_match_float32_within_the_quantisation_error(base: str, tol: float) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT)
    x = torch.randn(BATCH, IN, requires_grad=True)
    FrozenLinear(linear, base)(x).sum().backward()
    ours, x.grad = x.grad, None
    linear(x).sum().backward()
    assert ours is not None and x.grad is not None
    assert float((ours - x.grad).norm() / x.grad.norm()) <= tol


@pytest.mark.parametrize("base", BASE_DTYPES)
def test_lora_trains_on_each_base(base: str) -> None:
    layer = _layer(base)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, IN, generator=gen)
    delta = torch.randn(OUT, 2, generator=gen) @ torch.randn(2, IN, generator=gen) * 0.01
    target = F.linear(x, delta) + layer.base(x).detach()  # a change of rank 2 <= RANK
    optimizer = torch.optim.Adam(layer.parameters(), lr=1e-2)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = F.mse_loss(layer(x), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]
    assert {n for n, _ in layer.named_parameters()} == {"lora_a", "lora_b"}


def test_nf4_is_torchaos_layout_within_qloras_error() -> None:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 512)
    frozen = FrozenLinear(linear, "nf4")
    w = linear.weight.detach()
    assert torch.equal(frozen.dense_weight(), to_nf4(w, 64, 256).get_original_weight())
    # Normal weights: about 9% relative error (4 bits, QLoRA's codebook); each weight within
    # half the codebook's widest gap (0.16 of its block's absmax, plus the scaler's rounding).
    assert float((frozen.dense_weight() - w).norm() / w.norm()) < 0.11
    absmax = w.reshape(-1, 64).abs().amax(dim=1, keepdim=True)
    assert bool(((frozen.dense_weight() - w).reshape(-1, 64).abs() <= 0.17 * absmax).all())
    assert _nbytes(frozen.stored()) == nf4_bytes(w.numel()) == w.numel() // 2 + 8192 + 128 + 68


def test_nf4_needs_blocks_of_64_and_counts_its_shape_on_meta() -> None:
    with pytest.raises(ConfigError, match="blocks of 64"):
        FrozenLinear(torch.nn.Linear(10, 10), "nf4")
    with shapes_only():
        frozen = FrozenLinear(torch.nn.Linear(96, 48), "nf4")
    assert all(t.is_meta for t in frozen.stored())
    assert sum(t.nbytes for t in frozen.stored()) == nf4_bytes(96 * 48)


@pytest.mark.parametrize("base", COMPACT)
def test_autocast_computes_in_its_dtype(base: str) -> None:
    layer = _layer(base)
    x = torch.randn(BATCH, IN, requires_grad=True)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    assert float((out.float() - ref).detach().norm() / ref.detach().norm()) < 0.02
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32


def test_a_pretrained_llama_on_an_nf4_base_is_its_dequantised_model(tmp_path: Path) -> None:
    make_llama(tmp_path / "llama")
    name = f"hf:{tmp_path / 'llama'},seq=16,lora=2"
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        compact = get_model(f"{name},base=nf4").build_stage(0, 0, 2)
        dense = get_model(name).build_stage(0, 0, 2)  # fp32 base, given nf4's values below
        frozen = [m for m in compact[1].modules() if isinstance(m, FrozenLinear)]
        for ours, theirs in zip(
            frozen, (m for m in dense[1].modules() if isinstance(m, FrozenLinear)), strict=True
        ):
            theirs.weight.copy_(ours.dense_weight())
        torch.testing.assert_close(run_blocks(compact, ids), run_blocks(dense, ids))
    assert len(frozen) == 7 and {m.weight.dtype for m in frozen} == {torch.uint8}
