#!/usr/bin/env bash
# Issue 16's overhead targets on one H200 (see BENCHMARKS.md "Orchestration overhead
# (issue 16)"): bench/overhead.py before (bc6b31c) vs after.
#   bash bench/h200_overhead.sh           two phases, < 9 minutes: 1. sequential oneshot
#                                         questions (orchestration share of end-to-end, ms per
#                                         node), one side after the other; 2. rounds of
#                                         concurrent IRG requests (scheduler work per node), both
#                                         servers up at once
#   bash bench/h200_overhead.sh async     the engine's overlapped steps alone (< 90 s):
#                                         same outputs as without, time per step with/without
#   bash bench/h200_overhead.sh compact   both on one server start per side, <= LIMIT s (255):
#                                         both servers up at once, 20 paired sequential questions
#                                         (sides alternating question by question; at most 40 %
#                                         of the budget), then 7 rounds; the JSON rewritten after
#                                         every question pair and round
# Needs, carried: .whl/ (faiss-cpu wheel), .gpurun/data/model (written here by
# `python bench/rag_bench.py --preset h200 --model-only --out .gpurun`) and .bench_before/src
# (`mkdir -p .bench_before && git archive bc6b31c src | tar -x -C .bench_before`).
# Env: PRESET (default h200; cpu for the CPU twin), LIMIT (compact: seconds, default 255),
# OV_EXTRA (more bench/overhead.py options, e.g. "--engine-option
# after:enable_async_scheduling=false" for the after side without overlapped engine steps).
set -uo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
OUT=${OUT:-/tmp/out}
PRESET=${PRESET:-h200}
DATA=${DATA:-/root/ov/data}
mkdir -p "$OUT" "$DATA"
if [ "$PRESET" = h200 ]; then
    cp -r .gpurun/data/model "$DATA/" || exit 1  # the 8B config and SmolLM2's tokenizer
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
nproc
OV=(python3 bench/overhead.py --preset "$PRESET" --data "$DATA" --before-src .bench_before/src)
read -r -a EXTRA <<< "${OV_EXTRA:-}"
OV+=("${EXTRA[@]}")
case ${1:-full} in
full)
    timeout 320 "${OV[@]}" --num 24 --out "$OUT/overhead_h200.json" > "$OUT/overhead_h200.log" 2>&1
    echo "sequential exit $?"
    grep "overhead: side\|^| \|^preset\|Error" "$OUT/overhead_h200.log" | tail -12
    timeout 190 "${OV[@]}" --concurrent 32 --rounds 5 --workflow irg --kv-cache-gib 24 \
        --out "$OUT/overhead_h200_concurrent.json" > "$OUT/overhead_h200_concurrent.log" 2>&1
    echo "concurrent exit $?"
    grep "overhead: round\|scheduler work per node\|Error\|error" \
        "$OUT/overhead_h200_concurrent.log" | tail -14
    ;;
compact)
    LIMIT=${LIMIT:-255}
    # the budget leaves 20 s for the last round and the servers' shutdown
    timeout "$LIMIT" "${OV[@]}" --num "${NUM:-20}" --concurrent "${CONCURRENT:-32}" \
        --rounds "${ROUNDS:-7}" --workflow irg --kv-cache-gib "${KV_GIB:-24}" \
        --time-budget $((LIMIT - 20)) --out "$OUT/overhead_compact.json" \
        > "$OUT/overhead_compact.log" 2>&1
    echo "compact exit $? (124: stopped by the time limit; the JSON holds every finished point)"
    grep "^| \|^preset\|s\.e\.\|scheduler work per node\|^where\|calls per node\|Error" \
        "$OUT/overhead_compact.log" | tail -44
    ;;
async)
    # the overlapped engine steps on the device (bench/async_check.py): outputs equal to the
    # synchronous loop's (greedy and seeded, CUDA graphs on) and the wall time per forward
    # step with and without the overlap; 8 of the 8B model's layers, random weights; < 90 s
    timeout 150 python3 bench/async_check.py --model "$DATA/model" --layers "${LAYERS:-8}" \
        --out "$OUT/async_check.json" > "$OUT/async_check.log" 2>&1
    echo "async check exit $?"
    grep "^exactness\|^timing\|FAILED\|Error" "$OUT/async_check.log" | tail -8
    ;;
*) echo "usage: $0 [full|compact|async]" >&2; exit 2 ;;
esac
