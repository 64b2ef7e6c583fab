#!/usr/bin/env bash
# Issue 12's tiered-KV benchmark on the H200, one device call of at most 9 minutes:
#   bash bench/h200_kv_tiers_run.sh       one H200: the CUDA swap tests (<= 60 s), then every
#                                         configuration of h200-llama8b-tiers in one process
#                                         (time budget 440 s: late ones are skipped)
#   bash bench/h200_kv_tiers_run.sh two   two H200s (nvidia-h200-x2): the same tests, then the
#                                         configurations split over GPUs 0 and 1, each half
#                                         with its own no_reuse (its baseline and common rate)
#   bash bench/h200_kv_tiers_run.sh exact one GPU, <= 5 minutes: the CUDA swap tests, then the
#                                         CPU twin's workload (cpu-tiny-tiers, replays only) on
#                                         the GPU in float32 and in bfloat16, every configuration:
#                                         how far tokens agree with no_reuse in each dtype
#   bash bench/h200_kv_tiers_run.sh compact  one GPU, <= LIMIT s (290): no tests (they passed on
#                                         the H200 on 2026-12-01 02:43, unchanged since); the
#                                         target configurations (no_reuse, block_cache,
#                                         tree_host_pgdsf_aware) with their capacity searched,
#                                         then the ablations with the common-rate TTFT probe only
#                                         (tree_gpu_pgdsf, tree_host_pgdsf, tree_host_lru,
#                                         tree_gpu_lru), as far as the budget goes
#   bash bench/h200_kv_tiers_run.sh capacity one GPU, <= LIMIT s (258): no tests; no_reuse (with
#                                         the shuffled-order control replay), then
#                                         tree_host_pgdsf_aware, then block_cache: TTFT probe at
#                                         the common rate and capacity from 150-request windows
#                                         (bench/kv_capacity.py), each search leaving RESERVE_S
#                                         (60) per configuration still to run
# Writes $OUT/kv_tiers*.json (rewritten after every configuration), unbuffered logs beside them.
# Needs torch and numpy only (no faiss, no model packages: random weights).
# Env (compact, capacity): PRESET (default h200-llama8b-tiers; cpu-tiny for the CPU twin), EXTRA (flags).
set -uo pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kv_tiers_out}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/nvidia_smi.txt"
if [ "${1:-one}" != compact ] && [ "${1:-one}" != capacity ]; then
    timeout 60 python3 -m pytest -q -m gpu tests/generation/test_kv_swap.py \
        > "$OUT/gpu_tests.log" 2>&1
    tail -3 "$OUT/gpu_tests.log"
fi
bench() {  # bench GPU NAME CONFIGS
    CUDA_VISIBLE_DEVICES=$1 timeout 470 python3 -u bench/bench_kv_reuse.py \
        --preset h200-llama8b-tiers --time-budget 440 --configs "$3" \
        --out "$OUT/kv_tiers$2.json" > "$OUT/kv_tiers$2.log" 2>&1
}
ALL=no_reuse,block_cache,tree_host_pgdsf_aware,tree_host_pgdsf,tree_gpu_pgdsf,tree_host_lru,tree_gpu_lru
case ${1:-one} in
one) bench 0 "" "$ALL" ;;
two)
    bench 0 _a no_reuse,block_cache,tree_host_pgdsf_aware,tree_host_pgdsf &
    bench 1 _b no_reuse,tree_gpu_pgdsf,tree_host_lru,tree_gpu_lru
    wait
    ;;
exact)
    for dtype in float32 bfloat16; do
        CUDA_VISIBLE_DEVICES=0 timeout 110 python3 -u bench/bench_kv_reuse.py \
            --preset cpu-tiny-tiers --device cuda --dtype $dtype --cpu-threads 4 \
            --configs "$ALL" --out "$OUT/kv_tiers_exact_$dtype.json" \
            > "$OUT/kv_tiers_exact_$dtype.log" 2>&1
    done
    ;;
compact)
    LIMIT=${LIMIT:-290}
    # the budget: no configuration starts, and no pass runs, past LIMIT - 40 s (an engine's
    # build and teardown fit in the rest)
    # shellcheck disable=SC2086 # EXTRA is a flag list
    timeout "$LIMIT" python3 -u bench/bench_kv_reuse.py --preset "${PRESET:-h200-llama8b-tiers}" \
        --time-budget $((LIMIT - 40)) --capacity-configs no_reuse,block_cache,tree_host_pgdsf_aware \
        --configs no_reuse,block_cache,tree_host_pgdsf_aware,tree_gpu_pgdsf,tree_host_pgdsf,tree_host_lru,tree_gpu_lru \
        ${EXTRA:-} --out "$OUT/kv_tiers_compact.json" > "$OUT/kv_tiers_compact.log" 2>&1
    echo "compact exit $? (124: stopped by the time limit; the JSON holds every finished configuration)"
    ;;
capacity)
    LIMIT=${LIMIT:-258}
    # shellcheck disable=SC2086 # EXTRA is a flag list
    timeout "$LIMIT" python3 -u bench/bench_kv_reuse.py --preset "${PRESET:-h200-llama8b-tiers}" \
        --time-budget $((LIMIT - 8)) --reserve-s "${RESERVE_S:-60}" --control \
        --configs no_reuse,tree_host_pgdsf_aware,block_cache \
        ${EXTRA:-} --out "$OUT/kv_capacity.json" > "$OUT/kv_capacity.log" 2>&1
    echo "capacity exit $? (124: stopped by the time limit; the JSON holds every finished configuration)"
    ;;
*) echo "usage: $0 [one|two|exact|compact|capacity]" >&2; exit 2 ;;
esac
grep -E "bench_kv_reuse (no_reuse|block_cache|tree_)[a-z_]*: \{" "$OUT"/kv_*.log | cut -c1-600
