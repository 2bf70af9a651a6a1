#!/bin/bash
# `bench replicas` on a machine without network access whose python3 already has torch (the lent
# 16-core machine of docs/benchmarks.md). Before copying the tree there, fetch the wheels our
# other dependencies need into .device/wheels (an ignored folder), for that machine's Python:
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --no-deps -d .device/wheels grpcio==1.85.3 protobuf==7.36.2 lz4==4.4.5 msgpack==1.2.4
# Then, there, from the repository root: STEPS=60 OUT=/some/dir bash docs/bench/device-replicas.sh
set -u
export PYTHONUNBUFFERED=1
mkdir -p /tmp/pydeps
python3 -m pip install -q --no-index --no-deps --target /tmp/pydeps .device/wheels/*.whl
export PYTHONPATH=/tmp/pydeps:$PWD
python3 -c "import os, torch, grpc; print('torch', torch.__version__, 'grpc', grpc.__version__, 'cores', os.cpu_count())"
python3 -m ravnest_node bench replicas --steps "${STEPS:-60}" --jsonl "$OUT/replicas.jsonl" \
  --work-dir /tmp/ravnest-replicas 2>&1 | tee "$OUT/replicas.log"
