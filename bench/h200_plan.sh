#!/usr/bin/env bash
# The pending H200 measurements in two device calls (BENCHMARKS.md, "Next device session:
# the plan"), each <= 9.5 minutes of wall time on one H200; every part runs under its own hard
# `timeout` (capped at what is left of the call), writes under $OUT/<part>/ (its log:
# part.log) and gets one summary line at the end (also in $OUT/summary.txt):
#   bash bench/h200_plan.sh 1   overhead   issue 16 compact (h200_overhead.sh compact, <= 255 s)
#                               kv_tiers   issue 12 compact (h200_kv_tiers_run.sh compact, the
#                                          rest of the call, <= 300 s)
#   bash bench/h200_plan.sh 2   gpu_tests  pytest -m gpu on the test files touched since af503fa
#                                          that hold GPU tests (<= 150 s)
#                               overflow_stream  issue 10, cold lists streamed
#                                          (h200_overflow_stream_run.sh, <= 300 s)
#   bash bench/h200_plan.sh 3   overflow_stream  issue 10 again after the 2026-12-01 run
#                                          (latency phase fixed, rates bisected to 10 %;
#                                          <= 330 s in all: CALL_S 330 unless set)
#   bash bench/h200_plan.sh 4   kv_capacity  issue 12's TTFT and sustained capacity from
#                                          150-request windows, with the agreement control
#                                          (h200_kv_tiers_run.sh capacity, <= 268 s)
#   bash bench/h200_plan.sh 5   overflow_stream  issue 10's streamed latency model after call
#                                          3: latency phase (the split by the CPU scan's real
#                                          parallelism, and the call-3 split) and the streamed
#                                          rate only (<= 300 s: CALL_S 300 unless set)
#   bash bench/h200_plan.sh 6   cpu_scan   issue 10's CPU-only baseline at the 5M x 768 shape
#                                          (bench_gpu_tier.py --cpu-only, nprobe 256, batch
#                                          1/32/256): ragserve's scan on 14 threads and on one
#                                          (stepwise.set_scan_threads), Faiss's own
#                                          index.search beside them (<= 270 s)
#   bash bench/h200_plan.sh 7   overflow_stream  issue 10's overflow run (call 3) again with
#                                          the CPU scan on 14 threads: CPU-only, tier and
#                                          stream rates re-bracketed (<= 325 s)
#   bash bench/h200_plan.sh 8   overflow_stream  call 7 with the tier filled to its budget in
#                                          the rate phases, the model checked there (<= 325 s)
#   bash bench/h200_plan.sh 9   overflow_stream  call 8's stream and CPU-only rates only,
#                                          bisected further (<= 325 s)
# Carry: .whl (calls 1-3, 5, 6), .gpurun and .bench_before (call 1); call 4 needs none.
# Env: CALL_S (the call's budget, default 565), TWIN=cpu (the CPU twin: the same parts on
# tiny CPU configurations, to check this script, not to measure).
set -uo pipefail
CALL=${1:-}
: "${OUT:?OUT must name the folder results are written to}"
CALL_S=${CALL_S:-$(case $CALL in 3 | 7 | 8 | 9) echo 330 ;; 5 | 6) echo 300 ;; *) echo 565 ;; esac)}
START=$SECONDS
mkdir -p "$OUT"
: > "$OUT/summary.txt"

part() {  # part NAME LIMIT COMMAND...: COMMAND with OUT=$OUT/NAME and LIMIT, under timeout
    local name=$1 limit=$2 left=$((CALL_S - (SECONDS - START)))
    shift 2
    ((limit > left)) && limit=$left
    if ((limit < 30)); then
        echo "$name: not started (${left} s left of the call)" | tee -a "$OUT/summary.txt"
        return
    fi
    mkdir -p "$OUT/$name"
    local t0=$SECONDS rc
    OUT="$OUT/$name" LIMIT=$((limit - 10)) timeout -k 10 "$limit" "$@" \
        > "$OUT/$name/part.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$OUT/parts.txt"
}

summary() {
    for name in "$@"; do
        python3 bench/plan_summary.py "$name" "$OUT/$name" | tee -a "$OUT/summary.txt"
    done
    cat "$OUT/parts.txt" 2>/dev/null
    echo "call $CALL: $((SECONDS - START)) s"
}

# the test files touched since af503fa that hold GPU-marked tests (git log --name-only
# af503fa..HEAD -- tests, filtered by the marker; listed here too: the device copy has no .git)
GPU_TEST_FILES="tests/retrieval/test_cold_stream.py tests/retrieval/test_gpu_tier.py
    tests/retrieval/test_tier_scan.py"
if git rev-parse --verify -q af503fa >/dev/null 2>&1; then
    # shellcheck disable=SC2046 # one path a word
    GPU_TEST_FILES=$(grep -l "mark.gpu" $(git log --name-only --format= af503fa..HEAD -- tests |
        sort -u | while read -r f; do [ -f "$f" ] && echo "$f"; done) /dev/null)
fi

GPU_TEST_FILES=$(echo $GPU_TEST_FILES)  # one line
export GPU_TEST_FILES
run_gpu_tests() {  # the faiss wheel (the retrieval tests import faiss), then the tests
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || return 1
    fi
    # shellcheck disable=SC2086 # one path a word
    PYTHONPATH=/tmp/site:$PWD/src python3 -m pytest -q -p no:cacheprovider -m gpu \
        $GPU_TEST_FILES > "$OUT/gpu_tests.log" 2>&1
    local rc=$?
    tail -3 "$OUT/gpu_tests.log"
    return $rc
}
export -f run_gpu_tests
cpu_scan() {  # the faiss wheel, then the CPU-only baseline both ways (bench_gpu_tier.py)
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || return 1
    fi
    PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 timeout "$LIMIT" python3 \
        bench/bench_gpu_tier.py --cpu-only --cpu-scan-threads 14 1 --faiss-oneshot \
        --max-batches 40 --check-queries 256 "$@" --out "$OUT/cpu_scan.json" \
        > "$OUT/cpu_scan.log" 2>&1
    local rc=$?
    echo "exit code $rc (124: stopped by the time limit; the JSON holds every finished point)"
    return $rc
}
export -f cpu_scan

if [ "${TWIN:-}" = cpu ]; then  # tiny sizes, CPU devices; the same parts and scripts
    export PRESET_OV=cpu KV_GIB=0 NUM=3 CONCURRENT=4 ROUNDS=2 DATA=${DATA:-/tmp/plan_twin_data}
    export PRESET_KV=cpu-tiny RESERVE_S=2 EXTRA="--num-requests 4 --window-requests 12 \
--ttft-requests 6 --warmup-s 0.1 --drain-s 1 --slo 5 --load 0.5 --max-probes 2"
    # --coverage 25 50: lists placed pinned in the latency phase even where Algorithm 1 wants
    # none (50 % is over the budget: capped at the tier's chunk prices)
    export CPU_SCAN_ARGS="--num-docs 100000 --dim 64 --nlist 512 --topics 2048 --nprobe 64 \
--batch 1 32 256 --min-seconds 1 --num-queries 1024"
    export ARGS="--num-docs 6000 --dim 16 --nlist 32 --topics 128 --nprobe 8 --budget-gb 0.0002 \
--device cpu --slo-search 0.5 --llm-rate 200 --coverage 25 50"
fi

case $CALL in
1)
    part overhead 255 env PRESET="${PRESET_OV:-h200}" bash bench/h200_overhead.sh compact
    part kv_tiers 300 env PRESET="${PRESET_KV:-h200-llama8b-tiers}" \
        bash bench/h200_kv_tiers_run.sh compact
    summary overhead kv_tiers
    ;;
2)
    part gpu_tests 150 bash -c run_gpu_tests
    part overflow_stream 300 env GPU_TESTS=0 LIMIT=280 bash bench/h200_overflow_stream_run.sh
    summary gpu_tests overflow_stream
    ;;
3)
    part overflow_stream 325 env GPU_TESTS=0 LIMIT=312 bash bench/h200_overflow_stream_run.sh
    summary overflow_stream
    ;;
5)  # the H200 corpus of call 3 (TWIN=cpu: the twin's), no CPU or tier-only rate
    OV_ARGS=${ARGS:-"--num-docs 20000000 --dim 768 --nlist 16384 --topics 65536 --nprobe 256 \
--budget-gb 24"}
    # NOTE: call 5 compares the one-thread scan's split with call 3's (14 threads): the scan
    # is pinned to one thread, as it ran in call 3 (the default is now Faiss's thread count)
    part overflow_stream 295 env GPU_TESTS=0 LIMIT=282 RAGSERVE_CPU_SCAN_THREADS=1 \
        ARGS="$OV_ARGS --skip cpu_rate tier_rate --rate-order stream --stream-rate 44 60" \
        bash bench/h200_overflow_stream_run.sh
    summary overflow_stream
    ;;
6)  # the retrieval-alone table's corpus (5M x 768, 4,096 lists); 14 threads first (the refs)
    CS_ARGS=${CPU_SCAN_ARGS:-"--num-docs 5000000 --dim 768 --nlist 4096 --topics 16384 \
--nprobe 256 --batch 1 32 256 --min-seconds 3"}
    part cpu_scan 270 env OMP_NUM_THREADS=14 bash -c "cpu_scan $CS_ARGS"
    summary cpu_scan
    ;;
7)  # call 3's corpus and tier again, the CPU scan on its 14 threads (the default since
    # 2026-12-01): every rate moves, so brackets are set from call 6's CPU-only figures
    # (93.7 q/s at batch 32: CPU-only 50..100, the tier's CPU side ~41 % of the probes:
    # 120..240, the stream 160..320), widened by find_capacity's expand when they miss
    OV_ARGS=${ARGS:-"--num-docs 20000000 --dim 768 --nlist 16384 --topics 65536 --nprobe 256 \
--budget-gb 24 --rate-points 5 --cpu-rate 50 100 --tier-rate 120 240 --stream-rate 160 320"}
    part overflow_stream 325 env GPU_TESTS=0 LIMIT=312 ARGS="$OV_ARGS" \
        bash bench/h200_overflow_stream_run.sh
    summary overflow_stream
    ;;
8)  # call 7 with the tier filled to its budget in the rate phases (call 7's Algorithm 1, at
    # the LLM's 48 q/s, placed no list: the 14-thread CPU meets the SLO alone) and the latency
    # model checked at the filled tier (--coverage 100, capped at the budget)
    OV_ARGS=${ARGS:-"--num-docs 20000000 --dim 768 --nlist 16384 --topics 65536 --nprobe 256 \
--budget-gb 24 --rate-points 4 --cpu-rate 70 95 --tier-rate 150 300 --stream-rate 150 300"}
    part overflow_stream 325 env GPU_TESTS=0 LIMIT=312 \
        ARGS="$OV_ARGS --coverage 100 --rate-placement fill --skip stream_omp \
--rate-order tier stream cpu" bash bench/h200_overflow_stream_run.sh
    summary overflow_stream
    ;;
9)  # call 8's stream and CPU-only rates only, bisected further: is the filled tier + stream
    # >= 3x CPU-only? (call 8: stream [212, 252), CPU 75.6 = [75.6, 81.5))
    OV_ARGS=${ARGS:-"--num-docs 20000000 --dim 768 --nlist 16384 --topics 65536 --nprobe 256 \
--budget-gb 24 --rate-points 4 --cpu-rate 70 90 --stream-rate 212 252"}
    part overflow_stream 325 env GPU_TESTS=0 LIMIT=312 \
        ARGS="$OV_ARGS --rate-placement fill --skip latency tier_rate --rate-order stream cpu" \
        bash bench/h200_overflow_stream_run.sh
    summary overflow_stream
    ;;
4)
    part kv_capacity 268 env PRESET="${PRESET_KV:-h200-llama8b-tiers}" \
        bash bench/h200_kv_tiers_run.sh capacity
    summary kv_capacity
    ;;
*) echo "usage: $0 1|2|3|4|5|6|7|8|9 (OUT=<folder>)" >&2; exit 2 ;;
esac
