"""Coarse assignment on the tier's device (CPU tensors here): Faiss's probe sets, row by row;
rows whose nprobe-th score nearly ties go back to Faiss."""

from __future__ import annotations

import faiss
import numpy as np
import pytest
import torch

from ragserve.retrieval.tier_assign import DeviceAssigner, gamma
from ragserve.retrieval.types import ProbePlan

DIM, NLIST = 32, 64


def quantizer(metric: str, c: np.ndarray) -> faiss.IndexFlat:
    index = faiss.IndexFlatIP(c.shape[1]) if metric == "ip" else faiss.IndexFlatL2(c.shape[1])
    index.add(c)
    return index


def faiss_plan(index: faiss.IndexFlat, q: np.ndarray, nprobe: int) -> ProbePlan:
    d, i = index.search(q, min(nprobe, index.ntotal))
    return ProbePlan(i.astype(np.int64), d)


def assign(
    metric: str, c: np.ndarray, q: np.ndarray, nprobe: int
) -> tuple[ProbePlan, DeviceAssigner]:
    index = quantizer(metric, c)
    assigner = DeviceAssigner(torch, c, metric == "l2", "cpu")
    plan = assigner.assign(q, nprobe, lambda rows: faiss_plan(index, q[rows], nprobe))
    return plan, assigner


def assert_same_sets(plan: ProbePlan, ref: ProbePlan) -> None:
    assert plan.cluster_ids.shape == ref.cluster_ids.shape
    np.testing.assert_array_equal(np.sort(plan.cluster_ids, 1), np.sort(ref.cluster_ids, 1))


@pytest.mark.parametrize("metric", ["ip", "l2"])
@pytest.mark.parametrize("nprobe", [1, 5, 32, NLIST - 1, NLIST, 3 * NLIST])
def test_probe_sets_equal_faiss(metric: str, nprobe: int) -> None:
    rng = np.random.default_rng(0)
    c = rng.normal(size=(NLIST, DIM)).astype(np.float32)
    q = rng.normal(size=(200, DIM)).astype(np.float32)
    plan, assigner = assign(metric, c, q, nprobe)
    ref = faiss_plan(quantizer(metric, c), q, nprobe)
    assert_same_sets(plan, ref)
    # best first, and the distances are the coarse distances (to float rounding)
    order = np.take_along_axis(ref.coarse_dists, np.argsort(ref.cluster_ids, 1), 1)
    mine = np.take_along_axis(plan.coarse_dists, np.argsort(plan.cluster_ids, 1), 1)
    np.testing.assert_allclose(mine, order, rtol=1e-4, atol=1e-4)
    assert assigner.num_rows == len(q)
    assert assigner.num_fallback_rows < len(q) // 4  # well-separated random scores


@pytest.mark.parametrize("metric", ["ip", "l2"])
def test_tied_boundary_goes_back_to_faiss(metric: str) -> None:
    """Duplicated centroids tie at every rank: a row whose nprobe-th and next cluster are
    copies of one centroid cannot be decided on the device, so Faiss assigns it (its tie
    order included); rows without such a tie keep the device's set."""
    rng = np.random.default_rng(1)
    half = rng.normal(size=(NLIST // 2, DIM)).astype(np.float32)
    c = np.concatenate([half, half])  # cluster i and i + NLIST/2 are equal
    q = rng.normal(size=(100, DIM)).astype(np.float32)
    nprobe = 7  # odd: the 7th and 8th best are always a tied pair
    plan, assigner = assign(metric, c, q, nprobe)
    ref = faiss_plan(quantizer(metric, c), q, nprobe)
    assert assigner.num_fallback_rows == len(q)
    np.testing.assert_array_equal(plan.cluster_ids, ref.cluster_ids)
    plan, assigner = assign(metric, c, q, nprobe + 1)  # even: the boundary falls between pairs
    assert assigner.num_fallback_rows < len(q)
    assert_same_sets(plan, faiss_plan(quantizer(metric, c), q, nprobe + 1))


def test_without_the_bound_ties_are_not_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is what catches ties: with it switched off (a negative bound) the tied rows
    are not sent back."""
    rng = np.random.default_rng(1)
    half = rng.normal(size=(NLIST // 2, DIM)).astype(np.float32)
    c = np.concatenate([half, half])
    q = rng.normal(size=(100, DIM)).astype(np.float32)
    assigner = DeviceAssigner(torch, c, False, "cpu")
    monkeypatch.setattr(assigner, "_gamma", -1.0)
    assigner.assign(q, 7, lambda rows: pytest.fail("no fallback expected"))
    assert assigner.num_fallback_rows == 0


def test_error_bound_and_bad_input() -> None:
    assert gamma(768) == pytest.approx(768 * 2.0**-24, rel=1e-3)
    with pytest.raises(ValueError, match="error bound"):
        gamma(1 << 24)
    with pytest.raises(ValueError, match="centroids"):
        DeviceAssigner(torch, np.zeros((0, 4), np.float32), False, "cpu")
