#!/usr/bin/env bash
# Issue 10, device call (<= 5 min on one H200): the corpus over the tier's budget, CPU-only vs
# tier vs tier + cold lists streamed from host memory, SLO-bound rates and the latency model's
# predicted vs measured p90 for tier and tier + stream (bench_tier_overflow.py, compacted: no
# extra coverages, one repeat of the CPU model, 5 s latency points, rate points of >= 200
# queries after a 1 s warm-up; each rate bisected until within 10 % (at most 4 points a
# system), from brackets set by the 2026-12-01 run: stream 26 sustained, 52 not -> 33..44
# (33: the 3x-CPU target); tier 26 yes, 32.2 not -> 26..31; CPU 11 yes, 12.8 not; the rates
# in the order stream, tier, CPU, each point saved as measured, so a cut-off loses CPU points).
#   bash bench/h200_overflow_stream_run.sh             # device, carry .whl; results in $OUT
# Env: LIMIT (seconds for the bench, default 255, after at most 30 s of GPU tests), ARGS
# (replaces the corpus and budget flags; last on the line, so it may override any flag),
# GPU_TESTS=0 (skip the tests).
set -uo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
: "${OUT:?OUT must name the folder results are written to}"
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
free -g | head -2
# the CUDA path's exactness tests first (pinned bounce buffers, side-stream copies, any split;
# GPU_TESTS=0: run elsewhere, as bench/h200_plan.sh 2 does)
if [ "${GPU_TESTS:-1}" != 0 ]; then
    timeout 30 python3 -m pytest -q -p no:cacheprovider -m gpu tests/retrieval/test_cold_stream.py \
        > "$OUT/gpu_tests.log" 2>&1
    tail -3 "$OUT/gpu_tests.log"
fi
ARGS=${ARGS:-"--num-docs 20000000 --dim 768 --nlist 16384 --topics 65536 --nprobe 256 --budget-gb 24"}
# shellcheck disable=SC2086 # ARGS is a flag list
timeout "${LIMIT:-255}" python3 bench/bench_tier_overflow.py \
    --coverage --model-batches 1 4 16 48 64 --model-repeats 1 \
    --latency-seconds 5 --max-batches 6 \
    --rate-warmup 1 --rate-window 5 --rate-min-queries 200 --rate-points 4 --rate-tol 0.1 \
    --rate-order stream tier cpu --stream-rate 33 44 --tier-rate 26 31 --cpu-rate 11 12.8 \
    --stream-host-gb 1 $ARGS \
    --out "$OUT/overflow_stream.json" > "$OUT/overflow_stream.log" 2>&1
rc=$?
echo "exit code $rc (124: stopped by the time limit; the JSON holds every finished phase)"
grep -E "phase|failed|done:" "$OUT/overflow_stream.log" | cut -c1-300 | tail -20
exit 0
