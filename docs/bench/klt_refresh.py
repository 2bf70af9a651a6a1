"""How often klt's sender should take and send a new basis: bytes and error of each boundary
stream under a refresh schedule, on bench-small's own boundary tensors.

bench-small's four boundary streams (boundary_streams.py: a synchronous three-stage run of
STEPS steps, 240 frames each after 60). Each stream goes through the klt codec exactly as a
sender uses it for its role, towards a peer that decodes columns (coder 2), and through the
decoder with the stream's bases; it prints each stream's bytes (all frames, and the first 80:
the 20 steps of the synchronous warm-up), its mean relative error ||x' - x|| / ||x||, and the
frames that carried a basis.

    EMA=0.9 RMAX=128 python docs/bench/klt_refresh.py [STEPS [SEED]]

EMA: the covariance average's weight of the old frames (compression/transform.py `EMA`);
RMAX: the most frames between two bases once the doubling reaches it (`REFRESH_MAX`). Both
default to the codec's own. Memory: about 8 MB a step kept (1.7 GB for 200 steps).
"""

import os
import sys

from boundary_streams import boundary_streams
from sim_klt import KLTStream

import ravnest_node.compression.transform as transform

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
transform.EMA = float(os.environ.get("EMA", transform.EMA))
transform.REFRESH_MAX = int(os.environ.get("RMAX", transform.REFRESH_MAX))
streams = boundary_streams(steps, seed)

total, warm = 0, 0
print(f"{steps} steps, seed {seed}, EMA {transform.EMA}, REFRESH_MAX {transform.REFRESH_MAX}")
for (role, b), frames in streams.items():
    stream = KLTStream.new(role)
    sizes, errors, with_basis = [], [], []
    for i, t in enumerate(frames):
        value, params, nbytes = stream.through(t)
        sizes.append(nbytes)
        errors.append(float((value - t).norm() / t.norm()))
        if params["basis"] == 1:
            with_basis.append(i)
    total, warm = total + sum(sizes), warm + sum(sizes[:80])
    print(
        f"{role} {b}: {sum(sizes) / 1e3:.0f} KB (first 80 frames {sum(sizes[:80]) / 1e3:.0f}),"
        f" relative error {sum(errors) / len(errors):.4f}, bases with frames {with_basis}"
    )
print(f"all four streams: {total / 1e3:.0f} KB (first 80 frames of each: {warm / 1e3:.0f})")
