#!/usr/bin/env bash
# Issue 10, device call: a corpus larger than the GPU tier's budget (bench_tier_overflow.py),
# in ONE call. Results are rewritten into $OUT/overflow.json after every phase and point, the
# log goes to $OUT/overflow.log unbuffered, and `timeout` ends the run before the call's limit.
#   bash bench/h200_overflow_run.sh                     # 20M x 768, stated 24 GB budget
#   EQ2=bench/results/eq2_profile_h200.json bash bench/h200_overflow_run.sh   # + Eq. 2's split
# Env: LIMIT (seconds, default 520), ARGS (replaces the corpus and budget flags), EQ2.
set -uo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
: "${OUT:?OUT must name the folder results are written to}"
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
free -g | head -2
ARGS=${ARGS:-"--num-docs 20000000 --dim 768 --nlist 16384 --topics 65536 --nprobe 256 --budget-gb 24"}
# shellcheck disable=SC2086 # ARGS is a flag list
timeout "${LIMIT:-520}" python3 bench/bench_tier_overflow.py $ARGS ${EQ2:+--eq2-profile "$EQ2"} \
    --out "$OUT/overflow.json" > "$OUT/overflow.log" 2>&1
rc=$?
echo "exit code $rc (124: stopped by the time limit; the JSON holds every finished phase)"
grep -E "phase|failed|done:" "$OUT/overflow.log" | cut -c1-300 | tail -20
exit 0
