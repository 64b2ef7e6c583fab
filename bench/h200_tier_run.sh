#!/usr/bin/env bash
# Issue 10's sustained-capacity run on the H200 in two device calls:
#   bench/h200_tier_run.sh start   build + start the plan in the background, wait up to $2 s
#   bench/h200_tier_run.sh wait S  wait up to S seconds more; copy results and log to $OUT
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=14
RUN=/root/tiercap
collect() {
    [ -f "$RUN/out/results.json" ] && cp "$RUN/out/results.json" "$OUT/"
    [ -f "$RUN/run.log" ] && grep -v "HTTP Request" "$RUN/run.log" | tail -c 2000000 > "$OUT/run.log"
    return 0
}
waitfor() {
    end=$((SECONDS + $1))
    while [ $SECONDS -lt $end ] && pgrep -f "rag_bench.py --preset h200 " >/dev/null; do
        sleep 10; collect
    done
    collect
    pgrep -f "rag_bench.py --preset h200 " >/dev/null && echo "still running" || echo "finished"
    grep -E "capacity|rag_bench ragserve" "$RUN/run.log" | cut -c1-400 | tail -20
}
case ${1:-} in
start)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    mkdir -p "$RUN/out/data" && cp -r .gpurun/data/model "$RUN/out/data/"
    setsid nohup python3 bench/rag_bench.py --preset h200 --plan bench/plans/${PLAN:-h200_tier_capacity.json} \
        --tier-gb 24 --out "$RUN/out" > "$RUN/run.log" 2>&1 < /dev/null &
    echo "started $!"
    waitfor "${2:-500}"
    ;;
wait) waitfor "${2:-300}" ;;
*) echo "usage: $0 start|wait [seconds]" >&2; exit 2 ;;
esac
