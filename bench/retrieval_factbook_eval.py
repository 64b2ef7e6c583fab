"""Built-in factbook index: build time and "What is the capital of X?" answer@5 vs nprobe.

A hit is a passage of the right country whose text contains the capital's name (the passage
an answer can be read from).

    .venv/bin/python bench/retrieval_factbook_eval.py [--rebuild] [--questions 60]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time

import numpy as np

from ragserve.retrieval import VectorIndex
from ragserve.retrieval.builtin import builtin_index, builtin_index_dir
from ragserve.retrieval.factbook import factbook_documents


def capital_questions(num: int, seed: int = 0):
    gov = [
        d
        for d in factbook_documents()
        if d.metadata["section"] == "Government" and "Capital: " in d.text
    ]
    rng = np.random.default_rng(seed)
    pick = [gov[i] for i in rng.choice(len(gov), min(num, len(gov)), replace=False)]
    capitals = [d.text.split("Capital: ")[1].split(";")[0].split(",")[0].strip() for d in pick]
    return pick, capitals, [f"What is the capital of {d.metadata['country']}?" for d in pick]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rebuild", action="store_true", help="delete and rebuild the index first")
    p.add_argument("--questions", type=int, default=60)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    if args.rebuild:
        shutil.rmtree(builtin_index_dir(), ignore_errors=True)
    load0 = os.getloadavg()
    t0, c0 = time.perf_counter(), time.process_time()
    path = builtin_index("factbook")
    build_s, build_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    index = VectorIndex.load(path)
    pick, capitals, questions = capital_questions(args.questions)
    result = {
        "build_or_load_seconds": round(build_s, 1),
        "build_or_load_cpu_seconds": round(build_cpu_s, 1),
        "loadavg_before": load0,
        "num_passages": index.num_documents,
        "nlist": index.nlist,
        "default_nprobe": index.spec.nprobe,
        "answer_at_5": {},
    }
    for nprobe in (1, 2, 4, index.spec.nprobe, index.nlist):
        hits = index.search_text(questions, 5, nprobe=nprobe)
        ok = [
            any(h.document.metadata["code"] == d.metadata["code"] and cap in h.text for h in r)
            for d, cap, r in zip(pick, capitals, hits, strict=True)
        ]
        result["answer_at_5"][nprobe] = float(np.mean(ok))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
