"""Codecs on the device: every codec and role encodes bf16, fp16 and fp32 tensors within its bound,
the encode path never reads a device tensor's memory except through `to_host`, and on the CPU
at fp32 the payloads are byte for byte those of the codecs before they learned devices.

On this machine every tensor is on the CPU; tests/gpu/test_cuda_codecs.py checks CUDA tensors."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from ravnest_node.compression import (
    ACTIVATION_ONLY,
    CODECS,
    GRADIENT_ONLY,
    AQState,
    SampleReferences,
)
from ravnest_node.compression.codecs import Role, encoder
from ravnest_node.compression.host import copying_with, to_host
from ravnest_node.compression.powersgd import PowerSGD
from ravnest_node.compression.quant import BlockQuant
from ravnest_node.compression.sparse import TopKState
from ravnest_node.compression.transform import KLT, KLTBases
from ravnest_node.transport.frames import (
    FrameKind,
    FrameLimits,
    Outgoing,
    encode_frame,
    parse_frame,
)

LIMITS = FrameLimits(max_message_bytes=1 << 24)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative rounding of a value cast to the frame's dtype (decoders cast to the sender's dtype).
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ROLES: tuple[Role, ...] = ("activation", "gradient")
CASES = [
    (name, role)
    for role in ROLES
    for name in CODECS
    if not (role == "activation" and name in GRADIENT_ONLY)
    and not (role == "gradient" and name in ACTIVATION_ONLY)
]
FRAMES = 6  # klt sends its first basis with frame 5 and names it in frame 6
SAMPLES = (3, 0, 7, 1)


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """FRAMES tensors [4, 8, 64] of one stream, each a small change of the last (as the
    activations of one microbatch's samples are from one epoch to the next)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, 64, generator=gen)
    out = []
    for _ in range(FRAMES):
        x = x + 0.1 * torch.randn(x.shape, generator=gen)
        out.append(x.to(dtype))
    return out


def _send(
    name: str, role: Role, xs: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, dict[str, int], Any, Any]]:
    """(decoded, params, sender state after, receiver state after) of each of `xs`, through
    frames; the states as the topk-ef residual or the aq-delta references."""
    codec = encoder(name, role)
    state = codec.new_state()
    receiver: Any = KLTBases() if name == "klt" else SampleReferences(limit=8)
    out = []
    for x in xs:
        message = encode_frame(
            FrameKind.FORWARD, 0, 0, [Outgoing("h", x, codec, state)], samples=SAMPLES
        )
        frame = parse_frame(message, LIMITS)
        tensors, commit = frame.decode_with({"h": receiver})
        commit()
        out.append((tensors["h"], frame.headers[0].params, _held(state), _held(receiver)))
    return out


def _held(state: Any) -> Any:
    """What a state holds now (its topk-ef residual, its aq-delta references), as a copy."""
    if isinstance(state, TopKState):
        return None if state.residual is None else state.residual.clone()
    if isinstance(state, AQState):
        return dict(state.references.refs)
    return dict(state.refs) if isinstance(state, SampleReferences) else state


def _block_absmax(v: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax (flattened, blocks of `block`)."""
    flat = v.reshape(-1)
    padded = torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)
    return padded.abs().amax(1, keepdim=True).expand(-1, block).reshape(-1)[: flat.numel()]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "role"), CASES)
def test_every_codec_and_role_decodes_within_its_bound(
    name: str, role: Role, dtype: torch.dtype
) -> None:
    xs = _inputs(dtype)
    sent = _send(name, role, xs)
    codec = encoder(name, role)
    eps = EPS[dtype]
    previous = torch.zeros(xs[0].numel())  # topk-ef: the residual before each frame
    for i, (x, (d, params, state, receiver)) in enumerate(zip(xs, sent, strict=True)):
        assert d.dtype == dtype and d.shape == x.shape  # decoded in the sender's dtype
        x32, d32 = x.float(), d.float()
        err = (d32 - x32).abs()
        cast = eps * d32.abs() + 1e-30  # the decoder's cast back to `dtype`
        if name == "none":
            assert torch.equal(d, x)
        elif name in ("fp16", "bf16"):
            wire = 2.0**-11 if name == "fp16" else 2.0**-8
            assert bool((err <= wire * x32.abs() + cast + 6e-8).all())
        elif isinstance(codec, BlockQuant):
            step = _block_absmax(x32, codec.block).view(x.shape) / codec.levels
            bound = step * (1.0 if codec.stochastic else 0.5) * (1 + 1e-5)
            assert bool((err <= bound + cast).all())
        elif name == "topk-ef":
            now = state.view(-1)
            # What is not sent stays in the residual: x + e_before == decoded + e_after.
            gap = (x32.view(-1) + previous - d32.view(-1) - now).abs()
            assert bool((gap <= cast.view(-1) + 1e-6).all())
            assert int((d != 0).sum()) == codec.k_for(x.numel())  # type: ignore[attr-defined]
            previous = now.clone()
        elif name.startswith("aq-delta"):
            if i == 0:
                assert params["ref"] == 0 and torch.equal(d, x)  # the warm-up visit
            else:
                before = sent[i - 1][0].float()  # = the reference both ends held
                step = _block_absmax(x32 - before, codec.block).view(x.shape)  # type: ignore[attr-defined]
                levels = 7 if codec.bits == 4 else 1  # type: ignore[attr-defined]
                assert params["ref"] == 1
                assert bool((err <= step / levels * 0.5 * (1 + 1e-5) + cast + eps * 4).all())
            assert all(torch.equal(state[s], receiver[s]) for s in SAMPLES)  # bit for bit
        else:
            assert isinstance(codec, KLT)
            # Per row (activations) or per tensor (gradients): ||x - x'|| <= k alpha ||x|| with
            # k = 1/2 to nearest, 1 stochastic, times ||V|| ~ 1 and the bf16 step's rounding.
            k = (1.0 if codec.stochastic else 0.5) * codec.alpha * 1.05
            rows_x, rows_d = x32.view(-1, 64), (d32 - x32).view(-1, 64)
            if codec.per_row:
                assert bool((rows_d.norm(dim=1) <= k * rows_x.norm(dim=1) + 1e-6).all())
            else:
                assert float(rows_d.norm()) <= k * float(rows_x.norm())
            assert params["basis"] == (0 if i < 4 else 1 if i == 4 else 2)


class _PretendOnDevice(TorchFunctionMode):
    """Treats the tensors passed to `mark`, and every tensor computed from them, as if they lay
    on a device: a copy made by `host_copy` (the `to_host` hook) is a host tensor again. Records
    each `Tensor.numpy()` (or `tolist`) called on a tensor still marked: on a GPU that call
    would fail or copy a whole device tensor behind the side stream's back. A codec that moves
    its data with `.cpu()`, `.to("cpu")` or `.numpy()` instead of `to_host` is caught, since
    those keep the mark. Marks are attributes on the tensor objects, so nothing here compares
    tensors for equality."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.copies = 0

    @staticmethod
    def mark(t: torch.Tensor) -> None:
        t._on_device = True  # type: ignore[attr-defined]

    @staticmethod
    def marked(t: object) -> bool:
        return isinstance(t, torch.Tensor) and getattr(t, "_on_device", False)

    def host_copy(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        self.copies += 1
        hosts = [t.clone() for t in tensors]
        for h in hosts:
            h._on_device = False  # type: ignore[attr-defined]
        return hosts

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        leaves = tree_leaves((list(args), kwargs))
        if name in ("numpy", "tolist", "__array__") and self.marked(args[0]):
            self.reads.append(f"{name} of a device tensor {tuple(args[0].shape)}")
        result = func(*args, **kwargs)
        if any(self.marked(t) for t in leaves):
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self.mark(t)
            mutated = [kwargs.get("out")]
            if name.endswith("_") or name in ("__setitem__", "copy_"):
                mutated.append(args[0])
            for t in mutated:
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("name", "role"), CASES)
def test_encoding_reads_device_memory_only_through_to_host(
    name: str, role: Role, dtype: torch.dtype
) -> None:
    """Every codec's encode, over a stream of frames (so that its state, kept on the device, is
    used too), calls numpy only on what `to_host` handed back, and gives the same bytes as
    without the pretence."""
    xs = _inputs(dtype)
    codec = encoder(name, role)
    plain_state, state = codec.new_state(), codec.new_state()
    for s in (plain_state, state):  # the same rounding noise for both
        if getattr(s, "generator", None) is not None:
            s.generator = torch.Generator().manual_seed(3)  # type: ignore[attr-defined]
    mode = _PretendOnDevice()
    for x in xs:
        expected = encode_frame(FrameKind.FORWARD, 0, 0, [Outgoing("h", x, codec, plain_state)],
                                samples=SAMPLES)  # fmt: skip
        x = x.clone()
        mode.mark(x)
        with copying_with(mode.host_copy), mode:
            got = encode_frame(FrameKind.FORWARD, 0, 0, [Outgoing("h", x, codec, state)],
                               samples=SAMPLES)  # fmt: skip
        assert got == expected
    assert mode.reads == []
    assert mode.copies >= FRAMES  # every frame's results crossed through to_host


def test_powersgd_encodes_bf16_within_its_projection_bound_and_only_through_to_host() -> None:
    codec = PowerSGD(((64, 32), (32,), (16, 16)), rank=2)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(codec.numel, generator=gen).to(torch.bfloat16)
    mode = _PretendOnDevice()
    device_x = x.clone()
    mode.mark(device_x)
    with copying_with(mode.host_copy), mode:
        params, payload = codec.encode(device_x, codec.new_state())
    assert mode.reads == [] and mode.copies == 1
    assert (params, payload) == codec.encode(x, codec.new_state())
    d = codec.decode(memoryview(payload), [codec.numel], torch.float32, params)
    m, m_hat = x.float()[: 64 * 32], d[: 64 * 32]
    assert float((m - m_hat).norm()) <= float(m.norm()) * (1 + 1e-5)  # a projection
    bias = slice(64 * 32, 64 * 32 + 32)  # dense: bf16 values, exact for a bf16 input
    assert torch.equal(d[bias], x.float()[bias])


def test_a_host_copy_holds_only_within_its_block() -> None:
    calls: list[int] = []

    def copy(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(len(tensors))
        return [t.clone() for t in tensors]

    x = torch.randn(64)
    with pytest.raises(RuntimeError), copying_with(copy):
        assert [t.tolist() for t in to_host(x, x[:3])] == [x.tolist(), x[:3].tolist()]
        raise RuntimeError("an encode that fails")
    assert to_host(x)[0] is x  # the default again: a CPU tensor is its own host copy
    assert calls == [2]


# sha256 of the fp32 CPU payloads of every codec and role (stochastic ones seeded), FRAMES frames
# each, as the codecs wrote them before they learned devices (commit 520fdc7; klt's since its
# entropy coder became constriction's, "coder": 1, and its sender's covariance average took
# weight 0.8, 2026-12-05: with transform.EMA = 0.9 and REFRESH_MAX = 128 the digest before,
# cbbd5fe5efc645b1, still holds).
GOLDEN = "7fb8962c90d374aa"


def test_cpu_fp32_payloads_are_byte_for_byte_those_of_before() -> None:
    digest = hashlib.sha256()
    for name, role in CASES:
        codec = encoder(name, role)
        state = codec.new_state()
        if getattr(state, "generator", None) is not None:
            state.generator = torch.Generator().manual_seed(11)  # type: ignore[attr-defined]
        for x in _inputs(torch.float32):
            if hasattr(state, "bind"):
                state.bind(SAMPLES)
            params, payload = codec.encode(x, state)
            digest.update(repr(sorted(params.items())).encode() + payload)
    assert digest.hexdigest()[:16] == GOLDEN
