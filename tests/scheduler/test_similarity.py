"""Similarity-aware search: cluster reordering from a per-request local cache, exact vs Faiss."""

from __future__ import annotations

import numpy as np
from test_split import (
    HashEmbedder,
    StagedExecutor,
    doc_ids,
    make_index,
    run_requests,
)

from ragserve.retrieval.staged import reorder_probes
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.scheduler import RetrievalTask, Scheduler, Wavefront
from ragserve.scheduler.cosched import (
    CacheEntry,
    LocalCache,
    SimilarityTransform,
    SplitTransform,
)
from ragserve.scheduler.messages import StagedRetrievalTask
from ragserve.workflows import get_workflow


def test_reorder_puts_hits_then_previous_then_the_rest() -> None:
    ranks = reorder_probes(np.array([7, 3, 9, 1, 4]), [9], [3, 9, 4])
    assert ranks.tolist() == [2, 1, 4, 0, 3]
    assert reorder_probes(np.array([5, 6, -1, -1]), [], []).tolist() == [0, 1]
    assert reorder_probes(np.array([5, 6, 8]), [8, 42], [42]).tolist() == [2, 0, 1]


def test_local_cache_is_bounded_lru() -> None:
    cache = LocalCache(max_requests=2)
    cache.put("a", CacheEntry((1,), (1, 2)))
    cache.put("b", CacheEntry((3,), (3,)))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", CacheEntry((), ()))
    assert cache.get("b") is None and cache.get("a") and len(cache) == 2


def test_reordered_search_equals_faiss_and_hits_come_first() -> None:
    index = make_index("ivf_flat", "ip")
    emb = HashEmbedder()
    runner = StagedRetrievalRunner(index, emb, default_nprobe=16)
    runner.search.cost.seconds_per_vector = 1.0
    runner.search.cost.observe_scan = lambda *args: None
    ex = StagedExecutor(runner)
    sim = SimilarityTransform(cache_topk=20)
    sched = Scheduler(ex, [SplitTransform(budget_s=120.0), sim])
    graph = get_workflow("irg", rounds=3, topk=3)
    done = run_requests(sched, [(f"r{i}", graph, f"question {i}") for i in range(5)])
    assert all(r.error is None for r in done.values())
    tasks = [t for call in ex.retrieval_calls for t in call]
    assert len(tasks) == 15 and all(isinstance(t, StagedRetrievalTask) for t in tasks)
    first = [t for t in tasks if "\n" not in t.query]
    later = [t for t in tasks if "\n" in t.query]
    assert all(not t.hit_clusters and not t.previous_clusters for t in first)
    assert all(t.hit_clusters and len(t.previous_clusters) == 16 for t in later)
    assert all(t.cache_topk == 20 for t in tasks) and sim.num_reordered == 10
    # every retrieval's result equals Faiss's one-shot search of its query
    want = index.search(emb.encode([t.query for t in tasks]), 3, nprobe=16).ids
    for r in done.values():
        last = [i for i, t in enumerate(tasks) if t.query.startswith(r.state["input"] + "\n")][-1]
        assert [p.doc_id for p in r.state["docs"]] == doc_ids(index, want[last])


def test_first_substage_scans_the_cache_hit_clusters() -> None:
    index = make_index("ivf_flat", "ip")
    emb = HashEmbedder(noise=0.3)
    runner = StagedRetrievalRunner(index, emb, default_nprobe=16)
    for i in range(5):
        (r0,) = runner.run([StagedRetrievalTask("p", f"t{i}\nfirst", 3, cache_topk=20)])
        q = f"t{i}\nsecond"
        probed = index.assign(emb.encode([q]), 16).cluster_ids[0].tolist()
        hits = [c for c in probed if c in r0.hit_clusters]
        task = StagedRetrievalTask(
            "q",
            q,
            3,
            first_clusters=max(len(hits), 1),
            emit_partials=True,
            hit_clusters=r0.hit_clusters,
            previous_clusters=r0.probed_clusters,
        )
        (partial,) = runner.run([task])
        (final,) = runner.run([])
        rows = [int(x) for x in index.search(emb.encode([q]), 3, nprobe=16).ids[0]]
        assert [p.doc_id for p in final.passages] == doc_ids(index, rows)
        if hits:  # the first sub-stage is exactly the search of the cache-hit clusters
            only_hits = index.scan(emb.encode([q]), np.array([hits]), 3).ids[0]
            assert [p.doc_id for p in partial.passages] == doc_ids(index, only_hits)


def test_plain_task_becomes_staged_with_request_id() -> None:
    class _View:  # the one SchedulerView method the transform uses
        def task(self, task_id):
            return type("R", (), {"request_id": "req-1"})()

    sim = SimilarityTransform()
    sim.bind(_View())
    out = sim.apply(Wavefront(retrieval=[RetrievalTask("t", "q", 3)])).retrieval[0]
    assert isinstance(out, StagedRetrievalTask)
    assert out.request_id == "req-1" and out.cache_topk == 20 and not out.split
