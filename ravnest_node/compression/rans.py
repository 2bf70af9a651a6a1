"""Entropy coding of small integer codes: interleaved rANS (Duda, arXiv 1311.2540), one lane per
column, the loops vectorised over the lanes in numpy.

`encode(codes)` takes integer codes [lanes, n] in -A..A and returns (A, models, payload); each
lane (a column of a transform codec's coefficients, whose codes share one distribution) is coded
with its own static model, chosen from MODELS by the sender to minimise that lane's length and
named by one byte (`models`). A model is a two-sided geometric distribution: P(0) and a ratio r
for |q| >= 1 (P(+-q) proportional to r^(|q|-1)). Its integer frequencies over -A..A (each at
least 1, summing to 2^16) are built with integer arithmetic only, so both ends build the same
tables on any machine.

Coder: state x in [2^16, 2^32), 16-bit words. Encoding symbol s (frequency f, cumulative c),
from the lane's last code to its first: if x >= f * 2^16, emit the low 16 bits and shift them
out; then x <- (x // f) * 2^16 + x % f + c. Decoding runs forward: slot = x mod 2^16 names the
symbol, x <- f * (x >> 16) + slot - c, and x takes the lane's next word while it is below 2^16.
A symbol costs -log2(f / 2^16) bits; each lane adds 32 bits for its final state.

Payload (little-endian):

```
uint16 words[lanes]     the number of words of each lane, final state included (>= 2)
uint16 stream...        lane by lane: the final state (high word, low word), then the words in
                        the order the decoder reads them
```

The decoder never reads past a lane's words: a lane that wants more words than it has, has
words left over, or does not end in the encoder's initial state (2^16) makes the payload corrupt
(FrameError). Pure torch and numpy (the coder's loops), no I/O.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from ravnest_node.errors import FrameError

PROB_BITS = 16
TOTAL = 1 << PROB_BITS
LOW = 1 << 16
"""Lower bound of the state (and the encoder's initial state)."""
MAX_CODE = 255
"""Largest |code| a payload may hold (A); the alphabet is -A..A."""
# P(0) and the tail ratio of the models, in units of 2^-16 (integers: the tables are exact).
_P0 = (65209, 64880, 64225, 62915, 60948, 58982, 55706, 52429,
       45875, 39322, 32768, 26214, 19661, 13107, 7864, 3932)  # fmt: skip
_RATIO = (1311, 3277, 6554, 13107, 19661, 26214, 32768, 39322,
          45875, 49152, 52429, 55706, 58982, 60948, 62915, 64225)  # fmt: skip
MODELS = len(_P0) * len(_RATIO)
"""Number of models a lane may name (one byte)."""


@functools.lru_cache(maxsize=32)
def tables(a: int) -> torch.Tensor:
    """Frequencies [MODELS, 2a+1] of every model over the codes -a..a (int64, rows sum to
    TOTAL, every entry >= 1). Integer arithmetic only. Cached (both ends build them for every
    frame): callers must not modify the tensor."""
    if not 0 <= a <= MAX_CODE:
        raise ValueError(f"codes must lie within -{MAX_CODE}..{MAX_CODE}, not -{a}..{a}")
    p0 = torch.tensor(_P0, dtype=torch.int64).repeat_interleave(len(_RATIO))
    ratio = torch.tensor(_RATIO, dtype=torch.int64).repeat(len(_P0))
    weights = torch.zeros(MODELS, 2 * a + 1, dtype=torch.int64)
    weights[:, a] = p0 << 16
    # |q| = 1 takes (1 - r) of the tail mass, split between the signs; each next one r times it.
    tail = ((TOTAL - p0) * (TOTAL - ratio)) >> 1
    for q in range(1, a + 1):
        weights[:, a + q] = tail
        weights[:, a - q] = tail
        tail = (tail * ratio) >> 16
    symbols = 2 * a + 1
    freq = 1 + weights * (TOTAL - symbols) // weights.sum(1, keepdim=True)
    freq[:, a] += TOTAL - freq.sum(1)
    return freq


def encode(codes: torch.Tensor) -> tuple[int, torch.Tensor, bytes]:
    """(A, model per lane [lanes] uint8, payload) of integer codes [lanes, n] with n >= 1."""
    lanes, n = codes.shape
    a = int(codes.abs().max()) if codes.numel() else 0
    freq = tables(a)
    symbols = (codes.to(torch.int64) + a).contiguous()
    k = 2 * a + 1
    offsets = (torch.arange(lanes, dtype=torch.int64) * k).unsqueeze(1)
    hist = torch.bincount((symbols + offsets).reshape(-1), minlength=lanes * k).double()
    cost = hist.view(lanes, k) @ -torch.log2(freq.double() / TOTAL).T  # [lanes, MODELS]
    model = cost.argmin(1)
    lane_freq = freq[model]  # [lanes, k]
    lane_cum = torch.cumsum(lane_freq, 1) - lane_freq
    # The loop runs in numpy: its per-call cost is a fraction of torch's on [lanes] vectors.
    f = lane_freq.gather(1, symbols).T.contiguous().numpy()  # [n, lanes]
    c = lane_cum.gather(1, symbols).T.contiguous().numpy()
    x = np.full(lanes, LOW, dtype=np.int64)
    words = np.zeros((n, lanes), dtype=np.int64)
    emitted = np.zeros((n, lanes), dtype=np.bool_)
    for t in range(n - 1, -1, -1):
        ft = f[t]
        out = x >= (ft << 16)
        words[t] = x & 0xFFFF
        emitted[t] = out
        x = np.where(out, x >> 16, x)
        q, r = np.divmod(x, ft)
        x = (q << 16) + r + c[t]
    counts = emitted.sum(0) + 2
    # Lane by lane: the final state, then the words in the order the decoder reads them.
    full = np.concatenate([(x >> 16)[:, None], (x & 0xFFFF)[:, None], words.T], 1)
    keep = np.concatenate([np.ones((lanes, 2), dtype=np.bool_), emitted.T], 1)
    payload = np.concatenate([counts, full[keep]]).astype("<u2")
    return a, model.to(torch.uint8), payload.tobytes()


def payload_bounds(lanes: int, n: int) -> tuple[int, int]:
    """Smallest and largest payload in bytes for `lanes` lanes of `n` codes."""
    return 2 * lanes + 4 * lanes, 2 * lanes + 2 * lanes * (n + 2)


def decode(payload: memoryview, a: int, models: torch.Tensor, n: int) -> torch.Tensor:
    """The codes [lanes, n] (int64) of a payload; `models` [lanes] the lanes' model numbers.
    FrameError for a payload that is not what `encode` makes of some codes."""
    lanes = models.numel()
    if not 0 <= a <= MAX_CODE:
        raise FrameError(f"rans: codes beyond -{MAX_CODE}..{MAX_CODE}")
    if lanes and int(models.max()) >= MODELS:
        raise FrameError("rans: a lane names a model that does not exist")
    lo, hi = payload_bounds(lanes, n)
    if not lo <= len(payload) <= hi or len(payload) % 2:
        raise FrameError(f"rans: payload of {len(payload)} bytes for {lanes} lanes of {n} codes")
    raw = np.frombuffer(payload, dtype="<u2").astype(np.int64)
    counts = raw[:lanes]
    if bool((counts < 2).any()) or bool((counts > n + 2).any()):
        raise FrameError("rans: a lane's word count is out of range")
    if int(counts.sum()) != raw.size - lanes:
        raise FrameError("rans: the lanes' word counts do not add up to the payload")
    start = np.cumsum(counts) - counts + lanes  # index of each lane's first word
    x = (raw[start] << 16) | raw[start + 1]
    if bool((x < LOW).any()):
        raise FrameError("rans: a lane's final state is below the coder's range")
    ptr = start + 2
    end = start + counts
    k = 2 * a + 1
    # The models' cumulative frequencies in one sorted array, model m's offset by m * 2^17
    # (each lies in 1..2^16), so one searchsorted finds every lane's symbol; tables of the
    # MODELS models, not of every lane, so memory does not grow with the lanes.
    freq = tables(a).numpy()  # [MODELS, k]
    spacing = np.arange(MODELS, dtype=np.int64) * (2 * TOTAL)
    cum = (np.cumsum(freq, 1) + spacing[:, None]).reshape(-1)
    flat_freq = freq.reshape(-1)
    flat_base = (np.cumsum(freq, 1) - freq).reshape(-1)
    lane_model = models.to(torch.int64).numpy()
    offset = spacing[lane_model]
    first = lane_model * k
    out = np.empty((n, lanes), dtype=np.int64)
    bad = np.zeros(lanes, dtype=np.bool_)
    last = raw.size - 1
    for t in range(n):
        slot = x & 0xFFFF
        index = np.searchsorted(cum, slot + offset, side="right")
        out[t] = index - first
        x = flat_freq[index] * (x >> 16) + slot - flat_base[index]
        refill = x < LOW
        bad |= refill & (ptr >= end)
        x = np.where(refill, (x << 16) | raw[np.minimum(ptr, last)], x)
        ptr = ptr + refill
    if bool(bad.any()) or bool((ptr != end).any()) or bool((x != LOW).any()):
        raise FrameError("rans: corrupt payload (a lane's words do not decode to its codes)")
    return torch.from_numpy(out.T - a)
