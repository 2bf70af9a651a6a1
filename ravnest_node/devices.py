"""Which accelerator a node computes on, and in which precision.

`--device auto|cpu|cuda|cuda:N|mps` names the device: auto is the first CUDA device torch sees,
else Apple's MPS where torch has it, else the CPU. `--precision auto|fp32|bf16|fp16` names
the compute precision: auto is bf16 on a CUDA device that has it, else fp32 (the CPU, MPS, a
CUDA device older than Ampere). bf16 and fp16 run the forward and backward under autocast with
float32 master weights and optimizer state (pipeline/weights.py); fp16 also scales the loss by
a fixed scale every stage of the run must agree on (pipeline/run.py FP16_LOSS_SCALE), so it is
only ever chosen by the run (`--precision fp16`), never by one node's auto.

Everything here is a thin layer over torch's own device API (no library does this choice for
us); it sits at the bottom of the layering so that models, the pipeline, the daemon and the
bench all ask the same functions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from ravnest_node.errors import ConfigError

__all__ = [
    "DEVICE_HELP",
    "PRECISIONS",
    "autocast",
    "autocast_dtype",
    "available_memory_bytes",
    "describe",
    "memory_in_use_bytes",
    "resolve_device",
    "resolve_precision",
    "synchronize",
    "torch_threads",
    "utilisation",
]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
"""Compute precisions a run may name (`resolve_precision` turns auto into one of the others)."""
DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps (auto: the first CUDA device, else MPS, else CPU)"
MEMINFO = Path("/proc/meminfo")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(spec: str) -> torch.device:
    """The device `spec` names (see the module docstring); ConfigError if this machine has no
    such device."""
    spec = spec.strip().lower()
    if spec in ("", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ConfigError(f"--device {spec!r}: not a device; give {DEVICE_HELP}") from e
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {spec}: this torch sees no CUDA device (torch {torch.__version__}; "
                "the CPU build, or no driver); install a CUDA build of torch or use --device cpu"
            )
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return torch.device("cuda", index)
    if device.type == "mps":
        if not _mps_available():
            raise ConfigError(f"--device {spec}: this torch has no MPS device")
        return torch.device("mps")
    raise ConfigError(f"--device {spec!r}: not supported; give {DEVICE_HELP}")


def resolve_precision(precision: str, device: torch.device) -> str:
    """The precision a run naming `precision` computes in on `device` (auto: bf16 on a CUDA
    device that supports it, else fp32; see the module docstring for why never fp16).
    ConfigError for a name not in PRECISIONS."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16"
    return "fp32"


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a resolved precision (None for fp32: no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """Forwards (and recomputations) within it run in `precision` on `device`."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's CPU ops within it use `threads` threads (a sum split over more threads rounds
    differently); the count before is restored on the way out."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _cpu_available(meminfo: Path = MEMINFO) -> int:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def available_memory_bytes(device: torch.device, meminfo: Path = MEMINFO) -> int:
    """Memory free for new work on `device`: the driver's free bytes on a CUDA device
    (`torch.cuda.mem_get_info`), the kernel's MemAvailable on the CPU; 0 if unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.current_allocated_memory())
    return _cpu_available(meminfo)


def memory_in_use_bytes(device: torch.device) -> int | None:
    """Bytes torch's allocator holds in tensors on `device` (None on the CPU: not tracked)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.current_allocated_memory())
    return None


def utilisation(device: torch.device) -> float | None:
    """The share of the last sample period the GPU was busy, as the driver tells it (needs
    NVML, i.e. the nvidia-ml-py package); None where unknown."""
    if device.type != "cuda":
        return None
    try:
        return float(torch.cuda.utilization(device)) / 100.0
    except Exception:  # no NVML: the driver tells us nothing
        return None


def describe(device: torch.device) -> str:
    """The device for logs and status, e.g. "cuda:0 (NVIDIA GeForce RTX 3090, 24.0 GiB)"."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{device} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    return str(device)
