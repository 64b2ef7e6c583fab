"""The Ray backend's placement group on a real local cluster (``test_ray_placement.py`` checks
the options with a fake ``ray``): a cluster that declares two GPUs (none exist: Ray only
accounts for them) gives each of two LLM replicas one bundle of one placement group, each
replica sees a different GPU id, the answers equal the single-process backend's, and closing
the server removes the group."""

from __future__ import annotations

import os
import shutil

import pytest
from test_workflows_e2e import small_workflow

from ragserve.runtime import Server, ServerConfig

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_replicas_take_one_gpu_bundle_each_of_one_placement_group(
    tiny_model: str, small_index: str, local_server: Server, tmp_path
) -> None:
    from ray.util.placement_group import placement_group_table

    def placement(actor) -> tuple[str, list[str]]:
        """In the actor (pickled by value): its placement group and the GPUs Ray gave it."""
        ctx = ray.get_runtime_context()
        return ctx.get_placement_group_id(), os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")

    if ray.is_initialized():
        pytest.skip("a Ray cluster is already up in this process")
    index = tmp_path / "small"
    shutil.copytree(small_index, index)
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = ServerConfig(
            backend="ray",
            num_llm_replicas=2,
            engine_kwargs={"device": "auto", "enable_prefix_caching": False},  # torch: CPU
        )
        with Server(tiny_model, str(index), config=config) as s:
            pg = s.executor._pg
            assert pg is not None
            table = placement_group_table(pg)
            assert table["state"] == "CREATED" and table["strategy"] == "PACK"
            assert [b.get("GPU") for b in table["bundles"].values()] == [1.0, 1.0]
            seen = [
                ray.get(s.executor.actors[f"llm_{i}"].__ray_call__.remote(placement), timeout=60)
                for i in range(2)
            ]
            assert [pg_id for pg_id, _ in seen] == [pg.id.hex()] * 2
            assert sorted(gpu for _, gpus in seen for gpu in gpus) == ["0", "1"]  # one each
            questions = ["What is the capital of Kenya?", "Where is Peru?"]
            got = [s.run(q, small_workflow("oneshot")) for q in questions]
        want = [local_server.run(q, small_workflow("oneshot")) for q in questions]
        assert [r.error for r in got] == [None, None]
        assert [(r.output, r.doc_ids) for r in got] == [(r.output, r.doc_ids) for r in want]
        assert placement_group_table(pg)["state"] == "REMOVED"
    finally:
        ray.shutdown()
