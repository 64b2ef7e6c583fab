#!/usr/bin/env bash
# Issue 10, session 7: the fused tier scan (Triton kernel over the chunk pool) on one H200,
# <= 4 minutes (CALL_S, default 238 s). Carry: .whl (the faiss-cpu wheel).
#   1. gpu_tests: pytest -m gpu on the fused kernel's and the scan strategies' tests (<= 100 s)
#   2. compare:   5M x 768 IVF4096, the whole index resident (float32), grouped vs fused vs
#                 auto, nprobe 128/256/512, batch 1/32/256, ids checked against CPU Faiss
#                 (bench_gpu_tier.py --scan ... --skip-cpu --skip-exhaustive: no CPU-only rows);
#                 the fused tier part also at three other blocks per program (--fused-blocks)
# Writes $OUT/gpu_tests.log, $OUT/tier_kernel.json + .log and $OUT/summary.txt (one line per
# part, then one line per nprobe: queries/s of each strategy at batch 1/32/256, auto's choice,
# and whether every point's ids equal Faiss's).
# TWIN=cpu: the same parts at a tiny size on CPU, the fused kernel under Triton's interpreter
# (checks this script and the path, not a measurement).
set -uo pipefail
: "${OUT:?OUT must name the folder results are written to}"
CALL_S=${CALL_S:-238}
START=$SECONDS
mkdir -p "$OUT"
: > "$OUT/summary.txt"
SITE=/tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 1
fi
export PYTHONPATH=$SITE:$PWD/src PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-14}
PY=${PY:-python3}
ARGS="--num-docs 5000000 --dim 768 --nlist 4096 --topics 16384 --nprobe 128 256 512 \
--batch 1 32 256 --check-queries 64 --min-seconds 0.5 --max-batches 20"
BLOCKS="--fused-blocks 32x32 128x32 64x16"  # the fused kernel's tier part at other blocks too
if [ "${TWIN:-}" = cpu ]; then
    export TRITON_INTERPRET=1 OMP_NUM_THREADS=2
    BLOCKS="--fused-blocks 128x32"  # NOTE: the interpreter is slow: one other block only
    ARGS="--num-docs 20000 --dim 64 --nlist 64 --topics 256 --nprobe 8 --batch 1 8 \
--check-queries 16 --num-queries 64 --min-seconds 0.05 --max-batches 3 --device cpu"
fi

timeout -k 5 100 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/retrieval/test_tier_fused.py \
    tests/retrieval/test_tier_scan.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu_tests: exit $? ($(tail -1 "$OUT/gpu_tests.log"))" | tee -a "$OUT/summary.txt"

LEFT=$((CALL_S - (SECONDS - START) - 5))
# shellcheck disable=SC2086 # one option a word
timeout -k 5 "$LEFT" "$PY" bench/bench_gpu_tier.py $ARGS --coverage 100 \
    --scan grouped fused auto --assign tier --skip-cpu --skip-exhaustive $BLOCKS \
    --out "$OUT/tier_kernel.json" > "$OUT/tier_kernel.log" 2>&1
echo "compare: exit $? after $((SECONDS - START)) s (limit ${LEFT} s; 124: stopped, the JSON \
keeps every finished point)" | tee -a "$OUT/summary.txt"

# 3. the 14-thread CPU-only reference beside it (nprobe 256, batch 32/256; session 7's
#    baseline, here in the same call), if the call has >= 45 s left
LEFT=$((CALL_S - (SECONDS - START) - 5))
if ((LEFT >= 45)) && [ "${TWIN:-}" != cpu ]; then
    timeout -k 5 "$LEFT" "$PY" bench/bench_gpu_tier.py --num-docs 5000000 --dim 768 --nlist 4096 \
        --topics 16384 --nprobe 256 --batch 32 256 --cpu-only --cpu-scan-threads 14 \
        --check-queries 64 --min-seconds 1 --max-batches 4 --out "$OUT/cpu_ref.json" \
        > "$OUT/cpu_ref.log" 2>&1
    echo "cpu_ref: exit $? after $((SECONDS - START)) s; $(grep -o '"qps": [0-9.]*' \
        "$OUT/cpu_ref.json" 2>/dev/null | tr '\n' ' ')" | tee -a "$OUT/summary.txt"
fi

"$PY" - "$OUT/tier_kernel.json" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from collections import defaultdict

doc = json.load(open(sys.argv[1]))
rows = defaultdict(dict)
exact = []
for p in doc["points"]:
    if p["system"] == "tier_scan":
        name = p["scan"]
        if name == "auto":
            name += "(" + "/".join(k[0] for k, v in p["chosen"].items() if v) + ")"
        rows[p["nprobe"]].setdefault(p["scan"], []).append(f"{name}:{p['qps']:.0f}")
        exact.append(p["exact_ids"])
    if p["system"] == "gpu_tier":
        exact.append(p["exact_ids"])
for nprobe, scans in sorted(rows.items()):
    parts = " | ".join(" ".join(v) for v in scans.values())
    print(f"nprobe {nprobe}, tier part q/s at batch {doc['meta']['args']['batch']}: {parts}")
print(f"exact ids: {sum(e == 1.0 for e in exact)} of {len(exact)} points")
EOF
echo "call: $((SECONDS - START)) s" | tee -a "$OUT/summary.txt"
