"""``ragserve profile-memory`` (Eq. 2's start-up profiler) on CPU: it measures both profiles,
writes the file ``serve --gpu-index-profile`` reads, and Eq. 2 then splits the memory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from ragserve.cli.main import main
from ragserve.runtime.memory_plan import (
    GenerationWorkload,
    kv_block_bytes,
    measure_generation_profile,
    measure_retrieval_profile,
)

ENGINE = {"device": "cpu", "enable_prefix_caching": False}


def test_cli_writes_the_profile_serve_reads(tiny_model, small_index, tmp_path: Path) -> None:
    from ragserve.cli.main import build_parser
    from ragserve.cli.serve import serve_launch_config
    from ragserve.runtime.memory_plan import plan_gpu_memory

    out = tmp_path / "profile.json"
    questions = tmp_path / "q.txt"
    questions.write_text("".join(f"What is the capital of country {i}?\n" for i in range(6)))
    argv = ["profile-memory", "--model", tiny_model, "--index", small_index, "--device", "cpu",
            "--tier-device", "cpu", "--kv-blocks", "2", "8", "--tier-gb", "0", "0.001",
            "--prompt-tokens", "8", "--output-tokens", "4", "--requests", "3", "--batch", "4",
            "--gpu-memory-gb", "0.002", "--questions", str(questions),
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert [p[0] for p in doc["generation_profile"]] == [2, 8]
    assert [p[0] for p in doc["retrieval_profile"]] == [0, 1_000_000]
    assert all(p[1] > 0 for p in doc["generation_profile"] + doc["retrieval_profile"])
    assert doc["gpu_memory_bytes"] == 2_000_000
    assert doc["kv_block_bytes"] == kv_block_bytes(tiny_model, ENGINE)
    assert doc["meta"]["retrieval"][1]["num_clusters"] >= 1  # the tier held lists
    assert doc["meta"]["generation"][1]["requests"] == 3
    serve = ["serve", "--model", tiny_model, "--index", small_index, "--device", "cpu",
             "--gpu-index-device", "cpu", "--gpu-index-profile", str(out)]  # fmt: skip
    config = serve_launch_config(build_parser().parse_args(serve))
    tier = config.runtime.gpu_tier
    assert tier.generation_profile and tier.retrieval_profile
    tier = dataclasses.replace(tier, gpu_memory_bytes=doc["gpu_memory_bytes"])
    runtime = dataclasses.replace(config.runtime, gpu_tier=tier)
    resolved, plan = plan_gpu_memory(runtime, tiny_model, small_index)
    assert plan.source == "eq2"
    assert plan.kv_cache_bytes + plan.tier_bytes <= doc["gpu_memory_bytes"]
    assert dict(resolved.engine_kwargs)["kv_cache_bytes"] == plan.kv_cache_bytes


def test_generation_profile_rejects_a_kv_size_below_one_request(tiny_model) -> None:
    work = GenerationWorkload(prompt_tokens=30, output_tokens=10, num_requests=2)
    with pytest.raises(ValueError, match="kv_blocks"):
        measure_generation_profile(tiny_model, ENGINE, [2], work)  # 2 x 16 < 40 tokens


def test_retrieval_profile_places_lists_and_drops_the_tier(small_index) -> None:
    from ragserve.retrieval import VectorIndex

    index = VectorIndex.load(small_index)
    try:
        q = index.embedder.encode([f"capital of country {i}" for i in range(8)], is_query=True)
        prof, rows = measure_retrieval_profile(
            index, q, [0, 1 << 22], device="cpu", batch_size=4, min_batches=2
        )
        assert prof.sizes == (0.0, float(1 << 22))
        assert rows[0]["num_clusters"] == 0 and rows[1]["num_clusters"] == 4  # all fit
        assert index.gpu_tier is None  # dropped at the end
        with pytest.raises(ValueError, match="batch_size"):
            measure_retrieval_profile(index, q, [0], device="cpu", batch_size=9)
        with pytest.raises(ValueError, match="tier_bytes"):
            measure_retrieval_profile(index, q, [-1], device="cpu", batch_size=4)
    finally:
        index.close()
    assert np.all(np.asarray(prof.requests_per_second) > 0)


def test_workload_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="output_tokens"):
        GenerationWorkload(output_tokens=0)
