#!/usr/bin/env bash
# Issue 5's H200 run, in device calls of at most 10 minutes (see BENCHMARKS.md).
#   bench/h200_run.sh smoke   the h200 pipeline end to end on a 200k-vector index (one call)
#   bench/h200_run.sh start   launch the full run (bench/plans/h200.json) in the background
#   bench/h200_run.sh wait S  wait up to S seconds for it; copy results and the log to $OUT
# Needs: .whl/ (faiss-cpu cp312 wheel) and .gpurun/data/model (written here by
# `python bench/rag_bench.py --preset h200 --model-only --out .gpurun`), both carried.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
RUN=${RUN:-/root/rag_h200}
OUT=${OUT:-/tmp/out}
mkdir -p "$RUN" "$OUT"

collect() {  # what comes back: the results and the log's tail (plots are drawn here)
    local dir=$1
    [ -f "$dir/results.json" ] && cp "$dir/results.json" "$OUT/"
    [ -f "$dir.log" ] && tail -c 4000000 "$dir.log" > "$OUT/run.log"
    return 0
}

case ${1:-} in
smoke)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    nproc; free -g | head -2
    mkdir -p "$RUN/smoke/data" && cp -r .gpurun/data/model "$RUN/smoke/data/"
    timeout 500 python3 bench/rag_bench.py --preset h200-smoke --out "$RUN/smoke" \
        --systems sequential stagewise async ragserve --min-requests 8 > "$RUN/smoke.log" 2>&1
    echo "exit $?"
    collect "$RUN/smoke"
    grep -v " INFO " "$RUN/smoke.log" | tail -40
    ;;
start)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    nproc; free -g | head -2; df -h /root | tail -1
    mkdir -p "$RUN/full/data" && cp -r .gpurun/data/model "$RUN/full/data/"
    setsid nohup python3 bench/rag_bench.py --preset h200 --plan bench/plans/h200.json \
        --out "$RUN/full" > "$RUN/full.log" 2>&1 < /dev/null &
    echo "started $!"
    ;;
wait)
    end=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $end ] && pgrep -f "rag_bench.py --preset h200 " >/dev/null; do
        sleep 15
        collect "$RUN/full"
    done
    collect "$RUN/full"
    pgrep -f "rag_bench.py --preset h200 " >/dev/null && echo "still running" || echo "finished"
    tail -5 "$RUN/full.log"
    ;;
*)
    echo "usage: $0 smoke|start|wait [seconds]" >&2
    exit 2
    ;;
esac
