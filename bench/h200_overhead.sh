#!/usr/bin/env bash
# Issue 16's overhead targets on one H200, in one device call (< 9 minutes; see BENCHMARKS.md
# "Orchestration overhead (issue 16)"): bench/overhead.py before (bc6b31c) vs after,
#   1. sequential oneshot questions: orchestration share of end-to-end, ms per node;
#   2. rounds of concurrent IRG requests: scheduler work per node, both servers up at once.
# Needs, carried: .whl/ (faiss-cpu wheel), .gpurun/data/model (written here by
# `python bench/rag_bench.py --preset h200 --model-only --out .gpurun`) and .bench_before/src
# (`mkdir -p .bench_before && git archive bc6b31c src | tar -x -C .bench_before`).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
OUT=${OUT:-/tmp/out}
DATA=/root/ov/data
mkdir -p "$OUT" "$DATA" && cp -r .gpurun/data/model "$DATA/"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; nproc
timeout 320 python3 bench/overhead.py --preset h200 --data "$DATA" --before-src .bench_before/src \
    --num 24 --out "$OUT/overhead_h200.json" > "$OUT/overhead_h200.log" 2>&1
echo "sequential exit $?"
grep "overhead: side\|^| \|^preset\|Error" "$OUT/overhead_h200.log" | tail -12
timeout 190 python3 bench/overhead.py --preset h200 --data "$DATA" --before-src .bench_before/src \
    --concurrent 32 --rounds 5 --workflow irg --kv-cache-gib 24 \
    --out "$OUT/overhead_h200_concurrent.json" > "$OUT/overhead_h200_concurrent.log" 2>&1
echo "concurrent exit $?"
grep "overhead: round\|scheduler work per node\|Error\|error" "$OUT/overhead_h200_concurrent.log" | tail -14
