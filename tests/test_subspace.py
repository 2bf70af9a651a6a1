"""The subspace byte LM (models/subspace.py) and the token ids its stages carry (TOKENS)."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ravnest_node.compression import get_codec
from ravnest_node.errors import FrameError
from ravnest_node.models import get_model, run_blocks
from ravnest_node.models.bytelm import PRESETS
from ravnest_node.models.subspace import SubspaceLM, basis
from ravnest_node.pipeline.compute import StageCompute
from ravnest_node.pipeline.inbox import Inbox
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import Schedule, StageSpec, expected_tensors
from ravnest_node.transport.frames import FrameKind, FrameLimits, encode_frame, parse_frame

from .conftest import demo_summaries

LIMITS = FrameLimits(max_message_bytes=1 << 24)
MB = 4  # batch 16 in 4 microbatches
MIDDLE = StageSpec(index=1, num_stages=3, first_block=1, stop_block=2)  # tiny-subspace: 3 blocks


def _tokens(batch: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, seq), generator=gen, dtype=torch.int64).to(torch.uint8)


def test_shapes_match_specs_and_the_boundary_is_k_wide() -> None:
    model = get_model("tiny-subspace")
    assert isinstance(model, SubspaceLM) and model.carries_tokens and model.k == 16
    assert not get_model("tiny").carries_tokens
    blocks = model.build_blocks(0)
    assert len(blocks) == model.num_blocks() == len(model.block_costs()) == 3
    x = tokens = _tokens()
    for i, block in enumerate(blocks):
        x = block(x, tokens)
        spec = model.output_spec(i, 2)
        assert (tuple(x.shape), x.dtype) == (spec.shape, spec.dtype)
    assert model.output_spec(0, 2).shape == (2, 32, 16)  # k of d = 64 coordinates
    assert get_model("bench-small-subspace").output_spec(0, 1).shape == (1, 128, 16)


def test_the_residual_stream_is_the_embeddings_plus_a_vector_of_span_u() -> None:
    model = get_model("tiny-subspace")
    blocks = model.build_blocks(3)
    u = basis(64, 16)
    assert torch.allclose(u.T @ u, torch.eye(16), atol=1e-5)  # orthonormal
    for block in blocks:  # the same fixed basis everywhere, a buffer that no checkpoint holds
        assert torch.equal(block.reader.basis, u)
        assert not any("basis" in name for name in block.state_dict())
        assert all(p is not block.reader.basis for p in block.parameters())
    tokens = _tokens()
    c = blocks[0](tokens, tokens)
    c = blocks[1](c, tokens)
    reader = blocks[2].reader
    residual = reader.embed(tokens) + reader.lift(c)
    rest = residual - reader.embed(tokens)
    off_span = rest - (rest @ u) @ u.T
    assert off_span.abs().max() < 1e-6 < rest.abs().max()
    # c is exactly the coordinates of that rest in U.
    assert torch.allclose(rest @ u, c, atol=1e-6)


def test_gradients_reach_every_parameter() -> None:
    model = get_model("tiny-subspace")
    blocks = model.build_blocks(0)
    tokens = _tokens(seed=1)
    loss = model.loss(run_blocks(blocks, tokens, tokens), _tokens(seed=2))
    assert math.isfinite(loss.item())
    loss.backward()
    for block in blocks:
        for name, p in block.named_parameters():
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name


@pytest.mark.parametrize("cut", [1, 2])
def test_a_cut_anywhere_gives_the_loss_and_gradients_of_the_whole_model(cut: int) -> None:
    model = get_model("tiny-subspace")
    whole, parts = model.build_blocks(5), model.build_blocks(5)
    tokens, targets = _tokens(seed=3), _tokens(seed=4)
    loss = model.loss(run_blocks(whole, tokens, tokens), targets)
    loss.backward()
    # Stage by stage, as the pipeline runs it: the boundary tensor detached, its gradient sent.
    sent = run_blocks(parts[:cut], tokens, tokens)
    received = sent.detach().requires_grad_(True)
    stage_loss = model.loss(run_blocks(parts[cut:], received, tokens), targets)
    stage_loss.backward()
    assert received.grad is not None
    sent.backward(received.grad)
    assert torch.equal(loss, stage_loss)
    for a, b in zip(whole, parts, strict=True):
        for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None
            assert torch.allclose(p.grad, q.grad, atol=1e-7), name


def test_k_is_validated_and_timing_blocks_take_one_tensor() -> None:
    with pytest.raises(Exception, match="subspace width"):
        SubspaceLM(PRESETS["tiny"], k=65)
    model = SubspaceLM(PRESETS["tiny"], k=32)
    h: torch.Tensor = _tokens()
    for block in model.timing_blocks():  # (capabilities.py times blocks one tensor in, one out)
        h = block(h)
    assert h.shape == (2, 32, 256)


def _run(recompute: bool = False) -> TrainConfig:
    return TrainConfig(
        model="tiny-subspace", steps=4, batch_size=16, recompute=recompute,
        activation_codec="none", gradient_codec="none",
    )  # fmt: skip


def _forward_frame(tokens: torch.Tensor | None, tokens_name: str = "tokens") -> bytes:
    none = get_codec("none")
    tensors = [("hidden", torch.randn(MB, 32, 16), none),
               ("targets", torch.zeros(MB, 32, dtype=torch.uint8), none)]  # fmt: skip
    if tokens is not None:
        tensors.append((tokens_name, tokens, none))
    return encode_frame(FrameKind.FORWARD, 0, 0, tensors)


def _inbox(model_name: str) -> Inbox:
    run = _run()
    forward, backward = expected_tensors(get_model(model_name), MIDDLE, run.microbatch_size)
    return Inbox(Schedule(MIDDLE, run, start_step=0, forward=forward, backward=backward))


def test_only_a_model_that_carries_tokens_expects_them() -> None:
    plain, _ = expected_tensors(get_model("tiny"), MIDDLE, MB)
    sub, _ = expected_tensors(get_model("tiny-subspace"), MIDDLE, MB)
    assert [e.name for e in plain] == ["hidden", "targets"]
    assert [(e.name, e.shape, e.dtype) for e in sub[1:]] == [
        ("targets", (MB, 32), torch.uint8),
        ("tokens", (MB, 32), torch.uint8),
    ]
    first, _ = expected_tensors(get_model("tiny-subspace"), StageSpec(0, 3, 0, 1), MB)
    assert [e.name for e in first] == ["targets"]  # (the first stage feeds itself)


@pytest.mark.parametrize(
    ("tokens", "name", "message"),
    [
        (None, "tokens", "carries tensors"),  # missing
        (torch.zeros(MB, 32, dtype=torch.int64), "tokens", "dtype"),  # ids that could be >= 256
        (torch.zeros(MB, 31, dtype=torch.uint8), "tokens", "shape"),
        (torch.zeros(MB, 32, dtype=torch.uint8), "token", "carries tensors"),
    ],
)
async def test_a_malformed_tokens_tensor_is_refused_and_changes_nothing(
    tokens: torch.Tensor | None, name: str, message: str
) -> None:
    inbox = _inbox("tiny-subspace")
    with pytest.raises(FrameError, match=message):
        await inbox.admit(parse_frame(_forward_frame(tokens, name), LIMITS))
    assert inbox.accepted == 0 and not inbox.forwards
    await inbox.admit(parse_frame(_forward_frame(torch.ones(MB, 32, dtype=torch.uint8)), LIMITS))
    assert inbox.accepted == 1
    # A model that carries no tokens refuses a frame that does carry them.
    with pytest.raises(FrameError, match="carries tensors"):
        await _inbox("tiny").admit(
            parse_frame(_forward_frame(torch.ones(MB, 32, dtype=torch.uint8)), LIMITS)
        )


@pytest.mark.parametrize("recompute", [False, True])
def test_a_stage_passes_the_tokens_on_and_computes_what_the_blocks_do(recompute: bool) -> None:
    model = get_model("tiny-subspace")
    tokens, targets = _tokens(MB, seed=6), _tokens(MB, seed=7)
    c = torch.randn(MB, 32, 16)
    with ThreadPoolExecutor(1) as pool:
        stage = StageCompute(
            spec=MIDDLE, model=model, blocks=model.build_stage(0, 1, 2), run=_run(recompute),
            executor=pool,
        )  # fmt: skip
        received = {"hidden": c, "targets": targets, "tokens": tokens}
        frame = parse_frame(stage.forward(0, 0, received, ()).result(), LIMITS)
        out, _ = frame.decode_with({})
        grad = torch.randn(MB, 32, 16)
        _, back = stage.backward(0, grad)
    assert [h.name for h in frame.headers] == ["hidden", "targets", "tokens"]
    assert torch.equal(out["tokens"], tokens) and torch.equal(out["targets"], targets)
    (block,) = model.build_stage(0, 1, 2)
    x = c.detach().clone().requires_grad_(True)
    expected = block(x, tokens)
    assert torch.allclose(out["hidden"], expected, atol=1e-6)
    expected.backward(grad)
    assert back is not None
    got, _ = parse_frame(back.result(), LIMITS).decode_with({})
    assert x.grad is not None and torch.allclose(got["grad"], x.grad, atol=1e-6)


def test_three_node_processes_train_it_and_send_a_fraction_of_the_plain_models_bytes(
    tmp_path: Path,
) -> None:
    args = ("--nodes", "3", "--steps", "5", "--codec", "none", "--no-lz4")
    models = {"sub": "small-subspace", "plain": "small"}
    runs = demo_summaries(tmp_path, {run: ("--model", name, *args) for run, name in models.items()})
    sub, plain = runs["sub"], runs["plain"]
    assert math.isfinite(sub["final_loss"]) and sub["final_loss"] < sub["initial_loss"]
    # small: d = 128 floats per token; small-subspace: k = 16 floats plus a 1-byte token id.
    for key in ("activation_bytes_per_sample", "gradient_bytes_per_sample"):
        assert 7 * sub[key] < plain[key], (key, sub[key], plain[key])
    fp32 = sum(s["activation_fp32_bytes"] for s in sub["stages"])
    assert fp32 == 2 * 5 * 16 * 64 * 16 * 4  # 2 boundaries, 80 samples, T = 64, k = 16
