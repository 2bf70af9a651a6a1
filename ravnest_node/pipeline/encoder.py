"""The frames a stage sends: activations downstream and gradients upstream, each role encoded
with its codec choice (codec_choice.py), and the float32 size of what they carry.

The codecs encode a tensor on its device and move only their small results (codes, scales) to
the host (compression/host.py). For a tensor on a CUDA device this module moves them on a side
stream (`SideStreamCopy`), so the copies do not hold up the compute stream's next kernels; on
the CPU nothing is copied.

The encoding runs on the encoder's own coder thread (`submit_forward`, `submit_backward`), so
the compute thread goes on with the next microbatch while a frame is coded (klt's transform and
entropy coding, int4's packing, lz4). One thread: frames are coded in the order they are
submitted, and the codecs' sender state (a klt basis, an aq reference) and the codec choices
are touched by that thread only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ravnest_node.compression import get_codec
from ravnest_node.compression.host import copying_with
from ravnest_node.pipeline.codec_choice import CodecChoice
from ravnest_node.pipeline.run import TrainConfig
from ravnest_node.pipeline.schedule import GRAD, HIDDEN, TARGETS, TOKENS, StageSpec
from ravnest_node.transport.frames import LZ4_MIN_RATIO, FrameKind, Outgoing, encode_frame


class FrameEncoder:
    """Encodes a stage's outgoing frames. `forward` and `backward` run on one thread at a time
    (the coder thread, through the `submit_` methods); the codec choices' reads and the byte
    counts may be read from the event loop."""

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
        self._side_copies: dict[torch.device, SideStreamCopy] = {}
        # (Its thread starts with the first frame submitted, and ends with `close`.)
        self._coder = ThreadPoolExecutor(1, thread_name_prefix=f"coder-{spec.index}")

    def submit_forward(
        self,
        seq: int,
        version: int,
        out: torch.Tensor,
        targets: torch.Tensor,
        samples: tuple[int, ...],
        tokens: torch.Tensor | None = None,
    ) -> Future[bytes]:
        """`forward` on the coder thread, after the frames submitted before it. The caller
        must not modify `out`, `targets` or `tokens` in place until the frame is done."""
        return self._coder.submit(self.forward, seq, version, out, targets, samples, tokens)

    def submit_eval(
        self,
        seq: int,
        version: int,
        out: torch.Tensor,
        targets: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> Future[bytes]:
        """`evaluation` on the coder thread, after the frames submitted before it."""
        return self._coder.submit(self.evaluation, seq, version, out, targets, tokens)

    def submit_backward(self, seq: int, version: int, grad: torch.Tensor) -> Future[bytes]:
        """`backward` on the coder thread, after the frames submitted before it. The caller
        must not modify `grad` in place until the frame is done."""
        return self._coder.submit(self.backward, seq, version, grad)

    def close(self) -> None:
        """No more frames: the coder thread ends once those submitted are done."""
        self._coder.shutdown(wait=False)

    def forward(
        self,
        seq: int,
        version: int,
        out: torch.Tensor,
        targets: torch.Tensor,
        samples: tuple[int, ...],
        tokens: torch.Tensor | None = None,
    ) -> bytes:
        """The forward frame of microbatch `seq`, computed with weights of `version`; with
        the input token ids where given (a model that `carries_tokens`), raw."""
        self.activation_fp32_bytes += 4 * out.numel()
        tensors = self._with_targets(self.activation.outgoing(HIDDEN, out), targets, tokens)
        return self._encode(FrameKind.FORWARD, seq, version, tensors, self.activation, samples)

    def evaluation(
        self,
        seq: int,
        version: int,
        out: torch.Tensor,
        targets: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> bytes:
        """Microbatch `seq` of the evaluation after step `version`: its activation with a
        stateless codec (`CodecChoice.stateless`), left out of the codec choice's measures and
        of the byte counts of training (the link counts it)."""
        tensors = self._with_targets(self.activation.stateless(HIDDEN, out), targets, tokens)
        with self._copying(tensors):
            return encode_frame(FrameKind.EVAL, seq, version, tensors,
                                lz4_min_ratio=self._lz4_ratio)  # fmt: skip

    def _with_targets(
        self, hidden: Outgoing, targets: torch.Tensor, tokens: torch.Tensor | None
    ) -> list[Outgoing]:
        """What a forward or an evaluation frame carries: the activation, the targets and the
        token ids where given, the last two raw."""
        tensors = [hidden, Outgoing(TARGETS, targets, self._raw)]
        if tokens is not None:
            tensors.append(Outgoing(TOKENS, tokens, self._raw))
        return tensors

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
        # CPU seconds of this thread: what coding costs, not how long it waited for a core.
        start_s = time.thread_time()
        with self._copying(tensors):
            message = encode_frame(
                kind,
                seq,
                version,
                tensors,
                samples=samples,
                lz4_min_ratio=self._lz4_ratio,
                packing=packing,
            )
        choice.sent(packing[0], nbytes=len(message), coding_s=time.thread_time() - start_s)
        return message

    def _copying(self, tensors: Sequence[Outgoing]) -> contextlib.AbstractContextManager[None]:
        """Where a tensor is on a CUDA device, the codecs' results leave it by a side stream."""
        for out in tensors:
            device = out.tensor.device
            if device.type == "cuda":
                if device not in self._side_copies:
                    self._side_copies[device] = SideStreamCopy(device)
                return copying_with(self._side_copies[device])
        return contextlib.nullcontext()


class SideStreamCopy:
    """Moves tensors off one CUDA device on a side stream of its own (a `HostCopy`,
    compression/host.py): the copies wait, on the GPU, for the compute stream's work queued so
    far (an event), run `non_blocking` into pinned host memory, and the caller waits for the
    copies' own event, never for the whole device. The compute stream meanwhile runs whatever
    is queued after the event. Pinned buffers come from torch's caching host allocator, so
    steady frames reuse them. CPU tensors pass through. Compute thread only."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ready)
        hosts: list[torch.Tensor] = []
        with torch.cuda.stream(self.stream):
            for t in tensors:
                if t.device.type != "cuda":
                    hosts.append(t)
                    continue
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                # t was made on the compute stream: keep its memory until this stream is done.
                t.record_stream(self.stream)
                hosts.append(host)
        copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
        copied.record(self.stream)
        copied.synchronize()
        return hosts
