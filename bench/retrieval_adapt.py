"""Corpus adaptation (issue 14): a query map trained on pseudo-queries from the corpus itself
(`retrieval/adapter.py`), dense and ensemble recall with and without it.

Same corpora, questions, splits and passages as `retrieval_quality.py` (MiniLM, window-sized
passages, 32 tokens of overlap, exhaustive, collapse on); the evaluation questions never enter
training (their headings are hidden before ingest, and the pairs come from the passages only).
Choose on `--show tune` (pydocs), then run the chosen setting once on the held-out sets.

    .venv/bin/python bench/retrieval_adapt.py --corpora pydocs --show tune \
        --configs heading+sentence/10/1/0.05/held --cache /tmp/q14/bcache --out FILE
    (each config: sources/epochs/reg/temperature/targets held|stored; "none": no adapter)
    .venv/bin/python bench/retrieval_adapt.py --cost --corpora pydocs --cache /tmp/q14/bcache
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ragserve.retrieval import load_embedder
from ragserve.retrieval.adapter import (
    AdaptConfig,
    AdaptedEmbedder,
    QueryAdapter,
    pseudo_pairs,
    train_query_map,
)
from ragserve.retrieval.ensemble import EnsembleConfig
from ragserve.retrieval.ingest import ChunkConfig, Chunker
from retrieval_quality import (
    FAQ_CORPORA,
    CachedPassages,
    add_study_args,
    build_index,
    evaluate,
    prepare_faq,
    pydocs_new,
    split_table,
    start_logging,
)


def parse_config(text: str) -> AdaptConfig | None:
    if text == "none":
        return None
    sources, epochs, reg, temperature, targets = text.split("/")
    return AdaptConfig(tuple(sources.split("+")), targets == "held", int(epochs), reg=float(reg),
                       temperature=float(temperature))  # fmt: skip


def label(config: AdaptConfig | None) -> str:
    if config is None:
        return "none"
    targets = "held" if config.held_out else "stored"
    return (f"{'+'.join(config.sources)}/{config.epochs}/{config.reg:g}/{config.temperature:g}"
            f"/{targets}")  # fmt: skip


def run_corpus(name: str, configs, modes, cache, show: str, rows: list) -> None:
    embedder = load_embedder("all-minilm-l6-v2")
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        hidden = prepare_faq(FAQ_CORPORA[name], work)
        chunker = Chunker(embedder.tokenizer, embedder.passage_window, ChunkConfig(None, 32))
        docs, questions = pydocs_new(work, hidden, chunker)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    index = build_index(docs, embedder, cache)
    if "ensemble" in modes:
        side = CachedPassages(load_embedder("multilingual-e5-small-q4"), cache)
        index.enable_ensemble(EnsembleConfig(), embedder=side)
    index.bm25()
    row_ids, x = index.vectors_of(index.indexed_ids())
    position = {d.id: n for n, d in enumerate(index.get_documents(row_ids.tolist()))}
    stored = x[[position[d.id] for d in docs]]  # docs order
    all_pairs = pseudo_pairs(docs, ("heading", "sentence"))
    t0 = time.perf_counter()
    all_q = embedder.encode([p.query for p in all_pairs], is_query=True)
    embed_s = time.perf_counter() - t0
    held = CachedPassages(embedder, cache)
    held_x = held.encode([p.held_out_text for p in all_pairs], is_query=False)
    owners = np.array([p.doc for p in all_pairs])
    kinds = _kinds(docs, all_pairs)
    logging.info("%s: %d passages, %d pseudo-queries (%.1f s to embed; targets %.1f s)", name,
                 len(docs), len(all_pairs), embed_s, held.seconds)  # fmt: skip
    for config in configs:
        train_s, num_pairs = 0.0, 0
        if config is None:
            index._embedder = embedder
        else:
            keep = np.array([k in config.sources for k in kinds])
            t0 = time.perf_counter()
            if config.held_out:
                matrix = train_query_map(all_q[keep], held_x[keep], np.arange(keep.sum()), config,
                                         owners[keep])  # fmt: skip
            else:
                matrix = train_query_map(all_q[keep], stored, owners[keep], config)
            train_s, num_pairs = time.perf_counter() - t0, int(keep.sum())
            index._embedder = AdaptedEmbedder(embedder, QueryAdapter(matrix))
        for mode in modes:
            result = evaluate(index, questions, mode, None, True)
            row = {"corpus": name, "adapter": label(config), "mode": mode,
                   "num_passages": len(docs), "num_pairs": num_pairs,
                   "train_seconds": round(train_s, 2),
                   "query_embed_seconds_all_pairs": round(embed_s, 2), **result}  # fmt: skip
            rows.append(row)
            t = row[show]
            logging.info("%-10s %-36s %-8s %s R@1 %.3f R@5 %.3f R@10 %.3f MRR %.3f (%d) "
                         "pairs %d train %.1f s", name, label(config), mode, show, t["recall@1"],
                         t["recall@5"], t["recall@10"], t["mrr@10"], t["num_questions"],
                         num_pairs, train_s)  # fmt: skip
    index.close()


def _kinds(docs, pairs) -> list[str]:
    """Which source produced each pair of `pseudo_queries(docs, both)` (same order)."""
    heading = {(p.query, p.doc) for p in pseudo_pairs(docs, ("heading",))}
    return ["heading" if (p.query, p.doc) in heading else "sentence" for p in pairs]


def cost(name: str, cache, rounds: int = 2) -> None:
    """Build-time cost of `enable_query_adapter()` (default config: pseudo-queries and held-out
    targets embedded for real, then training) beside embedding the corpus's passages once with
    MiniLM, interleaved `rounds` times; logs medians and seconds per 1k passages."""
    from ragserve.retrieval.index import passage_text

    embedder = load_embedder("all-minilm-l6-v2")
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        hidden = prepare_faq(FAQ_CORPORA[name], work)
        chunker = Chunker(embedder.tokenizer, embedder.passage_window, ChunkConfig(None, 32))
        docs, _ = pydocs_new(work, hidden, chunker)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    index = build_index(docs, embedder, cache)
    times: dict[str, list[float]] = {"passages": [], "adapter": []}
    for _ in range(rounds):
        t0 = time.perf_counter()
        embedder.encode([passage_text(d) for d in docs], is_query=False)
        times["passages"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        num_pairs = index.enable_query_adapter()
        times["adapter"].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    logging.info("%s: %d passages, %d pairs; passages %.1f s (%s), adapter %.1f s (%s): "
                 "x%.2f, %.0f s per 1k passages", name, len(docs), num_pairs, med["passages"],
                 times["passages"], med["adapter"], times["adapter"],
                 med["adapter"] / med["passages"], 1000 * med["adapter"] / len(docs))  # fmt: skip
    index.close()


def table(path: Path) -> str:
    """`--out` as a Markdown table (`retrieval_quality.split_table`)."""
    columns = {"adapter": "---", "mode": "---", "pairs": "---:"}
    return split_table(path, columns, lambda r: [r["adapter"], r["mode"], str(r["num_pairs"])])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_args(p, "none,heading+sentence/10/1/0.05/held", "bench/results/retrieval_adapt.json")
    p.add_argument("--cost", action="store_true", help="time the default adapter's build cost")
    args = p.parse_args()
    if args.table:
        print(table(args.out))
        return
    start_logging()
    if args.cost:
        for name in args.corpora.split(","):
            cost(name, args.cache)
        return
    configs = [parse_config(c) for c in args.configs.split(",")]
    rows: list[dict] = []
    for name in args.corpora.split(","):
        run_corpus(name, configs, args.modes.split(","), args.cache, args.show, rows)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    logging.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
