#!/bin/bash
# The GPU check of issue 31 ("GPU nodes"), for a borrowed GPU machine without network access
# whose python3 already has a CUDA build of torch. About 7 minutes on one H200 with 16 cores;
# every part has its own time limit, and a part that fails or times out does not stop the next.
#
# Before copying the tree there, fetch the wheels of what that machine lacks (its image has
# torch, numpy, safetensors, pytest and hypothesis; ours need these versions of the rest) into
# .device/wheels (ignored by git), for its Python 3.12, and carry the folder with the run:
#   pip download --only-binary=:all: --python-version 3.12 --implementation cp --no-deps \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 -d .device/wheels \
#     grpcio==1.85.3 protobuf==7.36.2 zeroconf ifaddr lz4 msgpack cryptography cffi pycparser \
#     torchao==0.18.0 pytest-asyncio constriction==0.5.0
# Then, there, from the repository root:   OUT=/some/dir bash tests/gpu/check.sh
# Here, without a GPU (the same steps on the CPU with the tiny model, about 2 minutes):
#   DEVICE=cpu OUT=/tmp/gpu-check bash tests/gpu/check.sh
#
# It runs: pytest tests/gpu (the CUDA tests); three node processes on one device against one
# process (fp32, staleness 0: the same losses within 1e-4 relative); bf16 against fp32 (final
# loss within 1%); the memory of a LoRA Llama stage with an nf4 base against the plan; the GPU
# bench on the home link; the audit tolerance on the device (issue 35). It prints every figure
# and writes them to $OUT (figures.json, results.txt, each part's log and JSON lines).
set -u
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$PWD/gpu-check}
PY=${PY:-python3}
if [ "$DEVICE" = cpu ]; then
  SMALL=${SMALL:-tiny}; BIG=${BIG:-tiny}; STEPS=${STEPS:-4}; BIG_STEPS=${BIG_STEPS:-3}
else
  SMALL=${SMALL:-bench-small}; BIG=${BIG:-llama-300m}; STEPS=${STEPS:-20}; BIG_STEPS=${BIG_STEPS:-40}
fi
WORK=$(mktemp -d /tmp/ravnest-gpu-check.XXXXXX)
mkdir -p "$OUT"
: > "$OUT/results.txt"
export PYTHONUNBUFFERED=1
say() { echo "$*" | tee -a "$OUT/results.txt"; }

# Our dependencies from the wheels brought along (none here: the venv has them).
if compgen -G ".device/wheels/*.whl" > /dev/null; then
  mkdir -p "$WORK/pydeps"
  "$PY" -m pip install -q --no-index --no-deps --target "$WORK/pydeps" .device/wheels/*.whl
  export PYTHONPATH=$WORK/pydeps:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "
import os, torch
from ravnest_node import devices
d = devices.resolve_device('$DEVICE')
print('torch', torch.__version__, 'cores', os.cpu_count(), 'device', devices.describe(d),
      'precision auto ->', devices.resolve_precision('auto', d))" 2>&1 | tee -a "$OUT/results.txt"

# part NAME LIMIT_S COMMAND...: run it, its output to $OUT/NAME.log; one line of what it did.
part() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  say "$name: exit $rc in $(( $(date +%s) - start )) s$([ $rc = 124 ] && echo ' (TIMED OUT)')"
  return $rc
}
bench() {  # bench NAME LIMIT_S ARGS...: `ravnest-node bench` writing $OUT/NAME.jsonl
  local name=$1 limit=$2
  shift 2
  part "$name" "$limit" "$PY" -m ravnest_node bench --device "$DEVICE" --jsonl "$OUT/$name.jsonl" \
    --work-dir "$WORK/$name" "$@"
}
if "$PY" -m ravnest_node bench --help | grep -q -- "--precision"; then
  fp32=(--precision fp32)
else
  fp32=(); say "note: this tree's bench has no --precision (before GPU nodes): bf16 part skipped"
fi

# 1. The CUDA tests (they skip without CUDA).
part pytest-gpu 90 "$PY" -m pytest -q -p no:cacheprovider tests/gpu
tail -n 3 "$OUT/pytest-gpu.log" | tee -a "$OUT/results.txt"

# 2. Three node processes sharing the device against one process: fp32, synchronous, the same
# samples: the same losses.
equal=(--model "$SMALL" --steps "$STEPS" --scenario lan --emulation relay --codec none
       --max-staleness 0 --systems compute-bound,ours)
bench equal 60 "${equal[@]}" "${fp32[@]}"

# 3. bf16 against fp32, one process each, the same steps.
if [ ${#fp32[@]} -gt 0 ]; then
  bench bf16 40 --model "$SMALL" --steps "$STEPS" --scenario lan --emulation relay \
    --codec none --max-staleness 0 --systems compute-bound --precision bf16
fi

# 4. The memory of a LoRA Llama-shaped stage with an nf4 base against the plan.
part memory 60 "$PY" -m ravnest_node.bench.plan_check --memory --device "$DEVICE" \
  --jsonl "$OUT/memory.jsonl"
cat "$OUT/memory.log" | grep "^|" | tee -a "$OUT/results.txt"

# 5. The GPU bench on the home link (network namespaces as root, else loopback relays).
bench bench-home 180 --scenario home --model "$BIG" --steps "$BIG_STEPS" \
  --systems compute-bound,ours
[ -f "$OUT/bench-home.md" ] && cat "$OUT/bench-home.md" | tee -a "$OUT/results.txt"

# 6. The audit tolerance (issue 35): how far an honest GPU computation of a stage lands from
# the CPU's fp32 (TF32, bf16), beside how far the lies land.
part audit 40 "$PY" -m ravnest_node.bench.audit_tolerance --device "$DEVICE"
part audit-llama 40 "$PY" -m ravnest_node.bench.audit_tolerance --device "$DEVICE" \
  --model "$BIG" --first 1 --stop 3
cat "$OUT/audit.log" "$OUT/audit-llama.log" | tee -a "$OUT/results.txt"

# 7. The same model's compute-bound run on this machine's CPU cores, for GPU against CPU.
if [ "$DEVICE" != cpu ]; then
  part cpu-compute-bound 120 "$PY" -m ravnest_node bench --device cpu --jsonl "$OUT/cpu.jsonl" \
    --work-dir "$WORK/cpu" --scenario home --model "$BIG" --steps 3 --systems compute-bound
fi

# Every figure, plainly, and in figures.json.
"$PY" - "$OUT" <<'PY' 2>&1 | tee -a "$OUT/results.txt"
import json, math, sys
from pathlib import Path

out = Path(sys.argv[1])
def records(name):
    path = out / f"{name}.jsonl"
    if not path.exists():
        return {}
    return {r["system"]: r for r in map(json.loads, path.read_text().splitlines()) if r}
figures, verdicts = {}, {}
eq = records("equal")
if "compute-bound" in eq and "ours" in eq and "skipped" not in eq["ours"]:
    a, b = eq["compute-bound"]["loss_history"], eq["ours"]["loss_history"]
    rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))
    figures["three_nodes_vs_one_max_rel_loss_diff"] = rel
    verdicts["three nodes on one device = one process (1e-4)"] = rel <= 1e-4
    for system in ("compute-bound", "ours"):
        figures[f"equal_{system}_samples_per_s"] = eq[system]["samples_per_s"]
bf = records("bf16")
if "compute-bound" in bf and "compute-bound" in eq:
    lo16, lo32 = bf["compute-bound"]["final_loss"], eq["compute-bound"]["final_loss"]
    figures.update(bf16_final_loss=lo16, fp32_final_loss=lo32,
                   bf16_vs_fp32_rel=abs(lo16 - lo32) / lo32,
                   bf16_samples_per_s=bf["compute-bound"]["samples_per_s"])
    verdicts["bf16 final loss within 1% of fp32"] = abs(lo16 - lo32) <= 0.01 * lo32
home = records("bench-home")
for system, r in home.items():
    if "skipped" not in r:
        for key in ("samples_per_s", "step_s", "efficiency", "efficiency_this_machine",
                    "final_loss", "device", "precision"):
            figures[f"home_{system}_{key}"] = r.get(key)
cpu = records("cpu").get("compute-bound")
if cpu and "skipped" not in cpu and "compute-bound" in home:
    figures["cpu_compute-bound_samples_per_s"] = cpu["samples_per_s"]
    figures["gpu_over_cpu_compute-bound"] = (home["compute-bound"]["samples_per_s"]
                                             / cpu["samples_per_s"])
memory = out / "memory.jsonl"
for r in map(json.loads, memory.read_text().splitlines() if memory.exists() else []):
    figures[f"memory_{r['stage']}_plan_over_measured"] = r["ratio"]
    if "ratio_peak" in r:
        figures[f"memory_{r['stage']}_plan_over_allocator_peak"] = r["ratio_peak"]
        if r["stage"] == "lora-nf4":
            verdicts["nf4 LoRA stage: plan within 15% of the allocator"] = (
                0.85 <= r["ratio_peak"] <= 1.15)
for key, value in figures.items():
    print(f"{key}: {value}")
for what, ok in verdicts.items():
    print(f"{'PASS' if ok else 'FAIL'}: {what}")
(out / "figures.json").write_text(json.dumps({"figures": figures, "verdicts": verdicts}, indent=1))
PY
rm -rf "$WORK"
say "results in $OUT"
