"""Entropy coding of small integer codes with rANS (Duda, arXiv 1311.2540), through the
compiled coder of `constriction` (Bamler; its stack `AnsCoder`: 32-bit words, 24-bit
probabilities).

`encode(codes)` takes integer codes [lanes, n] in -A..A and returns (A, models, payload); each
lane (a column of a transform codec's coefficients, whose codes share one distribution) is coded
with its own static model, chosen from MODELS by the sender to minimise that lane's length and
named by one byte (`models`). A model is a two-sided geometric distribution: P(0) and a ratio r
for |q| >= 1 (P(+-q) proportional to r^(|q|-1)). Its integer frequencies over -A..A (each at
least 1, summing to 2^16) are built with integer arithmetic only, so both ends build the same
tables on any machine; constriction rescales them to its 24-bit fixed point (`Categorical`,
perfect=False) with a fixed sequence of IEEE double operations on these exact integers, so both
ends get the same fixed-point model too.

The lanes that name the same model are coded as one run of symbols (lane after lane, each
lane's codes in order), one coder call per model in use, the runs in increasing model number
(a lane's symbol is its code + A). A symbol costs about -log2(f / 2^16) bits, at most 24; the
coder adds at most 64 bits for its final state.

Payload: the coder's compressed words, uint32 little-endian (nothing when there are no codes
or A is 0: every code is then 0).

A payload that is not a whole number of words, or that the coder refuses, or that is not used
up exactly by the codes it must hold (the coder not empty after the last run) is corrupt
(FrameError). Pure torch and numpy around the compiled coder, no I/O.
"""

from __future__ import annotations

import functools

import constriction
import numpy as np
import torch

from ravnest_node.errors import FrameError

PROB_BITS = 16
TOTAL = 1 << PROB_BITS
MAX_CODE = 255
"""Largest |code| a payload may hold (A); the alphabet is -A..A."""
MAX_SYMBOL_BITS = 24
"""Most bits one symbol can cost: constriction gives every symbol at least 2^-24."""
# P(0) and the tail ratio of the models, in units of 2^-16 (integers: the tables are exact).
_P0 = (65209, 64880, 64225, 62915, 60948, 58982, 55706, 52429,
       45875, 39322, 32768, 26214, 19661, 13107, 7864, 3932)  # fmt: skip
_RATIO = (1311, 3277, 6554, 13107, 19661, 26214, 32768, 39322,
          45875, 49152, 52429, 55706, 58982, 60948, 62915, 64225)  # fmt: skip
MODELS = len(_P0) * len(_RATIO)
"""Number of models a lane may name (one byte)."""


@functools.lru_cache(maxsize=1)
def _weights() -> torch.Tensor:
    """Unnormalised weights [MODELS, 2 MAX_CODE + 1] of every model over -MAX_CODE..MAX_CODE;
    a narrower alphabet -a..a takes the middle 2a+1 of them (the weights of |q| do not depend
    on a). Integer arithmetic only; built once."""
    p0 = torch.tensor(_P0, dtype=torch.int64).repeat_interleave(len(_RATIO))
    ratio = torch.tensor(_RATIO, dtype=torch.int64).repeat(len(_P0))
    weights = torch.zeros(MODELS, 2 * MAX_CODE + 1, dtype=torch.int64)
    weights[:, MAX_CODE] = p0 << 16
    # |q| = 1 takes (1 - r) of the tail mass, split between the signs; each next one r times it.
    tail = ((TOTAL - p0) * (TOTAL - ratio)) >> 1
    for q in range(1, MAX_CODE + 1):
        weights[:, MAX_CODE + q] = tail
        weights[:, MAX_CODE - q] = tail
        tail = (tail * ratio) >> 16
    return weights


@functools.lru_cache(maxsize=32)
def tables(a: int) -> torch.Tensor:
    """Frequencies [MODELS, 2a+1] of every model over the codes -a..a (int64, rows sum to
    TOTAL, every entry >= 1). Integer arithmetic only. Cached (both ends build them for every
    frame, and `a` changes from frame to frame): callers must not modify the tensor."""
    if not 0 <= a <= MAX_CODE:
        raise ValueError(f"codes must lie within -{MAX_CODE}..{MAX_CODE}, not -{a}..{a}")
    weights = _weights()[:, MAX_CODE - a : MAX_CODE + a + 1]
    symbols = 2 * a + 1
    freq = 1 + weights * (TOTAL - symbols) // weights.sum(1, keepdim=True)
    freq[:, a] += TOTAL - freq.sum(1)
    return freq


@functools.lru_cache(maxsize=32)
def _bits(a: int) -> torch.Tensor:
    """Bits [a+1, MODELS] that each model spends on a code of |q| = 0..a (cached; a model
    spends the same on q and -q)."""
    return -torch.log2(tables(a)[:, a:].double() / TOTAL).T.contiguous()


@functools.lru_cache(maxsize=1024)
def _model(a: int, m: int) -> object:
    """Model m over the symbols 0..2a as constriction's fixed-point categorical model (built
    from the exact integer frequencies; cached, both ends build them for every frame)."""
    freq = tables(a)[m].numpy().astype(np.float64)
    return constriction.stream.model.Categorical(freq, perfect=False)


def encode(codes: torch.Tensor) -> tuple[int, torch.Tensor, bytes]:
    """(A, model per lane [lanes] uint8, payload) of integer codes [lanes, n]."""
    lanes, n = codes.shape
    # Lane after lane in memory (a transform codec's lanes are columns: one transposed copy,
    # cheapest in the codes' own small dtype).
    codes = codes.contiguous()
    a = 0
    if codes.numel():
        lo, hi = torch.aminmax(codes)
        a = max(-int(lo), int(hi))
    k = 2 * a + 1
    symbols = codes.to(torch.int32) + a
    offsets = (torch.arange(lanes, dtype=torch.int32) * k).unsqueeze(1)
    hist = torch.bincount((symbols + offsets).reshape(-1), minlength=lanes * k).view(lanes, k)
    # Each lane's length under every model, from its counts of |q| (the models are symmetric).
    folded = hist[:, a:].double()
    folded[:, 1:] += hist[:, :a].flip(1)
    cost = folded @ _bits(a)  # [lanes, MODELS]
    # (numpy's argmin, like torch's, takes the first of equal costs; it is the faster one here)
    lane_model = cost.numpy().argmin(1).astype(np.uint8)
    model = torch.from_numpy(lane_model)
    if a == 0:  # every code is 0: nothing to send (and a one-symbol model has no coder)
        return a, model, b""
    # The lanes in run order (by model, each model's lanes in increasing order), each lane's
    # codes contiguous: every run is one slice of `table`.
    order = np.argsort(lane_model, kind="stable")
    used, counts = np.unique(lane_model, return_counts=True)
    table = symbols.numpy()[order].reshape(-1)
    ends = np.cumsum(counts) * n
    coder = constriction.stream.stack.AnsCoder()
    # A stack: the run the decoder reads first (lowest model number) is pushed last.
    for m, start, end in zip(used[::-1], (ends - counts * n)[::-1], ends[::-1], strict=True):
        coder.encode_reverse(table[start:end], _model(a, int(m)))
    words = coder.get_compressed()
    return a, model, words.astype("<u4", copy=False).tobytes()


def payload_bounds(lanes: int, n: int, a: int) -> tuple[int, int]:
    """Smallest and largest payload in bytes for `lanes` lanes of `n` codes in -a..a."""
    symbols = lanes * n
    if symbols == 0 or a == 0:
        return 0, 0
    # (0 bytes is a payload too: a run of the symbol at the bottom of its model, from the
    # coder's empty state, leaves it empty.)
    return 0, 4 * (-(-symbols * MAX_SYMBOL_BITS // 32) + 2)


def decode(payload: memoryview, a: int, models: torch.Tensor, n: int) -> torch.Tensor:
    """The codes [lanes, n] (int64) of a payload; `models` [lanes] the lanes' model numbers.
    FrameError for a payload that is not what `encode` makes of some codes."""
    return decode_symbols(payload, a, models, n).to(torch.int64) - a


def decode_symbols(payload: memoryview, a: int, models: torch.Tensor, n: int) -> torch.Tensor:
    """`decode` as the coder's symbols, code + a [lanes, n] (int32, contiguous)."""
    lanes = models.numel()
    if not 0 <= a <= MAX_CODE:
        raise FrameError(f"rans: codes beyond -{MAX_CODE}..{MAX_CODE}")
    if lanes and int(models.max()) >= MODELS:
        raise FrameError("rans: a lane names a model that does not exist")
    lo, hi = payload_bounds(lanes, n, a)
    if not lo <= len(payload) <= hi or len(payload) % 4:
        raise FrameError(f"rans: payload of {len(payload)} bytes for {lanes} lanes of {n} codes")
    if a == 0 or lanes * n == 0:
        return torch.zeros(lanes, n, dtype=torch.int32)  # (symbol a of 0 is code 0)
    out = np.empty((lanes, n), dtype=np.int32)
    words = np.frombuffer(payload, dtype="<u4").astype(np.uint32)  # (a copy: the coder's own)
    lane_model = models.numpy()
    order = np.argsort(lane_model, kind="stable")  # the lanes in run order
    used, counts = np.unique(lane_model, return_counts=True)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        start = 0
        for m, count in zip(used, counts, strict=True):
            run = coder.decode(_model(a, int(m)), int(count) * n)
            out[order[start : start + count]] = run.reshape(count, n)
            start += count
        empty = coder.is_empty()
    except (ValueError, RuntimeError) as exc:  # e.g. a last word of 0, which no encoder ends on
        raise FrameError(f"rans: corrupt payload ({exc})") from None
    if not empty:
        raise FrameError("rans: corrupt payload (its words do not decode to exactly its codes)")
    return torch.from_numpy(out)
