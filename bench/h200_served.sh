#!/usr/bin/env bash
# Issue 28's served-capacity run on one H200 (bench/served_capacity.py), in device calls of at
# most 10 minutes, run from the repository root of the checkout the device receives:
#   bash $G/bench/h200_served.sh smoke [S]   the pipeline at a tiny scale (h200-smoke preset,
#                                            5 s windows); if it passes, start the full run in
#                                            the background and wait up to S s for it
#   bash $G/bench/h200_served.sh start [S]   start the full run only, wait up to S s
#   bash $G/bench/h200_served.sh wait S      wait up to S s more; results + logs to $OUT
# $G (default .gpurun, carried) holds src/ and bench/ of the commit measured, whl/ (faiss-cpu,
# fastapi, starlette, uvicorn, pydantic and its parts: the device lacks them) and data/model
# (config + SmolLM2's tokenizer, written here by
#   python bench/rag_bench.py --preset h200 --model-only --out $G ; weights are random on the
#   device). Knobs: RATES (the --rates list; SYSTEM=find:LO,HI,N searches the sustained rate),
#   BUDGET (s after which no point starts), WINDOW, ENGINE_JSON (--engine-json).
set -uo pipefail
G=${G:-.gpurun}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$G"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/$G/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
RUN=${RUN:-/root/served}
OUT=${OUT:-/tmp/out}
mkdir -p "$RUN" "$OUT"
if [ "${SAMPLE:-0}" = 1 ]; then
    export PYTHONPATH=$PWD/$G/bench/stack_sampler:$PYTHONPATH RAGSERVE_STACK_SAMPLE=$RUN/stacks
fi
PRESET=${PRESET:-h200}
SMOKE_PRESET=${SMOKE_PRESET:-h200-smoke}
BENCH="python3 $G/bench/served_capacity.py"
RATES=${RATES:-"ragserve=4,12,20,28 llm-alone=20,28,36 baseline=8,14,20 ablations=auto"}
SYSTEMS=${SYSTEMS:-"ragserve llm-alone baseline no-tier no-cosched no-kv-reuse fusion-on cosched-all"}
SMOKE_SYSTEMS=${SMOKE_SYSTEMS:-$SYSTEMS}
COMMIT=${COMMIT:-unknown}
# An 80 GB card (H100) cannot hold the H200's 40 GiB KV cache beside the 24 GB tier and 16 GB
# of weights (the server refuses it at start): 28 GiB there, unless ENGINE_JSON says otherwise.
if [ -z "${ENGINE_JSON:-}" ]; then
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
    [ "${mem:-0}" -lt 100000 ] && ENGINE_JSON='{"kv_cache_bytes": 30064771072}'
fi

collect() {
    [ -f "$RUN/full/results.json" ] && cp "$RUN/full/results.json" "$OUT/results.json"
    [ -f "$RUN/full/served_capacity.png" ] && cp "$RUN/full/served_capacity.png" "$OUT/"
    [ -f "$RUN/full.log" ] && tail -c 3000000 "$RUN/full.log" > "$OUT/full.log"
    [ -f "$RUN/full/server.log" ] && tail -c 3000000 "$RUN/full/server.log" > "$OUT/server.log"
    [ -d "$RUN/stacks" ] && mkdir -p "$OUT/stacks" && cp "$RUN"/stacks/*.json "$OUT/stacks/" 2>/dev/null
    return 0
}

start() {
    mkdir -p "$RUN/full/data" && cp -r "$G/data/model" "$RUN/full/data/"
    # shellcheck disable=SC2086
    setsid nohup $BENCH --preset "$PRESET" --out "$RUN/full" --tier-gb 24 --seed 0 \
        --warmup ${WARMUP:-5} --window ${WINDOW:-60} --drain 20 --budget ${BUDGET:-1100} \
        --point-overhead 10 --systems $SYSTEMS --rates $RATES --commit "$COMMIT" \
        --engine-json "${ENGINE_JSON:-{\}}" \
        > "$RUN/full.log" 2>&1 < /dev/null &
    echo "started $! at $(date -u +%T)"
}

waitfor() {
    local end=$((SECONDS + $1))
    while [ $SECONDS -lt $end ] && pgrep -f "served_capacity.py --preset $PRESET " >/dev/null; do
        sleep 10
        collect
    done
    collect
    pgrep -f "served_capacity.py --preset $PRESET " >/dev/null && echo "still running" || echo "finished"
    grep -E "served_capacity \{|server up|Error|error" "$RUN/full.log" | cut -c1-330 | tail -16
}

case ${1:-} in
smoke)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    nproc; free -g | head -2; df -h /root | tail -1
    mkdir -p "$RUN/smoke/data" && cp -r "$G/data/model" "$RUN/smoke/data/"
    # shellcheck disable=SC2086
    timeout 400 $BENCH --preset "$SMOKE_PRESET" --out "$RUN/smoke" --tier-gb 2 --warmup 2 \
        --window 5 --drain 20 --systems $SMOKE_SYSTEMS \
        --rates ragserve=4,8 llm-alone=8 baseline=8 ablations=auto > "$RUN/smoke.log" 2>&1
    rc=$?
    echo "smoke exit $rc"
    cp "$RUN/smoke/results.json" "$OUT/smoke_results.json" 2>/dev/null
    tail -c 1000000 "$RUN/smoke.log" > "$OUT/smoke.log"
    tail -c 500000 "$RUN/smoke/server.log" > "$OUT/smoke_server.log" 2>/dev/null
    grep -v " INFO " "$RUN/smoke.log" | tail -30
    grep -E "server up|prepare|built" "$RUN/smoke.log" | cut -c1-200
    [ $rc -eq 0 ] || exit $rc
    start
    waitfor "${2:-200}"
    ;;
start)
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    start
    waitfor "${2:-500}"
    ;;
wait) waitfor "${2:-540}" ;;
*)
    echo "usage: $0 smoke|start|wait [seconds]" >&2
    exit 2
    ;;
esac
