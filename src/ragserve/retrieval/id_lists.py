"""Row id -> inverted list of an IVF index, sparse: sorted ids and their lists.

Row ids need not be dense (upserts, deletes, shards keep the ids of the whole index), so the map
is two parallel arrays looked up with ``searchsorted``: memory is proportional to the rows held,
whatever the largest id.
"""

from __future__ import annotations

from dataclasses import dataclass

import faiss
import numpy as np


@dataclass(frozen=True)
class IdLists:
    ids: np.ndarray  # int64, sorted ascending
    lists: np.ndarray  # int64, the list of ``ids[i]``

    @classmethod
    def of(cls, ivf: faiss.IndexIVF) -> IdLists:
        """The map of ``ivf``'s rows (the caller keeps the index unchanged meanwhile)."""
        ids, lists = [], []
        for c in range(ivf.nlist):
            n = ivf.invlists.list_size(c)
            if n:
                ids.append(faiss.rev_swig_ptr(ivf.invlists.get_ids(c), n).astype(np.int64))
                lists.append(np.full(n, c, np.int64))
        if not ids:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64))
        all_ids, all_lists = np.concatenate(ids), np.concatenate(lists)
        order = np.argsort(all_ids, kind="stable")
        return cls(all_ids[order], all_lists[order])

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        """int64: the list of each id, ``-1`` for ids not held."""
        ids = np.asarray(ids, dtype=np.int64)
        if not len(self.ids):
            return np.full(ids.shape, -1, np.int64)
        pos = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[pos] == ids, self.lists[pos], -1)
