"""Eval loss of the models that bench runs left behind, on batches their training never drew.

`ravnest-node bench` leaves every node's checkpoint of the last step in its work dir; this loads
each run's final weights (`blocks_at`, as `ravnest-node export` does) and prints the mean loss on
8 batches of 16 from index 10,000 of the run's data (the simulations' `sim_report.UNSEEN`), which
a run of fewer than 10,000 steps never trains on. One line per run dir given:

    python docs/bench/eval_runs.py SEED DIR [DIR ...]

DIR is the directory holding a run's node-* folders (e.g. WORK/home/ours).
"""

import sys
from pathlib import Path

import torch
from sim_report import UNSEEN

from ravnest_node.checkpoint.export import blocks_at
from ravnest_node.data.stdlib_bytes import StdlibBytes
from ravnest_node.models import get_model

torch.set_num_threads(1)
seed = int(sys.argv[1])
model = get_model("bench-small")
data = StdlibBytes(seq_len=model.input_spec(1).shape[1], seed=seed)
batches = [data.batch(UNSEEN + k, 16) for k in range(8)]
for run in sys.argv[2:]:
    step, loaded = blocks_at(sorted(Path(run).glob("node-*")), model)
    blocks = model.build_blocks(seed)
    with torch.no_grad():
        for i, block in enumerate(blocks):
            for name, p in block.named_parameters():
                p.copy_(loaded[i].tensors[("param", name)])
        net = torch.nn.Sequential(*blocks).eval()
        losses = [float(model.loss(net(x), y)) for x, y in batches]
    print(f"{run}: step {step}, eval loss {sum(losses) / len(losses):.4f}")
