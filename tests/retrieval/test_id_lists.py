"""Row id -> inverted list map: sparse ids cost memory by rows held, not by the largest id."""

from __future__ import annotations

import faiss
import numpy as np

from ragserve.retrieval.index import IdLists


def _ivf(ids: np.ndarray) -> faiss.IndexIVFFlat:
    rng = np.random.default_rng(0)
    quantizer = faiss.IndexFlatIP(8)
    ivf = faiss.IndexIVFFlat(quantizer, 8, 4, faiss.METRIC_INNER_PRODUCT)
    x = rng.standard_normal((len(ids), 8)).astype(np.float32)
    ivf.train(x)
    ivf.add_with_ids(x, ids)
    return ivf


def test_ids_far_apart_map_to_their_lists() -> None:
    # an id near 2**44 once made a dense map of 16 TiB (ShardServer.clusters_of)
    ids = np.array([3, 7, 2**44 + 5, 12, 2**40], dtype=np.int64)
    ivf = _ivf(ids)
    lists = IdLists.of(ivf)
    assert lists.ids.nbytes == 8 * len(ids)
    expected = {}
    for c in range(ivf.nlist):
        n = ivf.invlists.list_size(c)
        for i in faiss.rev_swig_ptr(ivf.invlists.get_ids(c), n):
            expected[int(i)] = c
    query = np.array([2**44 + 5, 3, 4, -1, 2**62, 12], dtype=np.int64)
    got = lists(query)
    assert got.tolist() == [expected.get(int(i), -1) for i in query]
    assert got[2] == -1 and got[3] == -1 and got[4] == -1


def test_an_empty_index_maps_nothing() -> None:
    ivf = _ivf(np.arange(64, dtype=np.int64))
    ivf.reset()
    assert IdLists.of(ivf)(np.array([0, 1])).tolist() == [-1, -1]
