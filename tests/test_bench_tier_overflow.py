"""``bench/bench_tier_overflow.py``'s CPU twin: the list-by-list build equals Faiss's own add
(``tier_overflow_build``), the open-loop dispatcher batches what has arrived
(``tier_overflow_rates``), the phases up to the partition run on a tiny corpus, and (slow)
every phase runs end to end there so a typo cannot reach the device."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import pytest


def test_build_by_list_equals_faiss_add(bench_module) -> None:
    import faiss

    gpu_kmeans = bench_module("gpu_kmeans")
    mod = bench_module("tier_overflow_build")
    args = argparse.Namespace(
        num_docs=3000, dim=16, nlist=16, topics=64, zipf=1.1, train_per_list=64, nprobe=4
    )
    index, spec, secs = mod.build_index(args, "cpu")
    assert set(secs) == {"generate", "kmeans_assign", "add"}
    x = mod.generate(spec, args.num_docs, "cpu").numpy()
    ivf = faiss.extract_index_ivf(index._index)
    centroids = ivf.quantizer.reconstruct_n(0, args.nlist)
    labels = gpu_kmeans.assign(x, centroids, "ip", device="cpu")
    ref = faiss.IndexIVFFlat(faiss.IndexFlatIP(16), 16, args.nlist, faiss.METRIC_INNER_PRODUCT)
    ref.quantizer.add(centroids)
    ref.is_trained = True
    ids = np.arange(1, args.num_docs + 1, dtype=np.int64)
    ref.add_core(args.num_docs, faiss.swig_ptr(x), faiss.swig_ptr(ids), faiss.swig_ptr(labels))
    assert ivf.ntotal == ref.ntotal == args.num_docs
    for c in range(args.nlist):
        n = ref.invlists.list_size(c)
        assert ivf.invlists.list_size(c) == n
        got = faiss.rev_swig_ptr(ivf.invlists.get_ids(c), n)
        want = faiss.rev_swig_ptr(ref.invlists.get_ids(c), n)
        np.testing.assert_array_equal(got, want)
    q = x[:32] + 0.01
    ref.nprobe = 4
    _, want_ids = ref.search(q, 5)
    np.testing.assert_array_equal(index.search(q, 5, 4).ids, want_ids)


def test_open_loop_batches_what_has_arrived(bench_module) -> None:
    mod = bench_module("tier_overflow_rates")
    batches: list[int] = []

    def search(q: np.ndarray) -> None:
        batches.append(len(q))
        time.sleep(0.05)

    arrivals = np.array([0.0, 0.001, 0.002, 0.003, 0.2, 0.2005])
    q = np.zeros((4, 2), dtype=np.float32)
    finish = mod.serve_open_loop(search, q, arrivals, max_batch=3, timeout=1.0)
    assert sum(batches[:2]) == 4 and len(batches) >= 3  # the 4 early ones, then the late 2
    assert sum(batches) == len(arrivals) and max(batches) <= 3
    assert np.all(finish >= arrivals) and not np.isnan(finish).any()
    cut = mod.serve_open_loop(search, q, np.array([0.0, 0.0, 0.0]), max_batch=1, timeout=0.0)
    assert np.isnan(cut).sum() >= 1  # past the timeout the rest is not served


def _argv(tmp_path: Path) -> list[str]:
    """A tiny corpus and a profile-memory file whose T_G is flat past 40 KV blocks."""
    profile = tmp_path / "eq2.json"
    profile.write_text(
        json.dumps(
            {
                "generation_profile": [[10, 5.0], [40, 20.0], [400, 20.0]],
                "gpu_memory_bytes": 4_000_000,
                "kv_block_bytes": 1000,
            }
        )
    )
    return ["--eq2-profile", str(profile),
            "--num-docs", "6000", "--dim", "16", "--nlist", "32", "--topics", "128",
            "--nprobe", "8", "--budget-gb", "0.0002", "--llm-rate", "200",
            "--slo-search", "0.05", "--coverage", "10", "30", "--model-batches", "1", "4", "16",
            "--model-repeats", "1", "--min-seconds", "0.05", "--max-batches", "3",
            "--rate-warmup", "0.2", "--rate-window", "1", "--rate-points", "2",
            "--device", "cpu", "--out", str(tmp_path / "ov.json")]  # fmt: skip


def test_smoke_build_model_budget_partition(bench_module, tmp_path: Path) -> None:
    """The default tier's run of the script: the phases up to the partition (no timing)."""
    mod = bench_module("bench_tier_overflow")
    skip = ["--skip", "latency", "cpu_rate", "tier_rate", "stream"]
    assert mod.main([*_argv(tmp_path), *skip]) == 0
    doc = json.loads((tmp_path / "ov.json").read_text())
    assert doc["failures"] == [] and doc["points"] == []  # nothing timed
    assert set(doc["phase_seconds"]) == {"build", "model", "budget", "partition"}
    assert doc["budget"]["source"] == "stated" and doc["budget"]["share_of_index"] < 1
    eq2 = doc["eq2"]
    assert eq2["source"] == "eq2" and eq2["kv_cache_bytes"] + eq2["budget_bytes"] <= 4_000_000
    assert eq2["num_kv_blocks"] >= 40  # T_G grows up to 40 blocks: Eq. 2 never starves it
    part = doc["partition"]
    assert part["batch_size"] >= 1 and part["predicted_s"] > 0


@pytest.mark.slow  # benchmark-shaped: timed latency points and SLO-bound rate searches
def test_overflow_bench_end_to_end(bench_module, tmp_path: Path) -> None:
    import faiss

    from ragserve.retrieval import stepwise

    mod = bench_module("bench_tier_overflow")
    assert mod.main(_argv(tmp_path)) == 0
    doc = json.loads((tmp_path / "ov.json").read_text())
    assert doc["failures"] == []
    tier = [p for p in doc["points"] if p["system"] == "gpu_tier"]
    assert [p["num_clusters"] for p in tier] == sorted({p["num_clusters"] for p in tier})
    assert sum(p["partitioner_choice"] for p in tier) == 1
    for p in tier:
        assert p["exact_ids"] == 1.0
        assert 0.0 <= p["tail_hit_rate_measured"] <= p["hit_rate_measured"] <= 1.0
        assert p["predicted_s"] > 0 and p["p90_s"] > 0
    streamed = {p["system"]: p for p in doc["points"] if p["system"].startswith("gpu_tier_str")}
    # the OpenMP-calibrated split runs only where it differs from the scan's own parallelism
    scan = stepwise.scan_threads()
    omp = faiss.omp_get_max_threads()
    assert set(streamed) == {"gpu_tier_stream"} | (
        {"gpu_tier_stream_omp"} if omp != scan else set()
    )
    assert streamed["gpu_tier_stream"]["stream_cost_model"]["threads"] == scan  # the scan's own
    for p in streamed.values():
        assert p["exact_ids"] == 1.0 and p["predicted_s"] > 0 and p["predicted_balanced_s"] > 0
        assert p["streamed_model"]["split"]["threads"] == p["stream_cost_model"]["threads"]
        assert 0.0 <= p["streamed_probe_share_measured"] <= 1.0
        assert 0.0 <= p["streamed_probe_share_model"] <= 1.0
    for system in ("cpu", "tier"):
        rate = doc[f"slo_rate_{system}"]
        assert rate["points"], system
        assert all("offered_rps" in p for p in rate["points"])
        saved = doc[f"rate_points_{system}"]  # each point saved as it was measured
        assert [p["rate"] for p in saved] == [p["rate"] for p in rate["points"]]
        good, bad = rate["capacity_qps"], rate["first_unsustained_qps"]
        tight = good is not None and bad is not None and bad / good <= 1.1
        assert (rate["bound"] == "=") == tight


def test_overflow_bench_needs_a_budget(bench_module, tmp_path: Path) -> None:
    mod = bench_module("bench_tier_overflow")
    with pytest.raises(SystemExit):
        mod.main(["--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()
