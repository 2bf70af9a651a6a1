"""The codec one stage sends one role with over one link: fixed by the run, or chosen by `auto`.

With a named codec this is that codec and its sender state, for the whole run. With `auto` the
stage starts with the most compact codec its peer decodes (nothing is known yet): klt towards
a peer that decodes it, the ladder's smallest (int4-block) otherwise. It re-decides
every `every` frames (one step's microbatches) with `choose_codec` (compression/auto.py) from:
- the link's bandwidth, measured by the worker's probe before the stage starts
  (`bandwidth_bps`; a link that could not be measured keeps the codec it started with), and
- the stage's compute seconds per microbatch: the growth of the stage's compute time over the
  last `every` frames divided by `every`, smoothed over decisions (mean of the last estimate and
  the new one). The first window holds start-up costs (first calls, allocations) and is
  skipped, so the first decision comes at frame 2 x `every`. That first decision is free of
  the hysteresis (the codec it replaces was chosen blind).

Why klt first: on the internet link (10 Mbit/s), where `auto` sends klt from the third step on
anyway, starting with 8 int4-block frames left the held-out loss +1.55% to +3.42% above
compute-bound's (mean +2.86%, twelve runs), 8 bf16 frames +2.98% to +3.30% (three), starting
with klt +1.17% to +1.55% (mean +1.39%, nine; docs/benchmarks.md, "The first frames"): klt's
stream starting two steps late costs the loss, not the first frames' error. The one-process
simulation of the same codecs shows no such difference; what in the pipeline makes it is not
known. (On a noisier day the same code ended five internet runs at +1.27% to +1.43% and five at
+2.25% to +3.65%, parting right after the warm-up: docs/benchmarks.md, "Where the internet runs
part ways".)

Towards a peer that decodes klt (its plan entry says so; an older node does not), klt joins the
candidates after the ladder's (compression/auto.py, `ranked`: activations at klt's finer step,
then its default step; it is taken where int4-block does not fit): its size is the mean of the
frames it made on this link (a prior before the first), and the time a frame takes to encode
here, twice (the peer decodes it), counts against the budget, for every codec: `sent`
measures both. klt's sender state (its learned basis) is kept when `auto` moves away from it
and back, and its frames count from its tenth on
(`_learning`). Activations at the finer step are counted as "klt, fine step"; their bytes enter
klt's running mean divided by FINE_GROWTH, as the default step's. Where nothing fits, not even
klt, klt takes its coarser step ("klt, coarse step", both roles; its bytes enter the mean
divided by COARSE_SHRINK): the link sets the pace there, and fewer bytes are less time.

When int4-block is chosen and still does not fit (`link_bound`) and the peer unpacks deflate
(its plan entry says so), the payloads are also packed with deflate;
`deflated` counts the frames that went deflated (the sender reports each with `sent`). int4-block
then takes its bottleneck variants (`encoder(..., bottleneck=True)`): activations with one scale
per 256 elements, gradients with codes -3..3; both are ordinary int4-block payloads that deflate
packs 12-23% smaller.

A change takes effect at the next frame; the sender state (error feedback, rounding RNG) starts
afresh with the new codec. Changes are logged; the metrics keep the codec of the last frame and
how many frames each codec carried.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ravnest_node.compression import Codec, encoder, get_codec
from ravnest_node.compression.auto import (
    AUTO,
    AUTO_LADDER,
    COARSE,
    COARSE_SHRINK,
    COMPACT,
    COMPACT_PRIOR_CODING_S_PER_ELEMENT,
    DEFLATES,
    FINE,
    FINE_GROWTH,
    LINK_SHARE,
    choose_codec,
    compact_estimate,
    link_bound,
    payload_sizes,
    ranked,
)
from ravnest_node.compression.codecs import COARSE_LABEL, FINE_LABEL, Role, variant_label
from ravnest_node.compression.transform import CODER_COLUMNS, REFRESH_FIRST, KLTState
from ravnest_node.transport.frames import Outgoing

log = logging.getLogger(__name__)

SMOOTHING = 0.5
"""Weight of the newest compute-time estimate against the previous one."""
_STEPS = {FINE: FINE_LABEL, COARSE: COARSE_LABEL}
"""`choose_codec`'s names of klt at another step than its default one: the step's label."""
FRAME_SMOOTHING = 0.1
"""Weight of the newest frame in the running means of a codec's frame bytes and coding time."""


class CodecChoice:
    """One role's codec on one link. `outgoing` runs on the compute thread only; `name`,
    `frames` and `bandwidth_bps` may be read from the event loop at any time."""

    def __init__(
        self,
        name: str,
        role: Role,
        *,
        compute_s: Callable[[], float],
        every: int,
        what: str,
        packs: bool = True,
    ) -> None:
        """`name`: a registered codec or "auto"; `compute_s`: the stage's compute seconds so
        far; `every`: frames between two decisions; `what`: the link, for logs; `packs`: the
        run packs payloads (its lz4 setting; off, nothing is deflated either)."""
        self.auto = name == AUTO
        self.packs = packs
        self.role: Role = role
        self.what = what
        self.bandwidth_bps: float | None = None
        """The link's measured bandwidth (set by the worker before the first frame)."""
        self.share = LINK_SHARE
        """Share of the compute time per microbatch this link's tensor may take (auto.py);
        the worker divides LINK_SHARE among the links that leave from this node's uplink."""
        self.compute_per_microbatch_s: float | None = None
        self.frames: dict[str, int] = {}
        """Frames sent per codec (replaced, never mutated: safe to read from another thread)."""
        self.peer_unpacks_deflate = False
        """The peer unpacks deflated payloads (`meet`)."""
        self.peer_decodes_klt = False
        """The peer decodes klt frames (`meet`): `auto` may pick it."""
        self.peer_klt_coder = 0
        """The newest klt coder format the peer decodes (`meet`): from transform.CODER_COLUMNS,
        klt frames may leave trailing columns out (a fixed `--codec klt` too)."""
        self.frame_bytes: dict[str, float] = {}
        """Running mean of each codec's frame bytes on this link (replaced, never mutated)."""
        self.coding_s: dict[str, float] = {}
        """Running mean of each codec's encoding seconds per frame (replaced, never mutated)."""
        self.deflate = False
        """Whether the next frame asks for deflate (auto, a bottleneck link, a peer that
        unpacks it)."""
        self.deflated = 0
        """Frames that went deflated (`sent`)."""
        self._compute_s = compute_s
        self._every = max(1, every)
        self._kept: dict[str, object | None] = {}  # klt's sender state, kept across switches
        self._current = self._make(AUTO_LADDER[-1] if self.auto else name)
        self._decided = False
        """A decision on measurements has been taken (the next ones keep the hysteresis)."""
        self._sizes: list[tuple[str, int]] | None = None
        self._sent = 0
        self._mark_s = 0.0

    def meet(self, *, unpacks_deflate: bool, decodes_klt: bool, klt_coder: int) -> None:
        """What the peer decodes, from its plan entry (set by the worker before the first
        frame, whether `auto` measures the link or the codec is fixed)."""
        self.peer_unpacks_deflate = unpacks_deflate
        self.peer_decodes_klt = decodes_klt
        self.peer_klt_coder = klt_coder

    @property
    def name(self) -> str:
        """The codec the next frame is sent with."""
        return self._current[0].name

    @property
    def step(self) -> str:
        """klt's step of the next frame where it is not the default one (auto): FINE_LABEL (a
        link with room for it), COARSE_LABEL (a link where even klt sets the pace), else ""."""
        codec = self._current[0]
        return variant_label(codec) if codec.name == COMPACT else ""

    @property
    def fine(self) -> bool:
        """Whether klt activations take the finer step (auto, a link with room for it)."""
        return self.step == FINE_LABEL

    def _make(
        self, name: str, bottleneck: bool = False, step: str = ""
    ) -> tuple[Codec, object | None]:
        codec = encoder(
            name,
            self.role,
            bottleneck=bottleneck,
            fine=step == FINE_LABEL,
            coarse=step == COARSE_LABEL,
        )
        if name == COMPACT:
            return codec, self._kept.setdefault(name, codec.new_state())
        return codec, codec.new_state()

    def outgoing(self, tensor_name: str, tensor: torch.Tensor) -> Outgoing:
        """The tensor with the codec (and sender state) it goes with in this frame."""
        if self.auto and self._sent % self._every == 0:
            self._decide(tensor)
        self._sent += 1
        codec, state = self._current
        if isinstance(state, KLTState):  # what the peer decodes (its plan entry)
            state.columns = self.peer_klt_coder >= CODER_COLUMNS
        key = codec.name + self.step
        self.frames = {**self.frames, key: self.frames.get(key, 0) + 1}
        return Outgoing(tensor_name, tensor, codec, state, deflate=self.deflate)

    def stateless(self, tensor_name: str, tensor: torch.Tensor) -> Outgoing:
        """The tensor for a frame outside the stream's sequence (an evaluation's): with the
        codec the next frame would use where that keeps no sender state, int8-block otherwise
        (a stateful codec's receiver mirrors its sender's state, which such a frame must not
        move). Changes nothing here."""
        codec, state = self._current
        if state is not None:
            codec = get_codec("int8-block")
        return Outgoing(tensor_name, tensor, codec, None)

    def sent(
        self, packing: str, *, nbytes: int | None = None, coding_s: float | None = None
    ) -> None:
        """The frame of the last `outgoing` went with this packing ("deflate", "lz4", ""),
        took `nbytes` on the wire and `coding_s` seconds to encode (where measured)."""
        self.deflated += packing == "deflate"
        name = self.name
        if nbytes is not None and not self._learning(name):
            if self.step:  # (klt's running mean is of frames at its default step)
                nbytes = round(nbytes / self._growth(self.step))
            self.frame_bytes = {**self.frame_bytes, name: _mean(self.frame_bytes.get(name), nbytes)}
        made = sum(self.frames.get(name + step, 0) for step in ("", FINE_LABEL, COARSE_LABEL))
        if coding_s is not None and made > 1:  # (the first frame of a codec holds set-up)
            self.coding_s = {**self.coding_s, name: _mean(self.coding_s.get(name), coding_s)}

    def _decide(self, tensor: torch.Tensor) -> None:
        now_s = self._compute_s()
        window_s, self._mark_s = now_s - self._mark_s, now_s
        if self._sizes is None:  # the first frame: nothing measured yet
            self._sizes = payload_sizes(self.role, tensor.shape, tensor.dtype)
            if self.peer_decodes_klt:  # the most compact codec the peer decodes
                self._current = self._make(COMPACT)
            return
        if self._sent == self._every:  # the first window holds start-up costs: skip it
            return
        per_mb = window_s / self._every
        previous = self.compute_per_microbatch_s
        estimate = per_mb if previous is None else SMOOTHING * per_mb + (1 - SMOOTHING) * previous
        self.compute_per_microbatch_s = estimate
        if self.bandwidth_bps is None or not estimate > 0:
            return
        sizes = list(self._sizes)
        if self.peer_decodes_klt:
            _, klt_bytes = compact_estimate(self.role, tensor.shape, self.frame_bytes.get(COMPACT))
            sizes = ranked(self.role, sizes, klt_bytes)
        coding = self._coding_estimates(tensor.numel())
        chosen = choose_codec(
            sizes,
            bandwidth_bps=self.bandwidth_bps,
            compute_s=estimate,
            current=self.name + self.step if self._decided else None,
            share=self.share,
            coding_s=coding,
        )
        self._decided = True
        step = _STEPS.get(chosen, "")
        chosen = COMPACT if step else chosen
        smallest = self._sizes[-1][1]  # int4-block's (sizes are in ladder order)
        deflate = (
            self.packs
            and self.peer_unpacks_deflate
            and chosen == DEFLATES
            and link_bound(
                smallest,
                bandwidth_bps=self.bandwidth_bps,
                compute_s=estimate,
                was=self.deflate,
                share=self.share,
            )
        )
        if chosen != self.name or deflate != self.deflate or step != self.step:
            before = self._label()
            self._current = self._make(chosen, bottleneck=deflate, step=step)
            self.deflate = deflate
            log.info(
                "%s: codec %s -> %s (link %.1f Mbit/s, compute %.1f ms per microbatch)",
                self.what,
                before,
                self._label(),
                self.bandwidth_bps / 1e6,
                estimate * 1e3,
            )

    def _learning(self, name: str) -> bool:
        """klt is still learning: its first REFRESH_FIRST frames go in the identity basis, 2-3
        times larger than later ones, and the next two learned bases travel in frames 5 and 9
        (frames refresh ever more rarely after). What those take says little of what klt will
        take, so the prior stands until its tenth frame."""
        state = self._kept.get(name)  # (frames: those it learned from, one per frame encoded)
        return isinstance(state, KLTState) and 0 < state.frames <= 2 * REFRESH_FIRST + 1

    def _coding_estimates(self, numel: int) -> dict[str, float]:
        """Seconds each codec's frame costs to encode here and decode at the peer (twice the
        measured encode time; klt's prior before its first frame; klt's at the finer and the
        coarser step as klt's)."""
        coding = {name: 2 * s for name, s in self.coding_s.items()}
        coding.setdefault(COMPACT, 2 * numel * COMPACT_PRIOR_CODING_S_PER_ELEMENT)
        coding[FINE] = coding[COARSE] = coding[COMPACT]
        return coding

    def _growth(self, step: str) -> float:
        """klt's frames at `step` over those at its default step (auto.py)."""
        return FINE_GROWTH if step == FINE_LABEL else COARSE_SHRINK[self.role]

    def _label(self) -> str:
        """The current codec as logs name it: "int4-block, codes -3..3 + deflate"."""
        codec = self._current[0]
        return codec.name + variant_label(codec) + (" + deflate" if self.deflate else "")


def _mean(previous: float | None, value: float) -> float:
    """The running mean with FRAME_SMOOTHING weight on the newest value."""
    if previous is None:
        return float(value)
    return FRAME_SMOOTHING * value + (1 - FRAME_SMOOTHING) * previous
