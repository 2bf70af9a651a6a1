"""The byte-level LM with its residual stream confined to a fixed k-dimensional subspace, so
that a pipeline boundary carries k of d coordinates per token, exactly.

After Protocol Models / Subspace Networks (Ramasinghe et al., arXiv 2506.01260): the
projections that write into the residual stream are constrained to a predefined subspace,
and the token and position embeddings, which any stage can recompute from the token ids, are
kept apart from it. Here the residual stream that block ``b`` reads is

    h = E_b(tokens) + P_b(positions) + c U^T

with ``U`` ``[d, k]`` a fixed orthonormal basis (a function of ``d`` and ``k`` alone, the
same in every block: a non-persistent buffer, not a parameter), ``c`` ``[B, T, k]`` the
subspace coordinates (what crosses a stage boundary) and ``E_b``, ``P_b`` block ``b``'s own
learned token and position embeddings. Each layer's attention and MLP output projections map
to k coordinates (d -> k): ``c <- c + W_o attn(LN(h))``, then ``c <- c + W_2 gelu(W_1 LN(h))``
with ``h`` recomputed from the new ``c``; so the residual's update lies in span(U) by
construction. Block 0 is the first layer, fed the token ids alone (``c = 0``); the last block
is the head, ``logits = W LN(E(tokens) + P + c U^T)``.

**Departure from the paper**: the paper shares one token/position embedding across the
network; here every block has its own copy (256 x d + seq x d parameters, about 100 k for
bench-small's d = 256: cheap for a byte vocabulary), so blocks still share no parameter (the
block contract, base.py) and any cut works. The cost is only parameters: no wire bytes.

**What a boundary carries**: ``c`` ``[B, T, k]`` float32 (through the run's codec like any
activation; klt keeps its learned basis for k >= 16) plus the token ids ``[B, T]`` uint8, raw
(the model `carries_tokens`; pipeline/schedule.py's TOKENS). With bench-small's d = 256 and
k = 16 the activation is 16x smaller than the plain model's before any codec, and its
gradient likewise (the gradient of ``c``, ``[B, T, k]``).

Why a random ``U`` rather than the first k coordinate axes: LayerNorm is not rotation
invariant (its per-coordinate gain and bias), and a random basis spreads ``c`` over every
coordinate as a plain residual stream would be, rather than piling it into k of them.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from ravnest_node.errors import ConfigError
from ravnest_node.models.base import TensorSpec, to_device
from ravnest_node.models.bytelm import _INIT_STD, VOCAB_SIZE, ByteBlocks, ByteLMConfig

__all__ = ["DEFAULT_K", "SubspaceLM"]

DEFAULT_K = 16
"""Subspace width of the presets: 16 of bench-small's 256 coordinates (the klt codec's
MIN_DIM, so klt still learns a basis of the k coordinates). Chosen by measurement
(docs/bench/subspace_runs.py, seed 0): after 60 steps k = 32 in fp32 gave eval loss 2.828,
k = 16 with klt 2.831, so the wider boundary bought nothing; after 200 steps k = 16 with klt
is at 2.422 against the plain model's 2.396 in fp32 (+1.1%; +0.5% over seeds 0-2) with 146x
fewer boundary bytes."""

_BASIS_SEED = 0x5B5  # U is a function of (d, k) alone: every block, every node, every seed


@functools.cache
def basis(d: int, k: int) -> torch.Tensor:
    """The fixed orthonormal basis ``U`` ``[d, k]`` (float32, CPU): QR of a Gaussian matrix
    drawn from its own generator, so building it leaves the global RNG alone."""
    gen = torch.Generator(device="cpu").manual_seed(_BASIS_SEED + 1009 * d + k)
    gauss = torch.randn(d, k, generator=gen, dtype=torch.float64, device="cpu")
    q, r = torch.linalg.qr(gauss)
    q = q * torch.sign(torch.diagonal(r))  # (a unique QR: R's diagonal positive)
    out: torch.Tensor = q.float()
    return out


class _Reader(nn.Module):
    """A block's own token and position embeddings and the lift of the subspace coordinates:
    the residual stream ``E(tokens) + P + c U^T`` ``[B, T, d]``."""

    def __init__(self, cfg: ByteLMConfig, k: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)
        nn.init.normal_(self.tokens.weight, std=_INIT_STD)
        nn.init.normal_(self.positions.weight, std=_INIT_STD)
        self.register_buffer("basis", basis(cfg.d_model, k).clone(), persistent=False)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``E(tokens) + P`` ``[B, T, d]``."""
        seq, max_seq = tokens.shape[1], self.positions.num_embeddings
        if seq > max_seq:
            raise ValueError(f"a sequence of {seq} tokens is longer than the model's {max_seq}")
        pos = torch.arange(seq, device=tokens.device)
        out: torch.Tensor = self.tokens(tokens.long()) + self.positions(pos)
        return out

    def lift(self, c: torch.Tensor) -> torch.Tensor:
        """``c U^T``: the coordinates as a vector of the residual stream."""
        basis = self.basis
        assert isinstance(basis, torch.Tensor)
        out: torch.Tensor = c @ basis.to(c.dtype).T
        return out


class SubspaceLayer(nn.Module):
    """A pre-norm transformer layer whose attention and MLP write k subspace coordinates:
    (c [B, T, k] or None for the first block, tokens [B, T]) -> c [B, T, k]."""

    def __init__(self, cfg: ByteLMConfig, k: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.k = k
        self.n_heads = cfg.n_heads
        self.reader = _Reader(cfg, k)
        self.ln_attn = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, k)
        self.ln_mlp = nn.LayerNorm(d)
        self.mlp_in = nn.Linear(d, cfg.mlp_ratio * d)
        self.mlp_out = nn.Linear(cfg.mlp_ratio * d, k)
        residual_std = _INIT_STD / math.sqrt(2 * cfg.n_layers)  # as bytelm's (GPT-2)
        for linear, std in (
            (self.qkv, _INIT_STD),
            (self.attn_out, residual_std),
            (self.mlp_in, _INIT_STD),
            (self.mlp_out, residual_std),
        ):
            nn.init.normal_(linear.weight, std=std)
            nn.init.zeros_(linear.bias)

    def forward(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        base = self.reader.embed(tokens)
        if not c.is_floating_point():  # block 0: fed the token ids, no coordinates yet
            c = base.new_zeros(*base.shape[:2], self.k)
        batch, seq, d = base.shape
        h = base + self.reader.lift(c)
        head_dim = d // self.n_heads
        q, kk, v = self.qkv(self.ln_attn(h)).split(d, dim=2)
        q, kk, v = (t.view(batch, seq, self.n_heads, head_dim).transpose(1, 2) for t in (q, kk, v))
        attn = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        c = c + self.attn_out(attn.transpose(1, 2).reshape(batch, seq, d))
        h = base + self.reader.lift(c)
        out: torch.Tensor = c + self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(h))))
        return out


class SubspaceHead(nn.Module):
    """Final LayerNorm of the whole residual stream and an untied linear head:
    (c [B, T, k], tokens [B, T]) -> logits [B, T, 256]."""

    def __init__(self, cfg: ByteLMConfig, k: int) -> None:
        super().__init__()
        self.reader = _Reader(cfg, k)
        self.ln = nn.LayerNorm(cfg.d_model)
        self.linear = nn.Linear(cfg.d_model, VOCAB_SIZE)
        nn.init.normal_(self.linear.weight, std=_INIT_STD)
        nn.init.zeros_(self.linear.bias)

    def forward(self, c: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        h = self.reader.embed(tokens) + self.reader.lift(c)
        out: torch.Tensor = self.linear(self.ln(h))
        return out


class _TimedAlone(nn.Module):
    """A block called with its input alone, for `timing_blocks` (capabilities.py times one
    tensor in, one out): the token ids are zeros of the input's batch and length."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x if not x.is_floating_point() else x.new_zeros(x.shape[:2], dtype=torch.long)
        out: torch.Tensor = self.block(x, tokens.detach())
        return out


class SubspaceLM(ByteBlocks):
    """The subspace byte LM as ``n_layers + 1`` blocks: one per layer (the first fed the token
    ids), then the head. Between blocks: the k subspace coordinates ``[B, T, k]``; every block
    is called with ``(x, tokens)`` (`carries_tokens`)."""

    carries_tokens = True

    def __init__(self, cfg: ByteLMConfig, k: int = DEFAULT_K, *, name: str = "subspace") -> None:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= cfg.d_model:
            raise ConfigError(f"subspace width k must be an int in 1..{cfg.d_model}, got {k!r}")
        self.cfg = cfg
        self.k = k
        self.name = name

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def width(self) -> int:
        return self.k

    def _block(self, i: int) -> nn.Module:
        if i < self.cfg.n_layers:
            return SubspaceLayer(self.cfg, self.k)
        return SubspaceHead(self.cfg, self.k)

    def num_blocks(self) -> int:
        return self.cfg.n_layers + 1

    def block_costs(self) -> list[float]:
        """Forward FLOPs per sample (a multiply-add counts 2), as bytelm's: a layer's QKV and
        MLP-in matmuls ``2 T (3 + r) d^2``, its two output projections ``2 T (1 + r) d k``,
        the scores ``4 T^2 d``, the lift ``2 * 2 T d k`` and its embedding ``T d``; the head
        ``2 T d 256`` plus its embedding and lift."""
        t, d, r, k = self.cfg.seq_len, self.cfg.d_model, self.cfg.mlp_ratio, self.k
        layer = 2 * t * (3 + r) * d * d + 2 * t * (1 + r) * d * k + 4 * t * t * d
        layer += 4 * t * d * k + t * d
        head = 2 * t * d * VOCAB_SIZE + 2 * t * d * k + t * d
        return [float(layer)] * self.cfg.n_layers + [float(head)]

    def output_spec(self, block: int, batch: int) -> TensorSpec:
        spec = super().output_spec(block, batch)
        return spec if spec.name == "logits" else TensorSpec("coords", spec.shape, spec.dtype)

    def timing_blocks(self, *, device: torch.device | None = None) -> list[nn.Module]:
        return [to_device(_TimedAlone(b), device) for b in self.build_blocks(0)]

    def __repr__(self) -> str:
        return f"SubspaceLM({self.cfg!r}, k={self.k}, name={self.name!r})"
