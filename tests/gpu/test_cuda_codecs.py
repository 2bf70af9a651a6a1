"""Codecs on a CUDA device (skipped without one): a CUDA tensor encodes to the bytes of its CPU
copy where the codec rounds to nearest, within the codec's bound where it rounds stochastically
or projects (klt: the matmul's summation order differs between devices), the codecs' sender
state stays on the device, and the side-stream copy of pipeline/encoder.py hands back the right
bytes while other work keeps the device busy."""

from __future__ import annotations

import threading

import pytest
import torch

from ravnest_node.compression import AQState, Codec, SampleReferences
from ravnest_node.compression.codecs import Role, encoder
from ravnest_node.compression.host import copying_with
from ravnest_node.compression.powersgd import PowerSGD
from ravnest_node.compression.sparse import TopKState
from ravnest_node.compression.transform import KLTBases, KLTState
from ravnest_node.pipeline.encoder import SideStreamCopy
from ravnest_node.transport.frames import (
    FrameKind,
    FrameLimits,
    Outgoing,
    encode_frame,
    parse_frame,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = torch.device("cuda", 0)
LIMITS = FrameLimits(max_message_bytes=1 << 26)
SAMPLES = (3, 0, 7, 1)
# Codecs whose encoding is the same arithmetic on any device (exact reductions, correctly
# rounded elementwise operations, round to nearest): a CUDA tensor gives its CPU copy's bytes.
DETERMINISTIC = [
    ("none", "activation"),
    ("fp16", "activation"),
    ("bf16", "activation"),
    ("int8-block", "activation"),
    ("int4-block", "activation"),
    ("aq-delta", "activation"),
    ("aq-delta2", "activation"),
    ("topk-ef", "gradient"),  # float32 only: bf16 values tie, and a tie may go either way
]
CASES = [
    (name, role, dtype)
    for name, role in DETERMINISTIC
    for dtype in (torch.float32, torch.bfloat16)
    if not (name == "topk-ef" and dtype == torch.bfloat16)
]


def _stream(dtype: torch.dtype, frames: int = 6) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 8, 64, generator=gen)
    out = []
    for _ in range(frames):
        x = x + 0.1 * torch.randn(x.shape, generator=gen)
        out.append(x.to(dtype))
    return out


def _frame(x: torch.Tensor, codec: Codec, state: object) -> bytes:
    tensors = [Outgoing("h", x, codec, state)]
    return encode_frame(FrameKind.FORWARD, 0, 0, tensors, samples=SAMPLES)


@pytest.mark.parametrize(("name", "role", "dtype"), CASES)
def test_a_cuda_tensor_encodes_to_its_cpu_copys_bytes(
    name: str, role: Role, dtype: torch.dtype
) -> None:
    codec = encoder(name, role)
    cpu_state, cuda_state = codec.new_state(), codec.new_state()
    for x in _stream(dtype):
        assert _frame(x.to(DEVICE), codec, cuda_state) == _frame(x, codec, cpu_state)


@pytest.mark.parametrize("name", ["int8-block", "int4-block", "klt"])
def test_stochastic_and_projecting_codecs_decode_within_their_bound(name: str) -> None:
    """Gradients (stochastic rounding on a CUDA generator) and klt activations: the CUDA frames
    decode as close to the input as the CPU frames' bound allows (module doc of each codec)."""
    roles: tuple[Role, ...] = ("activation", "gradient")
    for role in roles:
        codec = encoder(name, role)
        state, bases = codec.new_state(), KLTBases()
        for x in _stream(torch.float32):
            frame = parse_frame(_frame(x.to(DEVICE), codec, state), LIMITS)
            tensors, commit = frame.decode_with({"h": bases})
            commit()
            # Bounds (codec module docs): int8 s/127, int4 s/7 per element stochastic (s the
            # block's absmax, ~3 here); klt alpha x ||x|| (0.25 activations, 0.35 gradients).
            assert float((tensors["h"] - x).norm()) <= 0.4 * float(x.norm())


@pytest.mark.parametrize("name", ["aq-delta", "aq-delta2"])
def test_aq_delta_references_of_a_cuda_sender_equal_a_cpu_receivers_bit_for_bit(name: str) -> None:
    codec = encoder(name, "activation")
    state, refs = codec.new_state(), SampleReferences(limit=8)
    assert isinstance(state, AQState)
    for x in _stream(torch.float32, frames=10):
        frame = parse_frame(_frame(x.to(DEVICE), codec, state), LIMITS)
        frame.decode_with({"h": refs})[1]()
    for s in SAMPLES:
        assert state.references.refs[s].device == DEVICE
        assert torch.equal(state.references.refs[s].cpu(), refs.refs[s])


def test_klt_keeps_its_basis_and_covariance_on_the_device() -> None:
    codec = encoder("klt", "activation")
    state = codec.new_state()
    assert isinstance(state, KLTState)
    for x in _stream(torch.bfloat16):
        _frame(x.to(DEVICE), codec, state)
    assert state.basis is not None and state.analysis is not None and state.covariance is not None
    assert {state.basis.device, state.analysis.device, state.covariance.device} == {DEVICE}
    assert state.basis_id >= 1


def test_topk_residual_and_rounding_generator_stay_on_the_device() -> None:
    x = torch.randn(4, 8, 64, device=DEVICE)
    topk = encoder("topk-ef", "gradient")
    topk_state = topk.new_state()
    topk.encode(x, topk_state)
    assert isinstance(topk_state, TopKState) and topk_state.residual is not None
    assert topk_state.residual.device == DEVICE
    int8 = encoder("int8-block", "gradient")
    int8_state = int8.new_state()
    seed = int8_state.generator.initial_seed()  # type: ignore[attr-defined]
    int8.encode(x, int8_state)
    generator = int8_state.generator  # type: ignore[attr-defined]
    assert generator.device == DEVICE and generator.initial_seed() == seed


def test_powersgd_keeps_its_state_on_the_device_and_sends_the_cpu_bytes() -> None:
    codec = PowerSGD(((64, 32), (32,)), rank=2)
    x = torch.randn(codec.numel, generator=torch.Generator().manual_seed(4))
    cuda_state, cpu_state = codec.new_state(), codec.new_state()
    params, payload = codec.encode(x.to(DEVICE), cuda_state)
    assert cuda_state.residual is not None and cuda_state.residual.device == DEVICE
    assert all(q.device == DEVICE for q in cuda_state.warm.values())
    cpu_params, cpu_payload = codec.encode(x, cpu_state)
    assert params == cpu_params and len(payload) == len(cpu_payload)
    decoded = codec.decode(memoryview(payload), [codec.numel], torch.float32, params)
    m = x[: 64 * 32]
    assert float((decoded[: 64 * 32] - m).norm()) <= float(m.norm()) * (1 + 1e-5)


def test_the_side_stream_copy_gives_the_right_bytes_under_a_concurrent_matmul() -> None:
    """A thread keeps the device busy with matmuls on its own stream while this one encodes
    the output of a matmul it has just queued (so the copy must wait for it) through the side
    stream: every frame holds the bytes of the same values encoded on the CPU."""
    copy = SideStreamCopy(DEVICE)
    busy = threading.Event()
    stop = threading.Event()

    def keep_busy() -> None:
        a = torch.randn(4096, 4096, device=DEVICE)
        with torch.cuda.stream(torch.cuda.Stream(DEVICE)):  # type: ignore[no-untyped-call]
            while not stop.is_set():
                a = (a @ a).tanh_()
                busy.set()
        torch.cuda.synchronize(DEVICE)

    worker = threading.Thread(target=keep_busy, daemon=True)
    worker.start()
    try:
        assert busy.wait(timeout=60)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        w = torch.randn(1024, 1024, device=DEVICE, generator=gen)
        codec = encoder("int4-block", "activation")
        for _ in range(20):
            h = torch.randn(64, 1024, device=DEVICE, generator=gen) @ w
            with copying_with(copy):
                got = _frame(h, codec, None)
            assert got == _frame(h.cpu(), codec, None)
        hosts = copy([torch.arange(10, device=DEVICE), torch.ones(3)])
        assert hosts[0].is_pinned() and hosts[0].tolist() == list(range(10))
        assert hosts[1].device.type == "cpu" and hosts[1].tolist() == [1.0, 1.0, 1.0]
    finally:
        stop.set()
        worker.join(timeout=60)
