"""Bytes and error of klt's default and coarser step on each of bench-small's boundary streams:
the figures behind compression/auto.py `COARSE_SHRINK` (docs/compression.md, "klt's coarser
step where even klt sets the pace").

The four streams of a synchronous three-stage run of STEPS steps (boundary_streams.py, 240
frames each after 60) each go through klt as a sender towards a coder-2 peer sends them, at
klt's default step and at its coarser one (compression/transform.py: activations 0.5 and 0.7
of each row's rms, gradients 0.35 and 0.5 of the tensor's), and through the decoder with the
stream's bases. Prints each stream's payload bytes, their ratio and the mean relative error
||x' - x|| / ||x||.

    python docs/bench/klt_steps.py [STEPS [SEED]]      # about a minute for 60 steps
"""

import sys

from boundary_streams import boundary_streams

from ravnest_node.compression.transform import (
    KLT,
    KLT_ACTIVATION,
    KLT_ACTIVATION_COARSE,
    KLT_GRADIENT,
    KLT_GRADIENT_COARSE,
    KLTBases,
)

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
streams = boundary_streams(steps, seed)
print(f"{steps} steps, seed {seed}")
for (role, b), frames in streams.items():
    pair = (KLT_ACTIVATION, KLT_ACTIVATION_COARSE)
    if role == "gradient":
        pair = (KLT_GRADIENT, KLT_GRADIENT_COARSE)
    results = []
    for codec in pair:
        assert isinstance(codec, KLT)
        state, bases = codec.new_state(), KLTBases()
        state.columns = True
        nbytes, error = 0, 0.0
        for t in frames:
            params, payload = codec.encode(t, state)
            value, commit = codec.decode_stream(
                bases, memoryview(payload), t.shape, t.dtype, params
            )
            commit()
            nbytes += len(payload)
            error += float((value - t).norm() / t.norm())
        results.append((codec.alpha, nbytes, error / len(frames)))
    (a0, n0, e0), (a1, n1, e1) = results
    print(
        f"{role} {b}: step {a0} {n0 / 1e3:.0f} KB, error {e0:.4f}; step {a1} {n1 / 1e3:.0f} KB,"
        f" error {e1:.4f}; coarse / default bytes {n1 / n0:.3f}"
    )
