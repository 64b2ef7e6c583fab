"""The shipped default, end to end, on the seven held-out FAQ sets (issue 14): each set's folder
prepared as `retrieval_quality.py` / `retrieval_finetune.py` prepare it (FAQ question headings
hidden as "FAQ entry n"), indexed by `build_index(folder, out)` with no config (what
`ragserve index build` does: fine-tuning, side encoder, default mode all resolved per corpus),
reloaded with `VectorIndex.load` and searched with the index's recorded defaults (mode,
nprobe, collapse). Scored as the other scripts score (`retrieval_quality.evaluate`: a passage
is relevant when it comes from the answer's section); pydocs on its test half, the rest on all
questions. Each set's passages are checked to be exactly those the other scripts evaluate.

    .venv/bin/python bench/retrieval_default_build.py \
        [--corpora pydocs,django,sqlalchemy,celery,scrapy,lxml,docutils] [--work DIR] \
        [--out bench/results/retrieval_default_build.json]
    .venv/bin/python bench/retrieval_default_build.py --table --out FILE
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

from ragserve.retrieval import VectorIndex, build_index, load_embedder
from ragserve.retrieval.ingest import ChunkConfig, Chunker
from retrieval_quality import FAQ_CORPORA, evaluate, prepare_faq, pydocs_new, start_logging

HELD_OUT = "pydocs,django,sqlalchemy,celery,scrapy,lxml,docutils"
# BENCHMARKS.md, seventh run: "fine-tuned MiniLM + e5 0.5 / 0.2 / 50 (default before)", R@5
BENCHMARKS_R5 = {"pydocs": 0.925, "django": 0.956, "sqlalchemy": 0.914, "celery": 0.844,
                 "scrapy": 0.750, "lxml": 0.973, "docutils": 0.974}  # fmt: skip


def run_corpus(name: str, work: Path) -> dict:
    """Prepare `name`'s folder under `work`, build it with the defaults, score the reload."""
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    hidden = prepare_faq(FAQ_CORPORA[name], folder)
    # the passages and questions the other scripts evaluate (`retrieval_finetune.faq_corpus`)
    base = load_embedder("all-minilm-l6-v2")
    chunker = Chunker(base.tokenizer, base.passage_window, ChunkConfig(None, 32))
    docs, questions = pydocs_new(folder, hidden, chunker)
    report = build_index(folder / "docs", folder / "index")
    index = VectorIndex.load(folder / "index")
    try:
        stored = index.get_documents([d.id for d in docs])
        same = index.num_documents == len(docs) and all(
            s is not None and s.text == d.text for s, d in zip(stored, docs, strict=True)
        )
        # mode, nprobe, collapse None: `search_text`'s own defaults, i.e. the index's recorded ones
        result = evaluate(index, questions, None, None, None)
        split = "test" if name == "pydocs" else "all"
        t = result[split]
        row = {
            "corpus": name,
            "split": split,
            "num_passages": report.num_passages,
            "passages_match_bench": same,
            "num_questions": t["num_questions"],
            **{k: t[k] for k in ("recall@1", "recall@5", "recall@10", "mrr@10")},
            "in_top5": round(t["recall@5"] * t["num_questions"]),
            "at_rank1": round(t["recall@1"] * t["num_questions"]),
            "benchmarks_r5": BENCHMARKS_R5.get(name),
            "dtype": str(index.embedder.model.dtype).removeprefix("torch."),
            "side_dtype": str(index.side_dense().embedder.model.dtype).removeprefix("torch.")
            if index.ensemble_config
            else None,
            "finetune": report.finetune,
            "ensemble": report.ensemble,
            "ensemble_config": index.metadata.get("ensemble"),
            "default_mode": report.default_mode,
            "index_default_mode": index.default_mode,
            "collapse_sections": index.collapses(None),
            "nlist": report.nlist,
            "seconds": report.seconds,
            "ms_per_query": result["ms_per_query"],
            "splits": {s: result[s] for s in ("tune", "test", "all")},
        }
    finally:
        index.close()
    logging.info("%-10s %s (%d) R@1 %.3f R@5 %.3f R@10 %.3f MRR %.3f top5 %d (BENCHMARKS %s) "
                 "%s, passages match %s, %s", name, split, t["num_questions"], t["recall@1"],
                 t["recall@5"], t["recall@10"], t["mrr@10"], row["in_top5"],
                 row["benchmarks_r5"], row["dtype"], same, report.seconds)  # fmt: skip
    return row


def table(path: Path) -> str:
    """`--out` as a Markdown table, totals over its sets last."""
    rows = json.loads(path.read_text())["rows"]
    out = [
        "| set (split, questions) | passages | pairs | dtype | R@1 | R@5 | R@10 | MRR@10 "
        "| top 5 | BENCHMARKS R@5 (top 5) | change |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        n, bench = r["num_questions"], r["benchmarks_r5"]
        was = round(bench * n) if bench is not None else None
        out.append(f"| {r['corpus']} ({r['split']}, {n}) | {r['num_passages']} | "
                   f"{r['finetune'].get('num_pairs', '-')} | {r['dtype']} | "
                   + " | ".join(f"{r[k]:.3f}" for k in ("recall@1", "recall@5", "recall@10",
                                                         "mrr@10"))
                   + f" | {r['in_top5']} | {bench} ({was}) | "
                   + (f"{r['in_top5'] - was:+d} |" if was is not None else "- |"))  # fmt: skip
    n = sum(r["num_questions"] for r in rows)
    top5, rank1 = sum(r["in_top5"] for r in rows), sum(r["at_rank1"] for r in rows)
    was = sum(round(r["benchmarks_r5"] * r["num_questions"]) for r in rows if r["benchmarks_r5"])
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("recall@5", "mrr@10")}
    out.append(f"| total / mean ({n}) | {sum(r['num_passages'] for r in rows)} | | | "
               f"{rank1} at rank 1 | {mean['recall@5']:.3f} | | {mean['mrr@10']:.3f} | {top5} | "
               f"({was}) | {top5 - was:+d} |")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpora", default=HELD_OUT)
    p.add_argument("--out", type=Path, default=Path("bench/results/retrieval_default_build.json"))
    p.add_argument("--work", type=Path, default=None, help="prepared folders + indexes (kept)")
    p.add_argument("--table", action="store_true", help="print --out as a Markdown table, exit")
    args = p.parse_args()
    if args.table:
        print(table(args.out))
        return
    start_logging()
    work = args.work or Path(tempfile.mkdtemp(prefix="default-build-"))
    rows: list[dict] = []
    try:
        for name in args.corpora.split(","):
            rows.append(run_corpus(name, work))
            args.out.parent.mkdir(parents=True, exist_ok=True)  # after each set: a cut run keeps
            args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    logging.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
