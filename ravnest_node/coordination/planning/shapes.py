"""A model as the cost model sees it: per block, parameters, forward FLOPs per sample, the
activation that crosses a cut after it, and the activations autograd keeps for the backward pass.

The Llama presets are computed from their published shapes (`LlamaConfig`, `LLAMA_PRESETS`); a
registered model (`tiny`, `bench-small`) is measured (`model_shape`): its blocks are built,
counted, and run once under a saved-tensors hook. The estimator (estimate.py) takes a shape as
given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ravnest_node.errors import ConfigError
from ravnest_node.models import BlockModel

__all__ = ["LLAMA_PRESETS", "BlockShape", "LlamaConfig", "ModelShape", "model_shape"]


@dataclass(frozen=True, slots=True)
class BlockShape:
    """One block as the cost model sees it; counts are per sample."""

    params: int
    """Parameters of the block."""
    matrix_params: int
    """Parameters in linear layers' weight matrices (what a LoRA base stores compactly); the
    rest (embedding tables, norms, biases) stay fp32 (models/lora.py `freeze`)."""
    matrix_rows: int
    """Output rows of those matrices (an int8 base keeps one scale per row)."""
    largest_matrix: int
    """Elements of its largest matrix (a LoRA base below the compute dtype is dequantised one
    matrix at a time)."""
    adapter_dims: int
    """Sum of ``in + out`` over the linear layers LoRA adapts: rank r adds ``r x`` this."""
    forward_flops: float
    """Forward FLOPs per sample (a multiply-add counts 2)."""
    boundary_elements: int
    """Elements of the block's output per sample: what crosses a cut right after it."""
    saved_bytes: float
    """Bytes of activations autograd keeps from forward to backward, per sample."""
    transient: bool = False
    """Its activations live for one microbatch only (the head, run with the loss at once)."""
    adapted_linears: int = 0
    """Linear layers LoRA adapts: each keeps its adapter's ``A x`` (rank values a token)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model cut into blocks, for estimating."""

    name: str
    blocks: tuple[BlockShape, ...]
    tokens_per_sample: int
    """Tokens one sample holds (the sequence length)."""
    activation_dtype: torch.dtype
    """Dtype of the tensors that cross a boundary (bf16 for the Llama presets)."""

    @property
    def params(self) -> int:
        """Parameters of the whole model."""
        return sum(b.params for b in self.blocks)


@dataclass(kw_only=True, frozen=True, slots=True)
class LlamaConfig:
    """A Llama-architecture decoder (RMSNorm, grouped-query attention, SwiGLU MLP, untied
    embedding and head), as blocks: embedding, one per layer, head."""

    layers: int
    """Transformer layers."""
    hidden: int
    """Width of the residual stream (what crosses every stage boundary)."""
    heads: int
    """Attention (query) heads; must divide `hidden`."""
    kv_heads: int
    """Key/value heads (grouped-query attention); must divide `heads`."""
    mlp_hidden: int
    """Width of the SwiGLU MLP."""
    vocab: int
    """Vocabulary size."""
    seq_len: int = 2048
    """Tokens per sample."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "mlp_hidden", "vocab", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {name} must be a positive integer, not {value!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ConfigError(
                f"heads ({self.heads}) must divide hidden ({self.hidden}) and kv heads "
                f"({self.kv_heads}) must divide heads"
            )

    def shape(self, name: str = "llama", dtype: torch.dtype = torch.bfloat16) -> ModelShape:
        """The blocks of this model, with activations in `dtype` (bf16 as it is trained on
        GPUs, float32 on a CPU)."""
        h, m, v, t = self.hidden, self.mlp_hidden, self.vocab, self.seq_len
        kv = self.kv_heads * (h // self.heads)
        act = dtype.itemsize
        # (in, out) of q, k, v, o, gate, up, down.
        linears = [(h, h), (h, kv), (h, kv), (h, h), (h, m), (h, m), (m, h)]
        matrix = sum(i * o for i, o in linears)
        layer = BlockShape(
            params=matrix + 2 * h,  # two RMSNorm weights
            matrix_params=matrix,
            matrix_rows=sum(o for _, o in linears),
            largest_matrix=max(i * o for i, o in linears),
            adapter_dims=sum(i + o for i, o in linears),
            # Matmuls, plus QK^T and AV over the full sequence (as ByteLM counts them).
            forward_flops=float(2 * t * matrix + 4 * t * t * h),
            boundary_elements=t * h,
            # Per token: both norms' inputs, the normed inputs of the attention and MLP matmuls,
            # the attention output (h each: 5h), Q, K and V (3h: models/pretrained/llama.py
            # repeats the kv heads before attention, and attention keeps its own inputs), and
            # gate, up, SiLU(gate) and their product (4m); Korthikanti et al. (arXiv
            # 2205.05198, sec. 4.1) count the same terms for GPT (34 B/token/h). Measured under
            # a saved-tensors hook in fp32: on a CPU and on an H200 (benchmarks.md, GPU nodes).
            saved_bytes=float(t * (8 * h + 4 * m) * act),
            adapted_linears=len(linears),
        )
        embedding = BlockShape(
            params=v * h,
            matrix_params=0,  # a table, not a linear layer: a LoRA base keeps it fp32
            matrix_rows=0,
            largest_matrix=0,
            adapter_dims=0,
            forward_flops=float(t * h),
            boundary_elements=t * h,
            saved_bytes=float(t * 8),
        )
        head = BlockShape(
            params=v * h + h,
            matrix_params=v * h,
            matrix_rows=v,
            largest_matrix=v * h,
            adapter_dims=0,
            forward_flops=float(2 * t * h * v),
            boundary_elements=t * v,
            # Norm input and head input (2h), logits and fp32 log-probabilities.
            saved_bytes=float(t * (2 * h * act + v * (act + 4))),
            transient=True,
        )
        blocks = (embedding, *([layer] * self.layers), head)
        return ModelShape(name, blocks, t, dtype)


# Published shapes: Meta Llama 3 model cards and config.json of meta-llama/Meta-Llama-3-8B and
# Meta-Llama-3-70B on Hugging Face (num_hidden_layers, hidden_size, num_attention_heads,
# num_key_value_heads, intermediate_size, vocab_size); 8.03 B and 70.6 B parameters.
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-8b": LlamaConfig(
        layers=32, hidden=4096, heads=32, kv_heads=8, mlp_hidden=14336, vocab=128256
    ),
    "llama-70b": LlamaConfig(
        layers=80, hidden=8192, heads=64, kv_heads=8, mlp_hidden=28672, vocab=128256
    ),
}


def model_shape(model: BlockModel) -> ModelShape:
    """The shape of a registered model, measured: its timing blocks (`timing_blocks`: a
    pretrained model's read no weights) are counted, and each runs forward once on one sample
    (the last one with its loss) under a saved-tensors hook that adds up what autograd keeps.
    `block_costs()` is taken as forward FLOPs per sample (ByteLM documents it so; only ratios
    matter once calibrated)."""
    blocks = model.timing_blocks()
    costs = model.block_costs()
    spec = model.input_spec(1)
    x: torch.Tensor = (
        torch.randn(spec.shape, dtype=spec.dtype)
        if spec.dtype.is_floating_point
        else torch.zeros(spec.shape, dtype=spec.dtype)
    )
    shapes = []
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
        matrices = [m.weight for m in linears]
        saved, out = _saved_bytes(model, block, x, last=i == last)
        shapes.append(
            BlockShape(
                params=sum(p.numel() for p in block.parameters()),
                matrix_params=sum(p.numel() for p in matrices),
                matrix_rows=sum(p.shape[0] for p in matrices),
                largest_matrix=max((p.numel() for p in matrices), default=0),
                adapter_dims=0
                if i in (0, last)
                else sum(m.in_features + m.out_features for m in linears),
                forward_flops=float(costs[i]),
                boundary_elements=model.output_spec(i, 1).numel,
                saved_bytes=float(saved),
                transient=i == last,
            )
        )
        x = out
    dtype = model.output_spec(0, 1).dtype
    return ModelShape(model.name, tuple(shapes), spec.numel, dtype)


def _saved_bytes(
    model: BlockModel, block: torch.nn.Module, x: torch.Tensor, *, last: bool
) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves running `block` on `x` (and the loss, for the last block), not
    counting the block's own parameters; and the block's output, detached."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in params:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    inp = x.detach().requires_grad_(x.dtype.is_floating_point)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(inp)
        if last:
            spec = model.target_spec(x.shape[0])
            model.loss(out, torch.zeros(spec.shape, dtype=spec.dtype))
    return total, out.detach()
