"""Multi-vector passages, measured offline on the pydocs tune half (issue 14, session 5): each
passage also embedded as windows of whole sentences (at most W MiniLM tokens, under its
heading path); a passage scores by its own vector, the best window, or a mix. Exhaustive
inner products in NumPy, section collapsing as `collapse.py` does it; not a search mode
(it did not beat the single vector on tune: BENCHMARKS.md).

    .venv/bin/python bench/retrieval_multivector.py --cache /tmp/q14/bcache [--windows 64,128]
"""

from __future__ import annotations

import argparse
import logging
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ragserve.retrieval import load_embedder
from ragserve.retrieval.collapse import section_key
from ragserve.retrieval.index import passage_text
from ragserve.retrieval.ingest import ChunkConfig, Chunker
from retrieval_quality import FAQ_CORPORA, CachedPassages, prepare_faq, pydocs_new

_SENTENCE = re.compile(r"(?<=[.!?:;])\s+(?=\S)")


def sentence_windows(tokenizer, text: str, limit: int) -> list[str]:
    """Consecutive whole sentences, at most `limit` tokens each (a longer sentence alone)."""
    sentences = [s for s in _SENTENCE.split(text) if s.strip()]
    if not sentences:
        return []
    counts = [len(x) for x in tokenizer(sentences, add_special_tokens=False)["input_ids"]]
    out, current, used = [], [], 0
    for sentence, n in zip(sentences, counts, strict=True):
        if current and used + n > limit:
            out.append(" ".join(current))
            current, used = [], 0
        current.append(sentence)
        used += n
    return [*out, " ".join(current)]


def recall(scores: np.ndarray, docs, relevant: list[set[int]]) -> dict[str, float]:
    """R@1/5/10 and MRR@10 of the collapsed rankings of `scores` `[questions, passages]`."""
    keys = [section_key(d) for d in docs]
    ranks = []
    for row, rel in zip(scores, relevant, strict=True):
        seen, top = set(), []
        for j in np.argsort(-row, kind="stable"):
            if keys[j] not in seen:
                seen.add(keys[j])
                top.append(j)
                if len(top) == 10:
                    break
        ranks.append(next((r for r, j in enumerate(top, 1) if j in rel), None))
    n = len(ranks)
    out = {f"R@{k}": sum(r is not None and r <= k for r in ranks) / n for k in (1, 5, 10)}
    return {**out, "MRR": sum(1 / r for r in ranks if r) / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--windows", default="64,128")
    p.add_argument("--split", default="tune")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    embedder = load_embedder("all-minilm-l6-v2")
    cached = CachedPassages(embedder, args.cache)
    work = Path(tempfile.mkdtemp(prefix="multivector-"))
    try:
        hidden = prepare_faq(FAQ_CORPORA["pydocs"], work)
        chunker = Chunker(embedder.tokenizer, embedder.passage_window, ChunkConfig(None, 32))
        docs, questions = pydocs_new(work, hidden, chunker)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    questions = [q for q in questions if q.split == args.split]
    index_of = {d.id: i for i, d in enumerate(docs)}
    relevant = [{index_of[r] for r in q.relevant} for q in questions]
    q = embedder.encode([x.text for x in questions], is_query=True)
    single = q @ cached.encode([passage_text(d) for d in docs], is_query=False).T
    logging.info("single vector          %s", _fmt(recall(single, docs, relevant)))
    for limit in (int(w) for w in args.windows.split(",")):
        owner, texts = [], []
        for j, d in enumerate(docs):
            for w in sentence_windows(embedder.tokenizer, d.text, limit):
                owner.append(j)
                texts.append(passage_text(d.__class__(d.id, w, d.title, d.metadata)))
        windows = q @ cached.encode(texts, is_query=False).T
        best = np.full_like(single, -1.0)
        np.maximum.at(best.T, np.asarray(owner), windows.T)
        logging.info("%d-token windows: %d", limit, len(texts))
        logging.info("  best window only     %s", _fmt(recall(best, docs, relevant)))
        logging.info(
            "  max(passage, window) %s", _fmt(recall(np.maximum(single, best), docs, relevant))
        )
        for lam in (0.25, 0.5, 1.0):
            mixed = recall(single + lam * best, docs, relevant)
            logging.info("  passage + %.2f best  %s", lam, _fmt(mixed))
    logging.info("embedding seconds (first run, incl. cached): %.1f", cached.seconds)


def _fmt(m: dict[str, float]) -> str:
    return " ".join(f"{k} {v:.3f}" for k, v in m.items())


if __name__ == "__main__":
    main()
