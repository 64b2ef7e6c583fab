"""Sharded search equals the source index's one-shot Faiss search; upserts reach the owner."""

from __future__ import annotations

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.shard_split import (
    ROW_ID_SHIFT,
    ShardLayout,
    balance_lists,
    read_layout,
    split_index,
)
from ragserve.retrieval.sharded import ShardedIndex

DIM = 16


def _vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module", params=["ivf_flat", "ivf_pq"])
def source(request, tmp_path_factory) -> tuple[str, str]:
    docs = [Document(f"d{i}", f"text {i}", None) for i in range(2000)]
    vi = VectorIndex.from_vectors(
        docs, _vectors(2000, 0), embedder_name="none", nlist=16, kind=request.param, nprobe=4
    )
    out = tmp_path_factory.mktemp("src") / "index"
    vi.save(out)
    vi.close()
    return str(out), request.param


@pytest.mark.parametrize("partition", ["list", "document"])
def test_stepwise_sharded_search_equals_faiss_one_shot(source, tmp_path, partition) -> None:
    path, _ = source
    layout = split_index(path, tmp_path / "shards", 3, partition)
    assert read_layout(tmp_path / "shards") == layout
    one = VectorIndex.load(path)
    sharded = ShardedIndex.open_local(tmp_path / "shards")
    q = _vectors(40, 1)
    for nprobe in (1, 4, 16):
        faiss_ids = np.empty((40, 10), np.int64)
        faiss_scores = np.empty((40, 10), np.float32)
        one.faiss_index.nprobe = nprobe
        faiss_scores[:], faiss_ids[:] = one.faiss_index.search(q, 10)
        plan = sharded.assign(q, nprobe)
        for steps in (1, 3):
            state = None
            for part in reversed(plan.split(steps)):  # any order
                state = sharded.scan(q, part, 10, state)
            assert np.array_equal(state.ids, faiss_ids)
            hit = faiss_ids >= 0
            np.testing.assert_array_equal(state.scores[hit], faiss_scores[hit])
    assert sharded.num_documents == 2000
    assert np.array_equal(sharded.cluster_sizes(), one.cluster_sizes())
    sharded.check_integrity()
    stats = sharded.shard_stats()
    assert sum(s["num_documents"] for s in stats) == 2000
    if partition == "list":
        assert all(0 < s["num_documents"] < 2000 for s in stats)
    one.close()


@pytest.mark.parametrize("partition", ["list", "document"])
def test_upserts_and_deletes_reach_the_owner_and_survive_reopen(source, tmp_path, partition):
    path, kind = source
    if kind != "ivf_flat":
        pytest.skip("upsert routing does not depend on the code kind")
    split_index(path, tmp_path / "shards", 2, partition)
    sharded = ShardedIndex.open_local(tmp_path / "shards")
    new = _vectors(30, 7)
    docs = [Document(f"new{i}", f"new text {i}", None) for i in range(30)]
    sharded.add_documents(docs, new)
    found = sharded.search(new, 1, nprobe=16)
    got = sharded.get_documents(found.ids[:, 0].tolist())
    assert [d.id for d in got] == [d.id for d in docs]
    assert all(int(i) >= 1 << ROW_ID_SHIFT for i in found.ids[:, 0])
    moved = _vectors(5, 8)  # same ids, new vectors: an update may change the owning list
    sharded.add_documents(docs[:5], moved)
    assert sharded.num_documents == 2030
    assert sharded.delete_documents(["new29", "d0", "missing"]) == 2
    sharded.check_integrity()
    reopened = ShardedIndex.open_local(tmp_path / "shards")
    assert reopened.num_documents == 2028
    again = reopened.search(moved, 1, nprobe=16)
    assert [d.id for d in reopened.get_documents(again.ids[:, 0].tolist())] == [
        f"new{i}" for i in range(5)
    ]
    assert reopened.get_documents(["new29", "d0", "d1"])[:2] == [None, None]
    with pytest.raises(ValueError, match="vectors must have shape"):
        reopened.add_documents(docs[:2], new[:1])


def test_balance_lists_is_lpt_and_layout_validates() -> None:
    assert balance_lists(np.array([5, 1, 4, 3, 3]), 2) == (0, 1, 1, 1, 0)  # loads 8 and 8
    with pytest.raises(ValueError, match="num_shards"):
        ShardLayout(0)
    with pytest.raises(ValueError, match="partition"):
        ShardLayout(2, "hash")
    with pytest.raises(ValueError, match="owners"):
        ShardLayout(2, "list")
    layout = ShardLayout(4, "document")
    assert layout.owner_of_document("abc") == layout.owner_of_document("abc") < 4


@pytest.mark.parametrize("partition", ["list", "document"])
def test_sharded_search_with_gpu_tiers_equals_faiss_one_shot(source, tmp_path, partition):
    """Each shard holds a tier (CPU twin: ``device="cpu"``): the whole index, then only part
    of it (hot lists on the tier, the rest on Faiss); step-wise results stay Faiss's."""
    path, kind = source
    split_index(path, tmp_path / "shards", 2, partition)
    sharded = ShardedIndex.open_local(tmp_path / "shards")
    if kind != "ivf_flat":
        with pytest.raises(ValueError, match="kind: the GPU tier holds IVF-Flat"):
            sharded.set_gpu_tier(1 << 20, device="cpu")
        return
    one = VectorIndex.load(path)
    q = _vectors(40, 3)
    one.faiss_index.nprobe = 8
    want_scores, want_ids = one.faiss_index.search(q, 10)
    seen = set()
    # everything resident, then a few lists, then a few with the rest streamed (CPU twin)
    for budget, scan, stream in (
        (1 << 24, "auto", "auto"),
        (40_000, "auto", "auto"),
        (40_000, "dense", "on"),
    ):
        tier = sharded.set_gpu_tier(budget, device="cpu", scan=scan, stream_cold=stream)
        for shard in sharded.shards:
            own = shard.server.index.gpu_tier
            assert own.scan_strategy == scan and (own.streamer is not None) == (stream == "on")
        assert tier is not None and tier.shards == 2 and tier.device == "cpu"
        assert 0 < tier.num_bytes <= budget
        seen.add(len(tier.clusters))
        plan = sharded.assign(q, 8)
        for steps in (1, 3):
            state = None
            for part in reversed(plan.split(steps)):
                state = sharded.scan(q, part, 10, state)
            assert np.array_equal(state.ids, want_ids)  # scores: matmul vs Faiss's kernel
            np.testing.assert_allclose(state.scores, want_scores, rtol=1e-5, atol=1e-5)
        mask = sharded.resident_mask(plan.cluster_ids)
        assert np.array_equal(mask, np.isin(plan.cluster_ids, tier.clusters))
    assert max(seen) == 16 and min(seen) < 16  # whole index, then part of it
    assert sum(s["tier_clusters"] for s in sharded.shard_stats()) > 0
    sharded.drop_gpu_tier()
    assert sharded.gpu_tier is None and not sharded.resident_mask(plan.cluster_ids).any()
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        sharded.set_gpu_tier(-1, device="cpu")
    with pytest.raises(ValueError, match="scan must be one of"):
        sharded.set_gpu_tier(1 << 20, device="cpu", scan="fast")
    with pytest.raises(ValueError, match="stream_cold must be one of"):
        sharded.set_gpu_tier(1 << 20, device="cpu", stream_cold="yes")
    one.close()
