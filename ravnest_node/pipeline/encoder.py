"""The frames a stage sends: activations downstream and gradients upstream, each role encoded
with its codec choice (codec_choice.py), and the float32 size of what they carry.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ravnest_node.compression import get_codec
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import GRAD, HIDDEN, TARGETS, StageSpec
from ravnest_node.transport.frames import LZ4_MIN_RATIO, FrameKind, Outgoing, encode_frame


class FrameEncoder:
    """Encodes a stage's outgoing frames. `forward` and `gradient` run on the compute thread
    only; the codec choices' reads and the byte counts may be read from the event loop."""

    def __init__(self, spec: StageSpec, run: TrainConfig, compute_s: Callable[[], float]) -> None:
        """`compute_s`: the stage's compute seconds so far (what `auto` weighs links against)."""
        # The codec (and its sender state) of each role on its link: fixed, or chosen by `auto`
        # from the link's measured bandwidth and this stage's compute time (codec_choice.py).
        self.activation = CodecChoice(
            run.activation, "activation", compute_s=compute_s, every=run.microbatches,
            what=f"stage {spec.index} activations downstream", packs=run.lz4,
        )  # fmt: skip
        self.gradient = CodecChoice(
            run.gradient, "gradient", compute_s=compute_s, every=run.microbatches,
            what=f"stage {spec.index} gradients upstream", packs=run.lz4,
        )  # fmt: skip
        self._raw = get_codec("none")
        self._lz4_ratio = LZ4_MIN_RATIO if run.lz4 else 0.0
        self.activation_fp32_bytes = 0
        """Bytes the activations encoded would take as float32 (an int += on the compute
        thread)."""
        self.gradient_fp32_bytes = 0
        """Bytes the gradients encoded would take as float32."""

    def forward(
        self,
        seq: int,
        version: int,
        out: torch.Tensor,
        targets: torch.Tensor,
        samples: tuple[int, ...],
    ) -> bytes:
        """The forward frame of microbatch `seq`, computed with weights of `version`."""
        self.activation_fp32_bytes += 4 * out.numel()
        tensors = [self.activation.outgoing(HIDDEN, out), Outgoing(TARGETS, targets, self._raw)]
        return self._encode(FrameKind.FORWARD, seq, version, tensors, self.activation, samples)

    def backward(self, seq: int, version: int, grad: torch.Tensor) -> bytes:
        """The gradient frame of microbatch `seq`, whose forward used weights of `version`."""
        self.gradient_fp32_bytes += 4 * grad.numel()
        tensors = [self.gradient.outgoing(GRAD, grad)]
        return self._encode(FrameKind.BACKWARD, seq, version, tensors, self.gradient)

    def _encode(
        self,
        kind: FrameKind,
        seq: int,
        version: int,
        tensors: list[Outgoing],
        choice: CodecChoice,
        samples: tuple[int, ...] = (),
    ) -> bytes:
        """The frame, its packing told to the codec choice of its role."""
        packing: list[str] = []
        message = encode_frame(
            kind,
            seq,
            version,
            tensors,
            samples=samples,
            lz4_min_ratio=self._lz4_ratio,
            packing=packing,
        )
        choice.sent(packing[0])
        return message
