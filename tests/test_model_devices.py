"""Blocks on a device (`BlockModel.build_stage(..., device=)`), for every model family the
registry builds: random-init stages bit-identical to a CPU build, pretrained stages read one
tensor at a time with a LoRA base placed in its stored form only, and no tensor made inside a
forward or backward without a device (it would be a CPU tensor beside a GPU one)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ravnest_node.models import BlockModel, get_model, run_blocks
from ravnest_node.models.bytelm import PRESETS, Embedding, Head, TransformerLayer
from ravnest_node.models.llama_bench import LlamaBench, LlamaBenchConfig
from ravnest_node.models.pretrained import model as pretrained_model

from .test_pretrained import make_bert, make_llama

META = torch.device("meta")
SMALL_LLAMA = LlamaBenchConfig(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, seq_len=16)
"""llama-300m's architecture (llama_bench.py) at a size for a test."""
BASES = ("", ",lora=2,base=bf16", ",lora=2,base=int8", ",lora=2,base=nf4")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    make_llama(root / "llama")
    make_bert(root / "bert")
    return {"llama": root / "llama", "bert": root / "bert"}


def _model(name: str, checkpoints: dict[str, Path]) -> BlockModel:
    if name == "llama-bench":
        return LlamaBench(SMALL_LLAMA)
    family, _, options = name.partition(",")
    if family in checkpoints:
        return get_model(f"hf:{checkpoints[family]},seq=16{',' + options if options else ''}")
    return get_model(name)


FAMILIES = [
    "tiny", "small", "bench-small", "llama-bench",
    *(f"{family}{base}" for family in ("llama", "bert") for base in BASES),
]  # fmt: skip


def _tensors(blocks: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    return [t for b in blocks for t in (*b.parameters(), *b.buffers())]


def test_a_random_init_stage_is_bit_identical_to_the_whole_cpu_build() -> None:
    """The same RNG stream as before devices: the blocks of a stage are the constructors called
    in order under the seed, whichever device they go to."""
    cfg = PRESETS["small"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)  # the construction as it was: every block, in order
        reference = [Embedding(cfg), *(TransformerLayer(cfg) for _ in range(4)), Head(cfg)]
    model = get_model("small")
    state = torch.get_rng_state()
    for start, stop in ((0, 6), (2, 4), (5, 6)):
        stage = model.build_stage(7, start, stop, device=torch.device("cpu"))
        for ours, theirs in zip(stage, reference[start:stop], strict=True):
            for (k, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items(),
                                      strict=True):  # fmt: skip
                assert a.dtype == b.dtype and torch.equal(a, b), k
    assert torch.equal(torch.get_rng_state(), state)  # the caller's RNG untouched


@pytest.mark.parametrize("name", FAMILIES)
def test_every_tensor_of_a_stage_is_on_its_device(name: str, checkpoints: dict[str, Path]
                                                  ) -> None:  # fmt: skip
    model = _model(name, checkpoints)
    n = model.num_blocks()
    stage = model.build_stage(0, 1, n, device=META)
    assert all(t.is_meta for t in _tensors(stage)), name
    timing = model.timing_blocks(device=META)
    assert all(t.is_meta for t in _tensors(timing)), name
    if ",base=" in name:  # the stored form, not float32, went to the device
        base = name.rpartition("=")[2]
        stored = {"bf16": torch.bfloat16, "int8": torch.int8, "nf4": torch.uint8}[base]
        assert stored in {t.dtype for t in _tensors(stage)}, name
    cpu = model.build_stage(0, 1, n)  # the same shapes and dtypes as on the CPU
    assert [(t.shape, t.dtype) for t in _tensors(stage)] == [
        (t.shape, t.dtype) for t in _tensors(cpu)
    ]


def _cpu_tensors() -> Iterator[torch.Tensor]:
    """Every CPU tensor alive in the process (found by the garbage collector)."""
    with warnings.catch_warnings():  # isinstance on deprecated torch objects warns
        warnings.simplefilter("ignore", FutureWarning)
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                yield obj


def _float32_bytes_alive(known: set[int]) -> int:
    """Bytes of the float32 CPU tensors alive now whose storage is not in `known`."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in _cpu_tensors() if t.dtype == torch.float32}  # fmt: skip
    return sum(n for ptr, n in seen.items() if ptr not in known)


@pytest.mark.parametrize("base", ["fp32", "nf4"])
def test_a_pretrained_stage_holds_one_float32_tensor_at_a_time(
    base: str, checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loaded onto a device (meta here: nothing of the stage stays on the host), the host holds
    the tensor just read and nothing else of the stage, never a block's or the stage's tensors
    together: measured before and after every read, over every float32 tensor alive in the
    process. (Building a block on the host and then loading it held the whole block.)"""
    plain = f"hf:{checkpoints['llama']},seq=16"
    sizes = [t.numel() * 4 for t in _tensors(get_model(plain).build_stage(0, 1, 2, device=META))]
    largest, block = max(sizes), sum(sizes)
    model = get_model(plain + (f",lora=2,base={base}" if base != "fp32" else ""))
    known = {t.untyped_storage().data_ptr() for t in _cpu_tensors()}
    peaks: list[int] = []
    read = pretrained_model.load_tensors

    def spy(entries: Any, names: Any, **where: Any) -> dict[str, torch.Tensor]:
        peaks.append(_float32_bytes_alive(known))
        tensors = read(entries, names, **where)
        peaks.append(_float32_bytes_alive(known))
        return tensors

    monkeypatch.setattr(pretrained_model, "load_tensors", spy)
    stage = model.build_stage(0, 1, 3, device=META)  # both layers
    assert len(peaks) == 2 * 2 * 9 and all(t.is_meta for t in _tensors(stage))
    assert max(peaks) <= largest + 1024 < block, (peaks, largest, block)  # + rotary tables


# ----- tensors made without a device inside a forward or backward -----------------------------
FACTORIES = {
    torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn,
    torch.randint, torch.randperm, torch.tensor, torch.eye, torch.linspace, torch.logspace,
    torch.empty_strided, torch.scalar_tensor, torch.tril_indices, torch.triu_indices,
}  # fmt: skip


class _FlagFactories(TorchFunctionMode):
    """Records every factory call that names no device: on a GPU it makes a CPU tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.calls.append(f"{func.__name__}{tuple(a for a in args if not callable(a))}")
        return func(*args, **kwargs)


def _flagged(model: BlockModel, trains: bool) -> Iterator[str]:
    blocks = model.build_blocks(0)
    gen = torch.Generator().manual_seed(0)
    spec, target = model.input_spec(2), model.target_spec(2)
    x = torch.randint(0, model.vocab_size, spec.shape, generator=gen).to(spec.dtype)
    y = torch.randint(0, model.vocab_size, target.shape, generator=gen).to(target.dtype)
    mode = _FlagFactories()
    with mode:
        loss = model.loss(run_blocks(blocks, x), y)
        if trains:
            loss.backward()
    if trains:
        assert any(p.grad is not None for b in blocks for p in b.parameters())
    yield from mode.calls


@pytest.mark.parametrize("name", FAMILIES)
def test_no_tensor_is_made_without_a_device_in_a_forward_or_backward(
    name: str, checkpoints: dict[str, Path]
) -> None:
    assert list(_flagged(_model(name, checkpoints), trains=True)) == []


def test_the_check_sees_a_tensor_made_without_a_device(checkpoints: dict[str, Path]) -> None:
    """What the old llama.py did: `torch.arange(t)` for the rotary positions."""
    model = _model("llama-bench", checkpoints)

    class Leaky(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[-1], dtype=x.dtype)

    blocks = model.build_blocks(0)
    model.build_blocks = lambda seed: [*blocks[:-1], Leaky(), blocks[-1]]  # type: ignore[method-assign]
    assert list(_flagged(model, trains=True)) == ["arange(64,)"]
