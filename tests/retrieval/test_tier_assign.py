"""Coarse assignment on the tier's device (CPU tensors here): what it calls sure is in Faiss's
probe set, what it leaves out is not, and near ties land in the band."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

from ragserve.retrieval.tier_assign import MAX_BAND, DeviceAssigner, gamma
from ragserve.retrieval.types import TopK

DIM, NLIST = 32, 64


def faiss_sets(metric: str, c: np.ndarray, q: np.ndarray, nprobe: int) -> list[set[int]]:
    index = faiss.IndexFlatIP(c.shape[1]) if metric == "ip" else faiss.IndexFlatL2(c.shape[1])
    index.add(c)
    _, ids = index.search(q, min(nprobe, len(c)))
    return [set(row.tolist()) for row in ids]


def tied_centroids(rng: np.random.Generator) -> np.ndarray:
    half = rng.normal(size=(NLIST // 2, DIM)).astype(np.float32)
    return np.concatenate([half, half])  # cluster i and i + NLIST/2 are equal


def check_split(metric: str, c: np.ndarray, q: np.ndarray, nprobe: int) -> DeviceAssigner:
    """sure <= Faiss's set <= sure + band, row by row (rows in ``redo`` aside)."""
    assigner = DeviceAssigner(torch, c, metric == "l2", "cpu")
    split = assigner.assign(q, nprobe)
    band = dict(zip(split.band_rows.tolist(), split.band.cluster_ids.tolist(), strict=True))
    for i, ref in enumerate(faiss_sets(metric, c, q, nprobe)):
        if i in split.redo:
            continue
        sure = {x for x in split.sure.cluster_ids[i].tolist() if x >= 0}
        maybe = {x for x in band.get(i, []) if x >= 0}
        assert not sure & maybe
        assert sure <= ref <= sure | maybe, i
        assert len(sure) <= len(ref) <= len(sure) + len(maybe)
    assert assigner.num_rows == len(q)
    return assigner


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("nprobe", [1, 5, 32, NLIST - 1, NLIST, 3 * NLIST])
def test_sure_and_band_bracket_faiss(metric: str, nprobe: int) -> None:
    rng = np.random.default_rng(0)
    c = rng.normal(size=(NLIST, DIM)).astype(np.float32)
    q = rng.normal(size=(200, DIM)).astype(np.float32)
    assigner = check_split(metric, c, q, nprobe)
    assert assigner.num_band_rows < len(q) // 4  # well-separated random scores


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_tied_boundary_lands_in_the_band(metric: str) -> None:
    """With every centroid doubled, the 7th and 8th best are a tied pair: every row has a
    band (holding both); at an even nprobe the boundary falls between pairs."""
    rng = np.random.default_rng(1)
    c = tied_centroids(rng)
    q = rng.normal(size=(100, DIM)).astype(np.float32)
    assert check_split(metric, c, q, 7).num_band_rows == len(q)
    assert check_split(metric, c, q, 8).num_band_rows < len(q)


def test_without_the_bound_ties_are_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound is what catches ties: switched off (negative), no row gets a band."""
    rng = np.random.default_rng(1)
    assigner = DeviceAssigner(torch, tied_centroids(rng), False, "cpu")
    monkeypatch.setattr(assigner, "_gamma", -1.0)
    split = assigner.assign(rng.normal(size=(100, DIM)).astype(np.float32), 7)
    assert len(split.band_rows) == 0


def test_a_band_wider_than_max_band_is_redone(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    c = rng.normal(size=(NLIST, DIM)).astype(np.float32)
    q = rng.normal(size=(10, DIM)).astype(np.float32)
    assigner = DeviceAssigner(torch, c, False, "cpu")
    monkeypatch.setattr(assigner, "_gamma", 10.0)
    assert NLIST > 4 + MAX_BAND
    split = assigner.assign(q, 4)
    np.testing.assert_array_equal(split.redo, np.arange(len(q)))
    sure = TopK(np.zeros((10, 3), np.int64), np.zeros((10, 3), np.float32))
    np.testing.assert_array_equal(assigner.settle(split, sure, None), np.arange(len(q)))


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_settle_keeps_rows_whose_band_cannot_reach_the_top_k(metric: str) -> None:
    """Row 0: band's best is worse than sure's k-th (kept); row 1: it ties (redone); row 2:
    it beats it (redone); row 3: sure has a missing slot (redone)."""
    rng = np.random.default_rng(1)
    assigner = DeviceAssigner(torch, tied_centroids(rng), metric == "l2", "cpu")
    split = assigner.assign(rng.normal(size=(4, DIM)).astype(np.float32), 7)
    assert split.band_rows.tolist() == [0, 1, 2, 3]
    sign = 1.0 if metric == "l2" else -1.0  # L2: smaller is better
    worst = np.inf if metric == "l2" else -np.inf
    kth = np.array([1.0, 1.0, 1.0, worst], np.float32)
    best = np.array([1.0 + sign * 0.5, 1.0, 1.0 - sign * 0.5, 0.0], np.float32)
    sure = TopK(np.zeros((4, 2), np.int64), np.stack([kth, kth], 1))
    band = TopK(np.zeros((4, 1), np.int64), best[:, None])
    np.testing.assert_array_equal(assigner.settle(split, sure, band), [1, 2, 3])
    assert assigner.num_fallback_rows == 3


def test_error_bound_and_bad_input() -> None:
    assert gamma(768) == pytest.approx(768 * 2.0**-24, rel=1e-3)
    with pytest.raises(ValueError, match="error bound"):
        gamma(1 << 24)
    with pytest.raises(ValueError, match="centroids"):
        DeviceAssigner(torch, np.zeros((0, 4), np.float32), False, "cpu")


def test_assign_chooser_times_both_paths_then_keeps_the_faster_per_bucket() -> None:
    from ragserve.retrieval.tier_assign import AssignChooser

    assert [AssignChooser.bucket(n) for n in (1, 2, 3, 32, 33, 256)] == [1, 2, 4, 32, 64, 256]
    chooser = AssignChooser(trials=3)
    cost = {32: {"tier": 0.018, "faiss": 0.016}, 256: {"tier": 0.039, "faiss": 0.060}}
    seen = {32: [], 256: []}
    for _ in range(8):
        for n in (32, 256):
            path = chooser.choose(n)
            seen[n].append(path)
            warm = 1.0 if path not in seen[n][:-1] else 0.0  # a slow first call of each path
            chooser.record(n, path, cost[n][path] + warm)
    assert seen[32][:6] == ["tier", "faiss"] * 3 and set(seen[32][6:]) == {"faiss"}
    assert seen[256][:6] == ["tier", "faiss"] * 3 and set(seen[256][6:]) == {"tier"}
    assert chooser.choices == {32: "faiss", 256: "tier"}
    assert chooser.seconds[32]["tier"][0] == pytest.approx(1.018)
    assert chooser.choose(20) == "faiss"  # bucket 32
    assert chooser.choose(100) == "tier"  # bucket 128: not measured yet, trials start
    with pytest.raises(ValueError, match="path"):
        chooser.record(8, "gpu", 0.1)
    with pytest.raises(ValueError, match="trials"):
        AssignChooser(trials=1)
