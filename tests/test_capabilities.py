"""What a node measures of itself (daemon/worker/capabilities.py) on its device and in its
precision, what it says of its device (status, /metrics, the page), and how the planner uses
measurements of nodes unlike each other (a CPU and a GPU)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ravnest_node.bench.config import BenchConfig
from ravnest_node.bench.systems import on_device
from ravnest_node.coordination.planning.negotiate import model_blocks, negotiated_plan
from ravnest_node.coordination.planning.static_plan import Member
from ravnest_node.daemon.status import compute_of, compute_page_data
from ravnest_node.daemon.web import device_families, render_metrics
from ravnest_node.daemon.worker import capabilities
from ravnest_node.daemon.worker.worker import Worker
from ravnest_node.errors import ConfigError
from ravnest_node.launch.demo import DemoConfig
from ravnest_node.models import get_model
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.proto import control_pb2 as pb


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def test_on_the_cpu_it_says_cpu_and_the_kernels_available_memory() -> None:
    caps = capabilities.measure("tiny", 2, device=torch.device("cpu"), precision="fp32")
    assert caps.device == "cpu"
    assert len(caps.block_s) == get_model("tiny").num_blocks()
    assert all(math.isfinite(t) and t > 0 for t in caps.block_s)
    # MemAvailable moves while other work runs: the same figure within a quarter.
    assert caps.memory_bytes == pytest.approx(_mem_available(), rel=0.25)
    assert capabilities.measure("tiny", 2).device == "cpu"  # the CPU unless told


def test_scale_and_delay_make_a_node_look_slower() -> None:
    caps = capabilities.measure("tiny", 1, scale=1000.0, block_delay_s=0.5)
    assert all(t >= 0.5 for t in caps.block_s)


class _MatmulDtypes(TorchDispatchMode):
    """Records the output dtype of every matrix multiply while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.dtypes.add(out.dtype)
        return out


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_blocks_are_timed_in_the_nodes_precision(precision: str, dtype: torch.dtype) -> None:
    with _MatmulDtypes() as seen:
        times = capabilities.time_blocks(
            "tiny", 2, repeats=1, device=torch.device("cpu"), precision=precision
        )
    assert seen.dtypes == {dtype}  # every matmul, forward and backward, in that precision
    assert all(math.isfinite(t) and t > 0 for t in times)


def test_a_workers_device_and_precision_are_what_status_shows() -> None:
    gpu = cast(Worker, SimpleNamespace(device=torch.device("cuda", 1), precision="bf16"))
    assert compute_of(gpu) == (torch.device("cuda", 1), "bf16")
    cpu = cast(Worker, SimpleNamespace(device=torch.device("cpu"), precision="fp32"))
    assert compute_page_data(None) == {"device": "", "precision": ""}
    assert compute_page_data(cpu) == {"device": "cpu", "precision": "fp32"}


def test_device_series_carry_the_device_and_only_what_the_driver_tells() -> None:
    cpu = render_metrics(
        device_families("cpu", "fp32", memory_in_use_bytes=None, memory_peak_bytes=None,
                        utilisation=None)
    )  # fmt: skip
    assert 'ravnest_device_info{device="cpu",precision="fp32"} 1' in cpu
    assert "ravnest_device_memory" not in cpu and "utilisation" not in cpu
    gpu = render_metrics(
        device_families("cuda:0", "bf16", memory_in_use_bytes=3 * 2**30,
                        memory_peak_bytes=5 * 2**30, utilisation=0.75)
    )  # fmt: skip
    assert 'ravnest_device_info{device="cuda:0",precision="bf16"} 1' in gpu
    assert f'ravnest_device_memory_bytes{{device="cuda:0"}} {3 * 2**30}' in gpu
    assert f'ravnest_device_memory_peak_bytes{{device="cuda:0"}} {5 * 2**30}' in gpu
    assert 'ravnest_device_utilisation{device="cuda:0"} 0.75' in gpu


def test_a_gpu_and_a_cpu_on_one_host_are_balanced_by_their_speed_and_memory() -> None:
    # One host, two devices: two machines to the planner (host and device), each at the speed
    # and with the memory it measured.
    model = get_model("bench-small")
    n = model.num_blocks()
    run = TrainConfig(model="bench-small").to_proto("0" * 16)
    members = [Member("cpu-node", "10.0.0.1:7000"), Member("gpu-node", "10.0.0.1:7001")]
    caps = [
        pb.Capabilities(block_s=[0.04] * n, memory_bytes=2**36, device="cpu"),
        pb.Capabilities(block_s=[0.01] * n, memory_bytes=2**36, device="cuda:0"),
    ]

    def blocks_of(caps: list[pb.Capabilities]) -> dict[str, int]:
        plan, _ = negotiated_plan(
            epoch=1, swarm_id="s", model=model, members=members, capabilities=caps, run=run
        )
        return {s.node_id: s.stop_block - s.first_block for s in plan.stages}

    fast = blocks_of(caps)
    assert fast["gpu-node"] > fast["cpu-node"]  # 4x faster: the larger share of the model
    # The same speeds, but the GPU's memory holds three blocks at most: it gets no more.
    held = [b.memory_bytes for b in model_blocks(model, run, 0.08)]
    caps[1].memory_bytes = int(3 * max(held))
    tight = blocks_of(caps)
    assert fast["gpu-node"] > 3 >= tight["gpu-node"] >= 1


def test_the_bench_takes_a_device_and_gives_it_to_its_node_processes(tmp_path: Path) -> None:
    assert BenchConfig(device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="not a device"):
        BenchConfig(device="gpu0")
    demo = on_device(DemoConfig(nodes=3, work_dir=tmp_path), "cpu")
    assert getattr(demo, "device", "cpu") == "cpu"  # (DemoConfig.device: launch/demo.py)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA"):
            BenchConfig(device="cuda")
