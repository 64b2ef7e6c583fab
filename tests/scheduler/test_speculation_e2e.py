"""All co-scheduling optimizations on the real engine and index (in process, tiny model):
greedy outputs identical to the plain run; aborted speculations leave no KV blocks behind."""

from __future__ import annotations

import asyncio

import pytest

from ragserve.runtime import Server, ServerConfig
from ragserve.scheduler.cosched import (
    CoScheduleConfig,
    SimilarityTransform,
    SpeculationTransform,
    SplitTransform,
)
from ragserve.workflows import get_workflow

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("India", "New Delhi"), ("Kenya", "Nairobi"), ("Egypt", "Cairo"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
]  # fmt: skip
FACTS = ["The capital of {c} is {k}.", "{c} has a long history.", "People in {c} eat well.",
         "{c} has mountains and rivers.", "The currency of {c} is old."]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from ragserve.retrieval import Document, VectorIndex, load_embedder
    from testing import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", "llama", seed=0)
    docs = [
        Document(f"{c}-{j}", f.format(c=c, k=k), c)
        for c, k in CAPITALS
        for j, f in enumerate(FACTS)
    ]
    index = VectorIndex.build(docs, load_embedder("all-minilm-l6-v2"), nlist=6)
    out = tmp_path_factory.mktemp("idx") / "small"
    index.save(out)
    index.close()
    return str(model), str(out)


def _workflows():
    small = {"max_tokens": 5}
    return [
        get_workflow("oneshot", topk=2, **small),
        get_workflow("irg", topk=2, rounds=2, **small),
        get_workflow("hyde", topk=2, hypo_tokens=5, **small),
        get_workflow("multistep", topk=2, rounds=2, step_tokens=5, **small),
        get_workflow("recomp", topk=2, summary_tokens=5, **small),
    ]


def _serve(model: str, index: str, cosched: CoScheduleConfig) -> tuple[dict, dict, tuple]:
    config = ServerConfig(
        in_process=True,
        engine_kwargs={"device": "cpu"},
        default_nprobe=4,
        cosched=cosched,
    )
    questions = [f"What is the capital of {c}?" for c, _ in CAPITALS[:6]]
    flows = _workflows()

    async def go(server: Server) -> list:
        jobs = [
            server.submit(q, flows[i % len(flows)], request_id=f"r{i}")
            for i, q in enumerate(questions * 2)
        ]
        return await asyncio.gather(*jobs)

    with Server(model, index, config=config) as server:
        responses = asyncio.run(go(server))
        server.close()  # stop the scheduler thread before looking at the engine
        engine = server.executor.generation.engine
        stats = engine.stats()
        engine.check_integrity()
        transforms = server.scheduler.transforms
    return {r.request_id: (r.error, r.output, r.doc_ids) for r in responses}, stats, transforms


def test_all_optimizations_give_identical_greedy_outputs(setup) -> None:
    model, index = setup
    plain, _, none = _serve(model, index, CoScheduleConfig.none())
    assert none == ()
    cfg = CoScheduleConfig(spec_capacity=1000, spec_first_clusters=1, spec_max_restarts=2)
    fast, stats, transforms = _serve(model, index, cfg)
    kinds = [SplitTransform, SimilarityTransform, SpeculationTransform]
    assert [type(t) for t in transforms] == kinds
    spec = transforms[-1]
    assert all(err is None for err, _, _ in plain.values())
    assert fast == plain
    s = spec.stats
    assert s.num_started > 0 and s.num_confirmed > 0 and s.num_adopted == s.num_confirmed
    assert s.num_aborted >= s.num_wrong  # wrong speculations were aborted (blocks: below)
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_blocks_used"] == 0  # aborted and finished speculations freed their blocks
