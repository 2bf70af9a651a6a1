"""Settings of replica averaging and the codecs a parameter delta may travel with."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ravnest_node.compression import CODECS, Codec
from ravnest_node.compression.codecs import INT4_BLOCK, INT8_BLOCK
from ravnest_node.compression.powersgd import PowerSGD
from ravnest_node.compression.quant import BlockQuant, int4_block, int8_block
from ravnest_node.errors import ConfigError

DELTA_CODECS = ("none", "bf16", "int8-block", "int4-block", "powersgd")
"""Codecs a delta may be sent with. The block codecs and powersgd keep an error-feedback
residual per group; the others are (nearly) lossless and stateless."""
POWERSGD_RANK = 4
"""r of `powersgd` (rank 1-4 is typical; the paper reaches full accuracy at rank 2)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class AveragingConfig:
    """How the members of a replica group average their parameters (DiLoCo outer rounds)."""

    every_steps: int = 16
    """H: local optimizer steps between two outer rounds."""
    outer_lr: float = 0.7
    """η_out: the outer learning rate (0.7 in DiLoCo)."""
    momentum: float = 0.9
    """μ: the outer Nesterov momentum (0.9 in DiLoCo; 0 gives plain averaging when η_out = 1)."""
    codec: str = "int8-block"
    """Codec of the deltas on the wire: one of DELTA_CODECS (block codecs and powersgd use error
    feedback)."""
    timeout_s: float = 10.0
    """Seconds a round waits for the other members before it completes without them."""
    max_norm_ratio: float = 10.0
    """Poisoning guard: with 3 or more deltas, one whose L2 norm exceeds this many times the
    median norm of the round is rejected (math.inf turns the guard off)."""
    clip_ratio: float = 3.0
    """Poisoning guard: with 3 or more deltas, one whose L2 norm exceeds this many times the
    median norm (but not max_norm_ratio times) is scaled down to it before averaging
    (math.inf: no clipping)."""
    ban_after: int = 3
    """A replica whose delta is rejected in this many rounds is banned for the run (0: never)."""
    lands_after: int = 0
    """Where a round's mean is applied. 0: as soon as it arrives, between two microbatches
    (when is a matter of timing). k >= 1: right after the k-th optimizer step following the
    round's start, waited for if it is late, so that a synchronous run (`--max-staleness 0`)
    trains the same weights every time."""

    def __post_init__(self) -> None:
        if type(self.every_steps) is not int or self.every_steps < 1:
            raise ConfigError(f"every_steps={self.every_steps!r}: must be an int >= 1")
        if not (math.isfinite(self.outer_lr) and self.outer_lr > 0):
            raise ConfigError(f"outer_lr={self.outer_lr!r}: must be a finite number > 0 (e.g. 0.7)")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum={self.momentum!r}: must be in [0, 1) (e.g. 0.9)")
        if self.codec not in DELTA_CODECS:
            raise ConfigError(
                f"codec={self.codec!r}: deltas travel with one of {', '.join(DELTA_CODECS)}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(
                f"timeout_s={self.timeout_s!r}: must be a finite number of seconds > 0"
            )
        if not self.max_norm_ratio >= 1:  # also refuses NaN
            raise ConfigError(
                f"max_norm_ratio={self.max_norm_ratio!r}: must be >= 1 (math.inf turns it off)"
            )

        if not self.clip_ratio >= 1:  # also refuses NaN
            raise ConfigError(
                f"clip_ratio={self.clip_ratio!r}: must be >= 1 (math.inf turns clipping off)"
            )
        if type(self.ban_after) is not int or self.ban_after < 0:
            raise ConfigError(f"ban_after={self.ban_after!r}: must be an int >= 0 (0: never ban)")
        if type(self.lands_after) is not int or self.lands_after < 0:
            raise ConfigError(
                f"lands_after={self.lands_after!r}: must be an int >= 0 (0: when it arrives)"
            )

    def round_due(self, step: int) -> bool:
        """Whether an outer round starts after optimizer step `step` (1-based count of steps
        applied): every `every_steps` steps."""
        return step > 0 and step % self.every_steps == 0

    def round_of(self, step: int) -> int:
        """The number of the outer round that starts after step `step`: step // H - 1 (round 0
        starts after step H)."""
        return step // self.every_steps - 1


def delta_codec(name: str, layout: Sequence[Sequence[int]] | None = None) -> Codec:
    """The sender's codec for deltas called `name`: int8-block (block 512) and int4-block
    (block 64) with error feedback, none and bf16 as registered, powersgd (rank POWERSGD_RANK,
    error feedback) for a flat vector of `layout` (the shapes of the stage's parameters, in
    order). Receivers decode with the registered codec of the same name, or with this one for
    powersgd, which is not registered: it needs the layout. ConfigError for any other name, or
    powersgd without a layout."""
    if name == "powersgd":
        if layout is None:
            raise ConfigError("codec powersgd needs the layout (shapes) of the stage's parameters")
        return PowerSGD(layout=tuple(tuple(s) for s in layout), rank=POWERSGD_RANK)
    if name == "int8-block":
        return int8_block(INT8_BLOCK, error_feedback=True)
    if name == "int4-block":
        return int4_block(INT4_BLOCK, error_feedback=True)
    if name in DELTA_CODECS:
        return CODECS[name]
    raise ConfigError(f"codec {name!r}: deltas travel with one of {', '.join(DELTA_CODECS)}")


def payload_nbytes(codec: Codec, numel: int) -> int:
    """Bytes of the payload that `codec` makes of a flat float32 tensor of `numel` elements,
    before lz4 (which is kept only when it shrinks the payload)."""
    if isinstance(codec, PowerSGD):
        return codec.payload_nbytes((numel,), torch.float32, codec.params)
    params = {"bits": codec.bits, "block": codec.block} if isinstance(codec, BlockQuant) else {}
    return codec.payload_nbytes((numel,), torch.float32, params)
