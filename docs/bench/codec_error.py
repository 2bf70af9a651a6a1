"""How much each codec `auto` chooses from errs on bench-small's own boundary tensors, and what
its frames take: the order of compression/auto.py's `ranked`.

bench-small's four boundary streams (boundary_streams.py: a synchronous three-stage run of
STEPS steps) go through int8-block, int4-block (gradients: the stochastic variants a sender
uses), klt, and klt at its finer step (activations), each stream with its own sender state and
receiver, in order; it prints each codec's mean relative error ||x' - x|| / ||x|| and mean
payload bytes per frame (one microbatch of 4 samples), over frames 9 on (klt's first frames go
in the identity basis while it learns one).

    python docs/bench/codec_error.py [STEPS [SEED]]
"""

import sys

from boundary_streams import boundary_streams
from sim_klt import KLTStream

from ravnest_node.compression import CODECS, encoder

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
SKIP = 8
print(f"{steps} steps, seed {seed}: relative error, bytes per frame (frames {SKIP + 1} on)")
for (role, b), frames in boundary_streams(steps, seed).items():
    out = []
    for name in ("int8-block", "int4-block"):
        codec = encoder(name, role)
        state = codec.new_state()
        errors, sizes = [], []
        for t in frames:
            params, payload = codec.encode(t, state)
            back = CODECS[name].decode(memoryview(payload), t.shape, t.dtype, params)
            errors.append(float((back - t).norm() / t.norm()))
            sizes.append(len(payload))
        out.append((name, errors, sizes))
    for fine in (False, True) if role == "activation" else (False,):
        stream = KLTStream.new(role, fine=fine)
        errors, sizes = [], []
        for t in frames:
            back, _, nbytes = stream.through(t)
            errors.append(float((back - t).norm() / t.norm()))
            sizes.append(nbytes)
        out.append(("klt, fine step" if fine else "klt", errors, sizes))
    cells = [
        f"{name} {sum(e[SKIP:]) / len(e[SKIP:]):.3f} {sum(n[SKIP:]) / len(n[SKIP:]) / 1e3:.1f} KB"
        for name, e, n in out
    ]
    print(f"{role} {b}: " + " | ".join(cells), flush=True)
