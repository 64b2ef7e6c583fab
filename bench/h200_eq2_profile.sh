#!/usr/bin/env bash
# Issue 10, device call: HedraRAG Eq. 2's start-up profile on the H200 (`ragserve
# profile-memory`), over the h200 preset's index and Llama-3.1-8B shape, in ONE call. The
# profile is written to $OUT/eq2_profile.json at the end; every measured point is logged to
# $OUT/eq2_profile.log as it comes (unbuffered), so a cut-off run still shows them.
#   python bench/rag_bench.py --preset h200 --model-only --out .gpurun      # here, once
#   bash bench/h200_eq2_profile.sh                                           # device
# Env: PRESET (h200), MODEL (.gpurun/data/model), ENGINE (bench/plans/h200_engine.toml),
# DATA (index folder parent, /root/eq2), LIMIT (seconds, 480), ARGS (profile-memory flags).
set -uo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
: "${OUT:?OUT must name the folder results are written to}"
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
LOG=$OUT/eq2_profile.log
START=$SECONDS
INDEX=$(python3 - "${PRESET:-h200}" "${DATA:-/root/eq2}" <<'PY' 2>>"$LOG"
import logging, sys
from pathlib import Path
sys.path.insert(0, "bench")
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from rag_setup import PRESETS, synthetic_index
print(synthetic_index(PRESETS[sys.argv[1]], Path(sys.argv[2]))[0])
PY
) || { echo "index build failed"; tail -20 "$LOG"; exit 0; }
echo "index $INDEX built in $((SECONDS - START)) s"
ARGS=${ARGS:-"--nprobe 256 --tier-device cuda --kv-blocks 12 48 192 768 3072 --requests 256"}
# shellcheck disable=SC2086 # ARGS is a flag list
timeout "$(( ${LIMIT:-480} - (SECONDS - START) ))" python3 -m ragserve profile-memory \
    --config "${ENGINE:-bench/plans/h200_engine.toml}" --model "${MODEL:-.gpurun/data/model}" \
    --index "$INDEX" $ARGS --out "$OUT/eq2_profile.json" >> "$LOG" 2>&1
rc=$?
echo "exit code $rc (124: stopped by the time limit) after $((SECONDS - START)) s"
grep -E "T_G|T_R|wrote|error" "$LOG" | cut -c1-300 | tail -20
exit 0
