"""How fast the klt codec and its entropy coder run on one core: `python -m
ravnest_node.bench.klt_speed`.

Codes bench-small-sized microbatches ([4, 128, 256] float32) that look like the real thing:
activations are rows with a decaying spectrum in a random rotation (x = z diag(decay) Q, Q a
random orthogonal matrix), so that the learned basis matters; gradients are the same with a
steeper decay, through the gradient codec (KLT_GRADIENT). Each codec first sees WARM_FRAMES
frames so that it has learned its basis, then the timed frames go through encode and
decode_stream; the entropy coder (compression/rans.py) is also timed alone on the codes of a
frame. Prints MB/s per core (MB of float32 input per second of one core) and the payload bytes,
for frames of coder 1 (every column) and coder 2 (trailing columns of little energy left out).
A measurement, not a test: it asserts only that what it decodes is what the codec promises.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import ravnest_node.compression.rans as rans
from ravnest_node.compression.transform import KLT, KLT_ACTIVATION, KLT_GRADIENT, KLTBases

SHAPE = (4, 128, 256)
WARM_FRAMES = 10


def spectrum_tensor(gen: torch.Generator, q: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """A [4, 128, 256] tensor whose rows have the spectrum `decay` in the rotation `q`."""
    rows = SHAPE[0] * SHAPE[1]
    z = torch.randn(rows, SHAPE[2], generator=gen)
    return ((z * decay) @ q).reshape(SHAPE)


def _best_s(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(
    codec: KLT, decay_power: float, repeat: int, columns: bool = False
) -> dict[str, float]:
    """`columns`: frames of CODER_COLUMNS (trailing columns left out), else of coder 1."""
    gen = torch.Generator().manual_seed(1)
    d = SHAPE[2]
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    decay = torch.arange(1, d + 1, dtype=torch.float32).pow(-decay_power)
    frames = [spectrum_tensor(gen, q, decay) for _ in range(WARM_FRAMES + repeat)]
    state = codec.new_state()
    state.columns = columns
    bases = KLTBases()
    for x in frames[:WARM_FRAMES]:
        params, payload = codec.encode(x, state)
        _, commit = codec.decode_stream(bases, memoryview(payload), SHAPE, x.dtype, params)
        commit()
    sent_frames = []
    enc_s = dec_s = float("inf")
    for x in frames[WARM_FRAMES:]:  # each decoded in order: a frame may carry a new basis
        start = time.perf_counter()
        params, payload = codec.encode(x, state)
        enc_s = min(enc_s, time.perf_counter() - start)
        start = time.perf_counter()
        value, commit = codec.decode_stream(bases, memoryview(payload), SHAPE, x.dtype, params)
        dec_s = min(dec_s, time.perf_counter() - start)
        commit()
        assert value.shape == x.shape
        sent_frames.append(x)
    sent = sent_frames[-1]
    # The coder alone, on codes of the same size and spread as the frame's.
    y = sent.reshape(-1, d) @ q.T
    codes = (y / (y.abs().amax() / max(1, params["a"]))).round().to(torch.int16).T.contiguous()
    coded: list[tuple[int, torch.Tensor, bytes]] = []
    rans_enc_s = _best_s(lambda: coded.append(rans.encode(codes)), repeat)
    a, models, raw = coded[-1]
    rans_dec_s = _best_s(lambda: rans.decode(memoryview(raw), a, models, codes.shape[1]), repeat)
    mb = sent.numel() * 4 / 1e6
    return {
        "encode_MBps": mb / enc_s,
        "decode_MBps": mb / dec_s,
        "rans_encode_MBps": mb / rans_enc_s,
        "rans_decode_MBps": mb / rans_dec_s,
        "payload_bytes": len(payload),
        "a": params["a"],
        "cols": params.get("cols", d),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed frames (best one counts)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"klt on {list(SHAPE)} float32 ({4 * SHAPE[0] * SHAPE[1] * SHAPE[2] / 1e6:.2f} MB)")
    print(f"{'tensor':<11}{'coder':>6}{'encode':>9}{'decode':>9}{'rans enc':>10}"
          f"{'rans dec':>10}{'payload B':>11}{'a':>5}{'cols':>6}   (MB/s per core)")  # fmt: skip
    for name, codec, power in (
        ("activation", KLT_ACTIVATION, 1.0),
        ("gradient", KLT_GRADIENT, 0.7),
    ):
        for columns in (False, True):
            r = measure(codec, power, args.repeat, columns)
            print(f"{name:<11}{2 if columns else 1:>6}{r['encode_MBps']:>9.1f}"
                  f"{r['decode_MBps']:>9.1f}{r['rans_encode_MBps']:>10.1f}"
                  f"{r['rans_decode_MBps']:>10.1f}{int(r['payload_bytes']):>11}"
                  f"{int(r['a']):>5}{int(r['cols']):>6}")  # fmt: skip


if __name__ == "__main__":
    main()
