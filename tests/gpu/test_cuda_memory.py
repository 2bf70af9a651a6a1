"""On a GPU: a LoRA Llama stage with an nf4 base, built straight onto CUDA, needs what the plan
says (coordination/planning/estimate.stage_memory), by torch's CUDA allocator, within 15%."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ravnest_node.bench.plan_check import (
    GPU_MEMORY_LLAMA,
    MEMORY_TRAIN,
    allocator_peak_bytes,
    memory_stage,
)
from ravnest_node.models import get_model
from tests.test_pretrained import make_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_an_nf4_lora_stage_on_cuda_needs_what_the_plan_says() -> None:
    """Three layers of llama-300m's shape, four microbatches in flight, their backward and an
    AdamW step (plan_check's schedule): the allocator's peak against the plan's bytes."""
    device = torch.device("cuda")
    plan, blocks, inputs = memory_stage("lora-nf4", device, GPU_MEMORY_LLAMA)
    assert all(t.device.type == "cuda" for b in blocks for t in (*b.parameters(), *b.buffers()))
    measured = allocator_peak_bytes(blocks, inputs, MEMORY_TRAIN.max_staleness)
    planned = sum(plan.values())
    ratio = planned / measured
    print(f"nf4 LoRA stage on {torch.cuda.get_device_name(device)}: plan {planned:,.0f} bytes "
          f"({plan}), allocator {measured:,.0f} bytes, plan / allocator {ratio:.3f}")  # fmt: skip
    assert 0.85 <= ratio <= 1.15


def test_a_stage_built_on_cuda_is_the_cpu_stage() -> None:
    """build_stage(device=cuda) of a random-init model: the same values as on the CPU."""
    model = get_model("tiny")
    gpu = model.build_stage(3, 1, 4, device=torch.device("cuda"))
    cpu = model.build_stage(3, 1, 4)
    for a, b in zip(gpu, cpu, strict=True):
        for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert x.device.type == "cuda" and torch.equal(x.cpu(), y), k


def test_a_pretrained_stage_read_onto_cuda_is_the_cpu_stage(tmp_path: Path) -> None:
    """build_stage(device=cuda) of an hf: model: safetensors reads each tensor onto the card
    (models/weight_files.py), and the values are the CPU stage's."""
    make_llama(tmp_path / "llama")
    model = get_model(f"hf:{tmp_path / 'llama'},seq=16")
    gpu = model.build_stage(0, 1, model.num_blocks(), device=torch.device("cuda"))
    cpu = model.build_stage(0, 1, model.num_blocks())
    for a, b in zip(gpu, cpu, strict=True):
        for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert x.device.type == "cuda" and torch.equal(x.cpu(), y), k
