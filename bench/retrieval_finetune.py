"""Corpus adaptation by fine-tuning MiniLM itself (issue 14; `retrieval/finetune.py`, the
`index build --finetune-encoder` option): the encoder trained on the corpus's own (first
sentence -> rest of the passage) pairs with in-batch negatives, every passage re-embedded,
dense and ensemble recall measured.

Same corpora, questions, splits and passages as `retrieval_quality.py`; the evaluation
questions never enter training. Choose on `--show tune` (pydocs) only.

    .venv/bin/python bench/retrieval_finetune.py --corpora pydocs --show tune \
        --configs 1/2e-5/16 --cache /tmp/q14/bcache --out FILE
    (each config: epochs/lr/batch[/max_pairs]; "none": the unadapted encoder)
    --keep-encoders DIR saves each tuned encoder (and reuses a saved one: re-evaluations need
    no training); --ensemble-configs W/B/D,... adds ensemble rows per fusion setting.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from ragserve.retrieval import load_embedder
from ragserve.retrieval.ensemble import EnsembleConfig
from ragserve.retrieval.finetune import (
    FinetuneConfig,
    finetune_embedder,
    pseudo_pairs,
    sample_pairs,
    save_embedder,
)
from ragserve.retrieval.index import passage_text
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


def tuned_encoder(base, docs, config: str, keep: Path | None, name: str):
    """`base` fine-tuned with `config` (epochs/lr/batch) on `docs`, and the training seconds;
    with `keep`, the encoder is saved under `keep` and a saved one is loaded instead (its
    recorded training seconds reported)."""
    folder = keep / f"{name}-{config.replace('/', '_')}" if keep else None
    if folder is not None and (folder / "train.json").is_file():
        return load_embedder(str(folder)), json.loads((folder / "train.json").read_text())["s"]
    t0 = time.perf_counter()
    embedder, _ = finetune_embedder(base, docs, parse_config(config))
    train_s = time.perf_counter() - t0
    if folder is not None:
        save_embedder(embedder, folder)
        (folder / "train.json").write_text(json.dumps({"s": round(train_s, 1)}))
    return embedder, train_s


def parse_config(config: str) -> FinetuneConfig:
    """``epochs/lr/batch[/max_pairs]`` as a `FinetuneConfig` (an empty max_pairs: every pair),
    e.g. ``1/2e-5/16/1000`` (grouped batches, ``.../source``: reproduce at e82677a)."""
    epochs, lr, batch, *rest = config.split("/")
    cap = rest[0] if rest else ""
    return FinetuneConfig(
        int(epochs),
        float(lr),
        int(batch),
        max_pairs=int(cap) if cap else None,
    )


SIDE = "multilingual-e5-small-q4"  # the ensemble's side encoder unless --side names another


def ensemble_runs(modes, ensemble_configs: str, side: str = SIDE):
    """(row label, mode, EnsembleConfig or None): the default ensemble is labelled
    `ensemble`, other weight/bm25_weight/depth settings `ensemble W/B/D`."""
    for mode in modes:
        if mode != "ensemble":
            yield mode, mode, None
            continue
        for c in ensemble_configs.split(","):
            weight, bm25_weight, depth = c.split("/")
            config = EnsembleConfig(side, float(weight), float(bm25_weight), int(depth))
            default = config == EnsembleConfig()
            yield ("ensemble" if default else f"ensemble {c}"), mode, config


def faq_corpus(name: str, base) -> tuple[list, list]:
    """``(passages, questions)`` of FAQ corpus ``name``: its question headings hidden, chunked
    to fill ``base``'s window with a 32-token overlap, as every run here does."""
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        hidden = prepare_faq(FAQ_CORPORA[name], work)
        chunker = Chunker(base.tokenizer, base.passage_window, ChunkConfig(None, 32))
        return pydocs_new(work, hidden, chunker)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_corpus(name: str, configs: list[str], modes, cache, show: str, rows: list,
               keep: Path | None = None, ensemble_configs: str = "1/0.2/50",
               side_name: str = SIDE) -> None:  # fmt: skip
    base = load_embedder("all-minilm-l6-v2")
    docs, questions = faq_corpus(name, base)
    pairs = pseudo_pairs(docs)
    for config in configs:
        if config == "none":
            embedder, train_s, trained = base, 0.0, 0
        else:
            embedder, train_s = tuned_encoder(base, docs, config, keep, name)
            trained = len(sample_pairs(pairs, parse_config(config)))
        t0 = time.perf_counter()
        index = build_index(docs, embedder, cache if config == "none" else None)
        embed_s = time.perf_counter() - t0
        if "ensemble" in modes:
            side = CachedPassages(load_embedder(side_name), cache)
            index.enable_ensemble(EnsembleConfig(side_name), embedder=side)
        index.bm25()
        for label, mode, ensemble in ensemble_runs(modes, ensemble_configs, side_name):
            if ensemble is not None:
                index.metadata["ensemble"] = asdict(ensemble)
            result = evaluate(index, questions, mode, None, True)
            if ensemble is not None and side_name != SIDE:
                label = f"{label} side {side_name}"
            rows.append({"corpus": name, "finetune": config, "mode": label,
                         "num_passages": len(docs), "num_pairs": len(pairs),
                         "trained_pairs": trained, "train_seconds": round(train_s, 1),
                         "reembed_seconds": round(embed_s, 1), **result})  # fmt: skip
            t = result[show]
            logging.info("%-10s finetune %-12s %-8s %s R@1 %.3f R@5 %.3f R@10 %.3f MRR %.3f "
                         "(%d) pairs %d train %.0f s re-embed %.0f s", name, config, label, show,
                         t["recall@1"], t["recall@5"], t["recall@10"], t["mrr@10"],
                         t["num_questions"], len(pairs), train_s, embed_s)  # fmt: skip
        index.close()


def build_cost(sizes: list[int], out: Path) -> None:
    """Build-time cost vs corpus size: for the first N pydocs passages (N in `sizes`), the
    seconds to fine-tune on their pairs and to embed them once with the base encoder, side by
    side in one process (so both see the same load); rows written to `out`."""
    base = load_embedder("all-minilm-l6-v2")
    docs, _ = faq_corpus("pydocs", base)
    rows = []
    for n in sizes:
        subset = docs[:n]
        t0 = time.perf_counter()
        base.encode([passage_text(d) for d in subset], is_query=False)
        embed_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, num_pairs = finetune_embedder(base, subset, FinetuneConfig())
        train_s = time.perf_counter() - t0
        rows.append({"num_passages": len(subset), "num_pairs": num_pairs,
                     "embed_seconds": round(embed_s, 1),
                     "train_seconds": round(train_s, 1)})  # fmt: skip
        logging.info("%d passages, %d pairs: embed %.1f s, fine-tune %.1f s (x%.1f)", len(subset),
                     num_pairs, embed_s, train_s, train_s / embed_s)  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")


def table(path: Path) -> str:
    """`--out` as a Markdown table (`retrieval_quality.split_table`)."""
    columns = {"fine-tune": "---", "mode": "---", "train s": "---:"}
    return split_table(
        path, columns, lambda r: [r["finetune"], r["mode"], f"{r['train_seconds']:.0f}"]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_study_args(p, "none,1/2e-5/16", "bench/results/retrieval_finetune.json")
    p.add_argument("--keep-encoders", type=Path, default=None, help="save/reuse tuned encoders")
    p.add_argument("--ensemble-configs", default="1/0.2/50", help="weight/bm25_weight/depth,...")
    p.add_argument("--side", default=SIDE, help="the ensemble's side encoder")
    p.add_argument("--cost", default=None, help="N1,N2,...: build cost on the first N passages")
    args = p.parse_args()
    if args.table:
        print(table(args.out))
        return
    start_logging()
    if args.cost:
        build_cost([int(n) for n in args.cost.split(",")], args.out)
        return
    rows: list[dict] = []
    for name in args.corpora.split(","):
        run_corpus(name, args.configs.split(","), args.modes.split(","), args.cache, args.show,
                   rows, args.keep_encoders, args.ensemble_configs, args.side)  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    logging.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
