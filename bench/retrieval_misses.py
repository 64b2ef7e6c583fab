"""The held-out misses at recall@5 of the default folder build (issue 14, session 7 addendum):
for each question whose gold passage is not in the top 5, the question, its rank (or none in
the top 10), every gold passage as ingested (source, heading path, text) and the top 5
retrieved. Read to find ingest defects, never to choose a setting.

Default = MiniLM fine-tuned on the corpus (1/2e-5/16, as `retrieval_finetune.py`) in the
ensemble with its side encoder (`--side`: all-mpnet-base-v2 at 1 / 0.2 / 50, the default with
`ragserve[mpnet]` since the seventh run; multilingual-e5-small-q4 at 0.5 / 0.2 / 50 otherwise),
sections collapsed, exhaustive.

    .venv/bin/python bench/retrieval_misses.py --corpora scrapy,celery \
        --keep-encoders /tmp/s7/enc --cache /tmp/q14/bcache \
        --out bench/results/retrieval_misses_s7.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ragserve.retrieval import load_embedder
from ragserve.retrieval.ensemble import EnsembleConfig
from ragserve.retrieval.finetune import side_weight
from retrieval_finetune import faq_corpus, tuned_encoder
from retrieval_quality import CachedPassages, build_index


def _passage(d) -> dict:
    return {"source": d.metadata["source"], "section": d.metadata["section"], "text": d.text}


def corpus_misses(
    name: str, keep: Path | None, cache: Path | None, side_name: str, k: int = 5
) -> dict:
    base = load_embedder("all-minilm-l6-v2")
    docs, questions = faq_corpus(name, base)
    by_id = {d.id: d for d in docs}
    embedder, _ = tuned_encoder(base, docs, "1/2e-5/16", keep, name)
    index = build_index(docs, embedder, None)
    side = CachedPassages(load_embedder(side_name), cache)
    fusion = EnsembleConfig(side_name, side_weight(side_name, True), bm25_weight=0.2, depth=50)
    index.enable_ensemble(fusion, embedder=side)
    index.bm25()
    hits = index.search_text(
        [q.text for q in questions], 10, mode="ensemble", collapse_sections=True
    )
    misses = []
    for q, found in zip(questions, hits, strict=True):
        ids = [h.id for h in found]
        rank = next((i + 1 for i, x in enumerate(ids) if x in q.relevant), None)
        if rank is not None and rank <= k:
            continue
        misses.append({"question": q.text, "rank": rank,
                       "gold": [_passage(by_id[g]) for g in sorted(q.relevant)],
                       "retrieved": [_passage(by_id[x]) for x in ids[:k]]})  # fmt: skip
    index.close()
    return {"num_questions": len(questions), "num_passages": len(docs),
            f"hits@{k}": len(questions) - len(misses), "misses": misses}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpora", default="scrapy,celery")
    p.add_argument("--keep-encoders", type=Path, default=None)
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--side", default="all-mpnet-base-v2", help="the ensemble's side encoder")
    p.add_argument("--out", type=Path, default=Path("bench/results/retrieval_misses.json"))
    args = p.parse_args()
    out = {
        c: corpus_misses(c, args.keep_encoders, args.cache, args.side)
        for c in args.corpora.split(",")
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    for name, r in out.items():
        print(f"{name}: {r['hits@5']}/{r['num_questions']} in the top 5")
        for m in r["misses"]:
            print(f"  rank {m['rank'] or '>10'}: {m['question']} -> {m['gold'][0]['section']}")


if __name__ == "__main__":
    main()
