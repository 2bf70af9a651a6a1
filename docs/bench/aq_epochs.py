"""The multi-epoch table of `ravnest-node bench --scenario codecs` over more epochs: aq-delta
sends each sample's first visit whole, so its bytes per sample fall with every epoch after the
first. Same runs as the bench's table (bench-small, 3 node processes, a fixed dataset of 128
samples, synchronous, activation codecs with fp32 gradients), EPOCHS passes over it:

    python docs/bench/aq_epochs.py 32 none int4-block aq-delta aq-delta2

Prints the table (markdown) and writes the rows as JSON lines to docs/bench/aq-epochs.jsonl.
"""

import json
import sys
import tempfile
from pathlib import Path

from ravnest_node.bench.codecs import epochs_table
from ravnest_node.bench.config import BenchConfig

epochs, codecs = int(sys.argv[1]), sys.argv[2:] or ["none", "aq-delta"]
train = BenchConfig().train
rows = epochs_table(train, Path(tempfile.mkdtemp(prefix="aq-epochs-")), 8 * train.batch_size,
                    epochs, codecs)  # fmt: skip
print("| activation codec | final loss | mean loss, last epoch | gap vs fp32 | activation "
      "bytes/sample | fewer activation bytes than fp32 |")  # fmt: skip
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['codec']} | {r['final_loss']:.4f} | {r['mean_loss_last']:.4f} | "
          f"{r['loss_gap']:+.2%} | {r['activation_bytes_per_sample']:,.0f} | "
          f"{r['activation_ratio_vs_fp32']:.1f}x |")  # fmt: skip
out = Path(__file__).with_name("aq-epochs.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
