"""The overflow bench's index (``bench/bench_tier_overflow.py``): vectors generated on the tier
device and kept there (never a second host copy), torch k-means + assignment, then handed to
Faiss list by list at their final sizes."""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

import gpu_kmeans

LIST_BLOCK_ROWS = 1 << 20  # rows handed to Faiss per device-to-host copy


def generate(spec: Any, num_docs: int, device: str) -> Any:
    """``[num_docs, dim]`` float32 unit vectors on ``device`` (topics uniform, as
    ``synthetic_corpus``: topic center + Gaussian noise, normalised), drawn in chunks."""
    import torch

    dev = torch.device(device)
    topics = np.random.default_rng(spec.seed + 1).integers(0, spec.num_topics, num_docs)
    x = torch.empty((num_docs, spec.dim), dtype=torch.float32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(spec.seed + 1)
    centers = torch.from_numpy(spec.centers()).to(dev)
    scale = spec.doc_noise / math.sqrt(spec.dim)
    rows = 1 << 18
    with torch.no_grad():
        for a in range(0, num_docs, rows):
            v = x[a : a + rows]
            torch.randn(v.shape, generator=gen, device=dev, out=v)
            v.mul_(scale).add_(centers[torch.from_numpy(topics[a : a + rows]).to(dev)])
            v.div_(v.norm(dim=1, keepdim=True))
    return x


def build_index(args: argparse.Namespace, device: str) -> tuple[Any, Any, dict]:
    """An in-memory IVF-Flat IP ``VectorIndex`` (search only: no document rows) built from
    vectors that live on ``device``; ids are row + 1."""
    import faiss
    import torch

    from ragserve.retrieval import stepwise
    from ragserve.retrieval.docstore import DocStore
    from ragserve.retrieval.index import IndexSpec, VectorIndex
    from ragserve.retrieval.synthetic import SyntheticSpec

    seconds: dict[str, float] = {}
    spec = SyntheticSpec(dim=args.dim, num_topics=args.topics, zipf_a=args.zipf)
    t0 = time.perf_counter()
    x = generate(spec, args.num_docs, device)
    seconds["generate"] = _lap(t0)
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    n_train = min(args.num_docs, args.train_per_list * args.nlist)
    pick = torch.from_numpy(np.sort(rng.choice(args.num_docs, n_train, replace=False)))
    sample = x[pick.to(x.device)].cpu().numpy()
    centroids = gpu_kmeans.kmeans(sample, args.nlist, "ip", device=device, seed=0)
    del sample
    c = torch.from_numpy(centroids).to(x.device)
    labels = torch.empty(args.num_docs, dtype=torch.int64, device=x.device)
    with gpu_kmeans.exact_fp32(), torch.no_grad():
        for a in range(0, args.num_docs, gpu_kmeans.CHUNK_ROWS):
            rows = slice(a, a + gpu_kmeans.CHUNK_ROWS)
            labels[rows] = (x[rows] @ c.T).argmax(1)
    seconds["kmeans_assign"] = _lap(t0)
    t0 = time.perf_counter()
    index = stepwise.make_ivf(args.dim, args.nlist, "ivf_flat", "ip")
    index.quantizer.add(np.ascontiguousarray(centroids, dtype=np.float32))
    index.is_trained = True
    _add_by_list(index, x, labels, faiss)
    seconds["add"] = _lap(t0)
    del x, labels, c
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ispec = IndexSpec(args.dim, args.nlist, "ivf_flat", "ip", spec.name, args.nprobe)
    return VectorIndex(index, DocStore(None), ispec), spec, seconds


def _add_by_list(index: Any, x: Any, labels: Any, faiss: Any) -> None:
    """Every row into its list, lists in order and each list written once at its final size
    (no vector regrowth: Faiss's lists would otherwise hold up to twice their bytes)."""
    import torch

    order = torch.argsort(labels, stable=True)
    counts = torch.bincount(labels, minlength=index.nlist).cpu().numpy()
    bounds = np.concatenate([[0], np.cumsum(counts)])
    invlists = index.invlists
    c0 = 0
    while c0 < index.nlist:
        c1 = int(np.searchsorted(bounds, bounds[c0] + LIST_BLOCK_ROWS, side="right")) - 1
        c1 = max(c1, c0 + 1)
        rows = order[bounds[c0] : bounds[c1]]
        block = np.ascontiguousarray(x[rows].cpu().numpy())
        ids = rows.cpu().numpy().astype(np.int64) + 1
        for c in range(c0, c1):
            a, b = bounds[c] - bounds[c0], bounds[c + 1] - bounds[c0]
            if b > a:
                codes = block[a:b].view(np.uint8)
                invlists.add_entries(c, int(b - a), faiss.swig_ptr(ids[a:b]), faiss.swig_ptr(codes))
        c0 = c1
    index.ntotal = int(bounds[-1])


def _lap(t0: float) -> float:
    return time.perf_counter() - t0
