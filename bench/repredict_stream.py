"""Re-predict a recorded streamed-tier latency point (``bench_tier_overflow.py``'s
``gpu_tier_stream*`` rows) with the current ``StreamedLatencyModel``, from the run's own
recorded calibration only: the CPU model (``T_CQ``, ``T_LUT``), the stream's cost model (its
stream side, and its CPU side as the router's pricing), bytes per cold probe, distinct
share and the modelled tail hit rate. No measured latency enters the prediction.

    python bench/repredict_stream.py \
        bench/results/plan_h200_s6/call3/overflow_stream/overflow_stream.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ragserve.retrieval.cold_stream import StreamCostModel
from ragserve.retrieval.latency_model import SearchLatencyModel
from tier_models import StreamedLatencyModel


def repredict(doc: dict, row: dict) -> dict:
    """The row's p90 (at the modelled tail hit rate) and p50 (at the mean) predictions, with
    the router's split and with a balanced one, next to what was measured."""
    base = SearchLatencyModel.from_json(json.dumps(doc["model"]["latency_model"]))
    sm, cost = row["streamed_model"], row["stream_cost_model"]
    row_bytes = int(doc["meta"]["args"]["dim"]) * 4 + 8
    both = StreamCostModel(
        cost["cpu_fixed_s"],
        cost["cpu_s_per_row"],
        sm["fixed_s"],
        sm["s_per_byte"],
        int(cost["threads"]),
    )
    bpp, ds = sm["bytes_per_probe"], sm["distinct_share"]
    routed = StreamedLatencyModel(base, both, bpp, ds, rows_per_probe=bpp / row_bytes)
    balanced = StreamedLatencyModel(base, both, bpp, ds)
    b, tail, mean = int(row["batch"]), row["tail_hit_rate_model"], row["hit_rate_model"]
    y = float(routed.streamed_shares(np.asarray([b]), np.asarray([1.0 - mean]))[0])
    batch_bytes = y * b * base.nprobe * sm["bytes_per_probe"] * sm["distinct_share"]
    out = {
        "system": row["system"],
        "batch": b,
        "router_lut_s": float(routed.router_seconds(np.asarray([b]))[0][0]),
        "lut_s": base.lut_seconds(b),
        "streamed_probe_share_model": y / max(1.0 - mean, 1e-12),
        "streamed_gb_per_batch_model": batch_bytes / 1e9,
    }
    if row.get("streamed_batches"):
        out["streamed_gb_per_batch_measured"] = row["streamed_gb"] / row["streamed_batches"]
    for name, model in (("routed", routed), ("balanced", balanced)):
        p90, p50 = model.hybrid_seconds(b, tail), model.hybrid_seconds(b, mean)
        out[f"{name}_p90_s"], out[f"{name}_p50_s"] = p90, p50
        out[f"{name}_p90_error"] = (p90 - row["p90_s"]) / row["p90_s"]
        out[f"{name}_p50_error"] = (p50 - row["p50_s"]) / row["p50_s"]
    out.update(measured_p50_s=row["p50_s"], measured_p90_s=row["p90_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("result", type=Path, help="bench_tier_overflow.py's JSON")
    ap.add_argument("--out", type=Path, default=None, help="write the re-predictions here")
    args = ap.parse_args(argv)
    doc = json.loads(args.result.read_text())
    rows = [p for p in doc.get("points", []) if str(p.get("system")).startswith("gpu_tier_str")]
    if not rows:
        raise SystemExit(f"{args.result}: no gpu_tier_stream row")
    got = [repredict(doc, r) for r in rows]
    for g in got:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in g.items()}))
    if args.out is not None:
        args.out.write_text(json.dumps({"source": str(args.result), "rows": got}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
