"""A saved index's CPU scan time vs batch size and clusters probed (``measure_profile``),
written to ``DIR/profile.json`` as a ``SearchProfile`` and printed as a table (was
``ragserve index profile``).

    PYTHONPATH=src python bench/index_profile.py factbook --batch-sizes 1,4,16,64
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ragserve.cli.options import resolve_index
from ragserve.retrieval import VectorIndex
from tier_models import measure_profile


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="index folder, or 'factbook' for the built-in one")
    ap.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    directory = Path(resolve_index(args.dir))
    index = VectorIndex.load(directory)
    batch_sizes = tuple(int(b) for b in args.batch_sizes.split(","))
    _, vectors = index._store.vectors()
    rng = np.random.default_rng(0)
    queries = vectors[rng.choice(len(vectors), max(batch_sizes), replace=len(vectors) < 64)]
    prof = measure_profile(index, queries, batch_sizes=batch_sizes, repeats=args.repeats)
    prof.save(directory / "profile.json")
    index.close()
    print(f"wrote {directory / 'profile.json'} (seconds per scan step)")
    print("batch \\ clusters " + " ".join(f"{c:>9d}" for c in prof.cluster_counts))
    for b, row in zip(prof.batch_sizes, prof.seconds, strict=True):
        print(f"{b:>17d} " + " ".join(f"{t * 1e3:>7.2f}ms" for t in row))


if __name__ == "__main__":
    main()
