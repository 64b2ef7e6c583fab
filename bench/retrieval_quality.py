"""Retrieval quality on real question sets: recall@1/5/10 and MRR@10 per mode and setting.

Corpora and questions:

- **pydocs**: the CPython 3.11 documentation sources (Debian package `python3.11-doc`,
  `/usr/share/doc/python3.11/html/_sources`: the FAQ and the tutorial; `--parts` adds more)
  and the FAQ's own questions, written by the documentation's authors. Each FAQ question is a
  section heading whose body answers it; the heading is replaced by a neutral "FAQ entry <n>"
  before ingest so that the question text is not in the corpus (a passage is relevant when it
  comes from the answer's section). Defaults were chosen on its `tune` half.
- **sqlalchemy**, **django**: the same construction over documentation never used for tuning:
  SQLAlchemy 1.4's FAQ + tutorial (reStructuredText, `python-sqlalchemy-doc`) and Django 3.2's
  FAQ + intro/tutorial (HTML pages, `python-django-doc`); every question is held out (`all`).
- **celery**, **scrapy** (session 7, held out the same way): Celery 5.2's FAQ + getting-started
  pages (reStructuredText sources, `python-celery-doc`) and Scrapy 2.8's FAQ + intro pages
  (HTML, `python-scrapy-doc`); their FAQ is one page (`faq.rst.txt`, `faq.html`).
- **factbook**: the built-in CIA World Factbook passages and the factbook questions ("What is
  the capital / are the languages / is the population / is the climate of <country>?"); the
  relevant passages are the country's section holding the answer (and its overview, which
  repeats the capital and population).

Questions are split in two halves by a hash of their text: defaults are picked on `tune`,
figures are reported on `test`. Settings: chunking (the previous default of 200-word windows over
raw files vs ingest + token-sized chunks), nprobe (the index default vs the previous nlist/4),
search mode (dense, bm25, hybrid) and section collapsing (on, the default, or off).

    apt-get install python3.11-doc python-sqlalchemy-doc python-django-doc \
        python-celery-doc python-scrapy-doc                                      # once
    .venv/bin/python bench/retrieval_quality.py [--corpora pydocs,sqlalchemy,django,factbook] \
        [--embedders all-minilm-l6-v2,multilingual-e5-small-q4] [--show tune] \
        [--cache DIR] [--out bench/results/retrieval_quality.json]
    .venv/bin/python bench/retrieval_quality.py --cost      # embedding time, embedders side by side

Issue 14's quality modes (session 5): `--modes dense,ensemble` picks the modes (prf: at e82677a),
`--ensemble multilingual-e5-small-q4` adds the second encoder to every index (rows per
`--ensemble-configs weight/bm25_weight/depth`), `--headers path,none` compares the embedded
passage header; rows record the embedding seconds (first run; a cached re-run reports the
recorded figure) and the mean query latency of each mode (ms per question, batched).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ragserve.retrieval import VectorIndex, load_embedder
from ragserve.retrieval.ensemble import EnsembleConfig
from ragserve.retrieval.index import passage_text
from ragserve.retrieval.ingest import ChunkConfig, Chunker, ingest_folder
from retrieval_corpora import (  # noqa: F401 - re-exported for the other scripts
    BLACK_DOCS,
    FACTBOOK_FORMS,
    FAQ_CORPORA,
    LARGE_PARTS,
    PYDOCS,
    PYDOCS_PARTS,
    FaqCorpus,
    Question,
    factbook,
    prepare_faq,
    pydocs_legacy,
    pydocs_new,
    split_of,
)

MODES = ("dense", "bm25", "hybrid")
K = 10


def start_logging() -> None:
    """The retrieval scripts' progress log: timestamped INFO lines, Faiss's loader quiet."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)


def add_study_args(p: argparse.ArgumentParser, configs: str, out: str) -> None:
    """The options the fine-tune studies share (``bench/retrieval_adapt.py`` at e82677a,
    ``bench/retrieval_finetune.py``)."""
    p.add_argument("--corpora", default="pydocs")
    p.add_argument("--configs", default=configs)
    p.add_argument("--modes", default="dense,ensemble")
    p.add_argument("--show", default="tune", choices=["tune", "test", "all"])
    p.add_argument("--cache", type=Path, default=None)
    p.add_argument("--out", type=Path, default=Path(out))
    p.add_argument("--table", action="store_true", help="print --out as a Markdown table, exit")


def split_table(path: Path, columns: dict[str, str], cells) -> str:
    """The ``"rows"`` of the JSON at ``path`` as a Markdown table: pydocs on its test half, the
    others on all questions (the split never used for a choice), tune-half R@5 alongside.
    ``columns`` maps the configuration's own headers to their alignment (``"---"`` /
    ``"---:"``); ``cells(row)`` gives their cells."""
    out = [
        "| corpus (split) | " + " | ".join(columns) + " | R@1 | R@5 | R@10 | MRR@10 | tune R@5 |",
        "|---|" + "|".join(columns.values()) + "|---:|---:|---:|---:|---:|",
    ]
    for r in json.loads(path.read_text())["rows"]:
        split = "test" if r["corpus"].startswith("pydocs") else "all"
        t = r[split]
        figures = [t["recall@1"], t["recall@5"], t["recall@10"], t["mrr@10"], r["tune"]["recall@5"]]
        out.append(f"| {r['corpus']} ({split}, {t['num_questions']}) | "
                   + " | ".join(cells(r)) + " | "
                   + " | ".join(f"{v:.3f}" for v in figures) + " |")  # fmt: skip
    return "\n".join(out)


# -- evaluation ------------------------------------------------------------------------------------


def evaluate(index: VectorIndex, questions: list[Question], mode: str, nprobe, collapse: bool):
    """recall@1/5/10 and MRR@10 per split ("all": every question, for the held-out corpora),
    and the search's wall time per question (`ms_per_query`, all questions in one batch)."""
    t0 = time.perf_counter()
    hits = index.search_text(
        [q.text for q in questions], K, nprobe=nprobe, mode=mode, collapse_sections=collapse
    )
    out: dict = {"ms_per_query": round(1000 * (time.perf_counter() - t0) / len(questions), 2)}
    for split in ("tune", "test", "all"):
        ranks = []
        for q, found in zip(questions, hits, strict=True):
            if split in ("all", q.split):
                rank = next((r for r, h in enumerate(found, 1) if h.id in q.relevant), None)
                ranks.append(rank)
        n = max(1, len(ranks))
        out[split] = {
            "num_questions": len(ranks),
            **{
                f"recall@{k}": round(sum(r is not None and r <= k for r in ranks) / n, 4)
                for k in (1, 5, 10)
            },  # fmt: skip
            "mrr@10": round(sum(1 / r for r in ranks if r is not None) / n, 4),
        }
    return out


class CachedPassages:
    """An embedder whose passage vectors are kept in `cache` (keyed by the exact texts), with
    the seconds their first embedding took, so that a re-run neither embeds again nor loses
    the cost figure. `seconds`: embedding time of the passages encoded through it."""

    def __init__(self, embedder, cache: Path | None) -> None:
        self.inner, self.cache, self.seconds = embedder, cache, 0.0
        self.name, self.dim = embedder.name, embedder.dim

    def encode(self, texts, *, is_query: bool, progress: bool = False) -> np.ndarray:
        if is_query or self.cache is None or not texts:
            t0 = time.perf_counter()
            out = self.inner.encode(texts, is_query=is_query)
            self.seconds += 0 if is_query else time.perf_counter() - t0
            return out
        key = hashlib.sha1(("\x00".join(texts) + "False").encode()).hexdigest()[:16]
        path = self.cache / self.inner.name / f"{key}.npy"
        if path.is_file():
            meta = path.with_suffix(".json")
            self.seconds += json.loads(meta.read_text())["seconds"] if meta.is_file() else 0
            return np.load(path)
        t0 = time.perf_counter()
        vectors = self.inner.encode(texts, is_query=False)
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, vectors)
        path.with_suffix(".json").write_text(json.dumps({"seconds": round(seconds, 1)}))
        return vectors


def build_index(docs, embedder, cache: Path | None, header: str = "path") -> VectorIndex:
    """`VectorIndex.from_vectors`, the passage vectors kept in `cache` (`CachedPassages`)."""
    cached = CachedPassages(embedder, cache)
    vectors = cached.encode([passage_text(d, header) for d in docs], is_query=False)
    index = VectorIndex.from_vectors(
        docs, vectors, embedder_name=embedder.name, embedder=embedder, passage_header=header
    )
    index.metadata["embed_seconds"] = round(cached.seconds, 1)
    return index


@dataclass(frozen=True)
class Methods:
    """What each index is searched with: `modes`, the ensemble's side encoder (None: no
    ensemble rows) and its fusion settings, the passage headers, collapsing on/off."""

    modes: tuple[str, ...] = MODES
    ensemble: str | None = None
    ensemble_configs: tuple[tuple[float, float, int], ...] = ((1.0, 0.2, 50),)
    headers: tuple[str, ...] = ("path",)
    collapses: tuple[bool, ...] = (True, False)
    old_nprobe: bool = True
    latency_queries: int = 0  # > 0: time each mode at batch 1 on this many questions


def run_setting(name: str, docs, questions, embedder, rows: list, *, cache=None, old_nprobe=True,
                show="test", methods: Methods = Methods(), **info):  # fmt: skip
    """One index over `docs` per passage header; every mode x collapse (x the previous nprobe
    default; x each ensemble setting); the log shows split `show` (`tune` while choosing
    defaults, so held-out figures stay unseen)."""
    for header in methods.headers:
        t0 = time.perf_counter()
        index = build_index(docs, embedder, cache, header)
        build_s = time.perf_counter() - t0
        index.bm25()
        side = None
        if methods.ensemble and "ensemble" in methods.modes:
            side = CachedPassages(load_embedder(methods.ensemble), cache)
            index.enable_ensemble(EnsembleConfig(methods.ensemble), embedder=side)
        label = name if header == "path" else f"{name} header {header}"
        nprobes = {"default": None}
        if old_nprobe and methods.old_nprobe:
            nprobes["nlist/4 (previous default)"] = max(1, index.nlist // 4)
        base = {"num_passages": index.num_documents, "nlist": index.nlist,
                "build_seconds": round(build_s, 1), "embedder": embedder.name,
                "passage_header": header, "embed_seconds": index.metadata["embed_seconds"],
                "side_embed_seconds": round(side.seconds, 1) if side else None, **info}  # fmt: skip
        for nprobe_name, nprobe in nprobes.items():
            for mode, config in _mode_runs(methods, side is not None):
                if config is not None:
                    index.metadata["ensemble"] = asdict(config)
                for collapse in methods.collapses:
                    if mode == "bm25" and nprobe is not None:
                        continue  # no probes in BM25
                    result = evaluate(index, questions, mode, nprobe, collapse)
                    shown = (
                        mode
                        if config is None
                        else (f"ensemble {config.weight:g}/{config.bm25_weight:g}/{config.depth}")
                    )
                    row = {"corpus_setting": label, "nprobe": nprobe or index.spec.nprobe,
                           "nprobe_setting": nprobe_name, "mode": shown,
                           "collapse_sections": collapse, **base, **result}  # fmt: skip
                    rows.append(row)
                    t = row[show]
                    logging.info(
                        "%-40s %-11s %-22s collapse %-5s %s R@1 %.3f R@5 %.3f R@10 %.3f "
                        "MRR %.3f (%d) %.1f ms/q",
                        label, nprobe_name[:11], shown, collapse, show, t["recall@1"],
                        t["recall@5"], t["recall@10"], t["mrr@10"], t["num_questions"],
                        result["ms_per_query"],
                    )  # fmt: skip
        if methods.latency_queries:
            ms = latency(index, questions, methods, side is not None)
            rows.append({"corpus_setting": label, "mode": "latency", **base,
                         "latency_ms_median_batch1": ms})  # fmt: skip
        index.close()


def latency(index: VectorIndex, questions, methods: Methods, has_side: bool, rounds: int = 3):
    """Median ms per query at batch 1 (collapse on) for each mode (the first ensemble
    setting), modes interleaved query by query over `rounds` passes of the first
    `methods.latency_queries` questions, so that load changes hit every mode alike."""
    runs = {}
    for mode, config in _mode_runs(methods, has_side):
        if mode not in runs:
            runs[mode] = config
    times: dict[str, list[float]] = {m: [] for m in runs}
    texts = [q.text for q in questions[: methods.latency_queries]]
    for _ in range(rounds):
        for text in texts:
            for mode, config in runs.items():
                if config is not None:
                    index.metadata["ensemble"] = asdict(config)
                t0 = time.perf_counter()
                index.search_text([text], K, mode=mode)
                times[mode].append(1000 * (time.perf_counter() - t0))
    out = {m: round(float(np.median(v)), 2) for m, v in times.items()}
    logging.info("latency (median ms/query, batch 1, %d x %d): %s", rounds, len(texts), out)
    return out


def _mode_runs(methods: Methods, has_side: bool):
    """(mode, EnsembleConfig or None) pairs: one per ensemble setting for mode "ensemble"."""
    for mode in methods.modes:
        if mode != "ensemble":
            yield mode, None
        elif has_side:
            for weight, bm25_weight, depth in methods.ensemble_configs:
                yield mode, EnsembleConfig(methods.ensemble, weight, bm25_weight, int(depth))


def table(path: Path, split: str = "test", corpora: str | None = None) -> str:
    """The results file as a Markdown table (`split`; tune R@5 alongside), optionally only the
    rows of `corpora` (comma-separated names)."""
    rows = [r for r in json.loads(path.read_text())["rows"] if r["mode"] != "latency"]
    timed = all("ms_per_query" in r for r in rows)
    if corpora:
        rows = [r for r in rows if r["corpus_setting"].split(" ")[0] in corpora.split(",")]
    out = [
        "| corpus / chunking | passages | nprobe | mode | collapse | R@1 | R@5 | R@10 | MRR@10 "
        "| tune R@5 |" + (" ms/query |" if timed else ""),
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|" + ("---:|" if timed else ""),
    ]
    for r in rows:
        t = r[split]
        probe = f"{r['nprobe']}/{r['nlist']}" + (
            " (old)" if "previous" in r["nprobe_setting"] else ""
        )
        if r["mode"] == "bm25":
            probe = "-"
        collapse = {True: "on", False: "off", None: "-"}[r.get("collapse_sections")]
        out.append(
            f"| {r['corpus_setting']} | {r['num_passages']} | {probe} | {r['mode']} | {collapse} | "
            f"{t['recall@1']:.3f} | {t['recall@5']:.3f} | {t['recall@10']:.3f} | "
            f"{t['mrr@10']:.3f} | {r['tune']['recall@5']:.3f} |"
            + (f" {r['ms_per_query']:.1f} |" if timed else "")
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpora", default="pydocs,factbook")
    p.add_argument(
        "--chunk-settings",
        default="none/32,none/0,128/16",
        help="max_tokens/overlap pairs for the token chunker (none = the embedder's window)",
    )
    p.add_argument("--no-legacy", action="store_true", help="skip pydocs' legacy 200-word windows")
    p.add_argument("--parts", default=",".join(PYDOCS_PARTS), help="pydocs folders to index")
    p.add_argument("--out", type=Path, default=Path("bench/results/retrieval_quality.json"))
    p.add_argument("--table", action="store_true", help="print --out as a Markdown table, exit")
    p.add_argument("--cache", type=Path, default=None, help="keep passage vectors here (re-runs)")
    p.add_argument("--split", default="test", choices=["tune", "test", "all"], help="for --table")
    p.add_argument("--embedders", default="all-minilm-l6-v2", help="comma-separated embedders")
    p.add_argument("--show", default="test", choices=["tune", "test", "all"], help="split to log")
    p.add_argument("--cost", action="store_true", help="time --embedders on pydocs passages")
    p.add_argument("--cost-passages", type=int, default=None, help="--cost: the first N only")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated search modes")
    p.add_argument("--ensemble", default=None, help="side encoder for mode ensemble")
    p.add_argument(
        "--ensemble-configs", default="1/0.2/50", help="weight/bm25_weight/depth, comma-separated"
    )
    p.add_argument("--headers", default="path", help="passage headers to compare: path,none")
    p.add_argument("--collapse", default="on,off", help="collapsing settings: on,off")
    p.add_argument("--no-old-nprobe", action="store_true", help="skip the nlist/4 rows")
    p.add_argument("--latency", type=int, default=0, help="time modes at batch 1 on N questions")
    args = p.parse_args()
    if args.table:
        print(table(args.out, args.split, args.corpora if "--corpora" in sys.argv else None))
        return
    start_logging()
    if args.cost:
        embedding_cost(args.embedders.split(","), args.parts.split(","), args.cost_passages)
        return
    rows: list[dict] = []

    def save() -> None:  # after every setting: a partial run keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"embedders": args.embedders.split(","), "pydocs_parts": args.parts.split(",")}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")

    args.methods = Methods(
        modes=tuple(args.modes.split(",")),
        ensemble=args.ensemble,
        ensemble_configs=tuple(
            tuple(float(v) for v in c.split("/")) for c in args.ensemble_configs.split(",")
        ),
        headers=tuple(args.headers.split(",")),
        collapses=tuple({"on": True, "off": False}[c] for c in args.collapse.split(",")),
        old_nprobe=not args.no_old_nprobe,
        latency_queries=args.latency,
    )
    for name in args.embedders.split(","):
        run_embedder(args, load_embedder(name), rows, save)
    logging.info("wrote %s", args.out)


def run_embedder(args, embedder, rows: list, save) -> None:
    """Every corpus x chunk setting for one embedder (rows labelled with its name unless it
    is the default MiniLM, whose labels stay as in the earlier result files)."""
    label = "" if embedder.name == "all-minilm-l6-v2" else f" {embedder.name}"
    for corpus in args.corpora.split(","):
        if corpus == "factbook":
            docs, questions = factbook()
            run_setting(f"factbook{label}", docs, questions, embedder, rows, cache=args.cache,
                        show=args.show, methods=args.methods,
                        chunking="factbook passages")  # fmt: skip
            save()
            continue
        if corpus not in FAQ_CORPORA:
            raise SystemExit(f"unknown corpus {corpus!r}: factbook, {', '.join(FAQ_CORPORA)}")
        is_pydocs = corpus == "pydocs"
        work = Path(tempfile.mkdtemp(prefix=f"{corpus}-"))
        try:
            parts = args.parts.split(",") if is_pydocs else None
            hidden = prepare_faq(FAQ_CORPORA[corpus], work, parts)
            for setting in args.chunk_settings.split(","):
                size, overlap = setting.split("/")
                config = ChunkConfig(None if size == "none" else int(size), int(overlap))
                chunker = Chunker(embedder.tokenizer, embedder.passage_window, config)
                docs, questions = pydocs_new(work, hidden, chunker)
                run_setting(f"{corpus}{label} ingest tokens {size}/{overlap}", docs, questions,
                            embedder, rows, cache=args.cache, old_nprobe=is_pydocs,
                            show=args.show, methods=args.methods,
                            chunking=f"ingest, max_tokens {size}, overlap {overlap}",
                            max_passage_tokens=chunker.stats.max_passage_tokens,
                            num_truncated=chunker.stats.num_truncated)  # fmt: skip
                save()
            if is_pydocs and not args.no_legacy:
                docs, questions = pydocs_legacy(work, hidden)
                run_setting(f"pydocs{label} legacy 200 words/40", docs, questions, embedder,
                            rows, cache=args.cache, show=args.show, methods=args.methods,
                            chunking="words 200/40 over raw files")  # fmt: skip
                save()
        finally:
            shutil.rmtree(work, ignore_errors=True)


QUERY_COST = 50  # single-query encodes timed per embedder and round by `--cost`


def embedding_cost(names: list[str], parts: list[str], limit=None, rounds: int = 2) -> None:
    """Seconds to embed the same texts (pydocs passages cut for MiniLM's 256-token window, so
    that every embedder sees them whole) with each embedder, interleaved `rounds` times; logs
    the median per embedder and its ratio to the first."""
    embedders = [load_embedder(n) for n in names]
    work = Path(tempfile.mkdtemp(prefix="cost-"))
    try:
        prepare_faq(FAQ_CORPORA["pydocs"], work, parts)
        base = load_embedder("all-minilm-l6-v2")
        chunker = Chunker(base.tokenizer, base.passage_window, ChunkConfig(None, 32))
        texts = [passage_text(d) for d in chunker.chunk_all(ingest_folder(work / "docs"))]
        texts = texts[:limit]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds: dict[str, list[float]] = {e.name: [] for e in embedders}
    query_ms: dict[str, list[float]] = {e.name: [] for e in embedders}
    queries = [t.split(": ", 1)[-1][:80] for t in texts[:QUERY_COST]]  # question-sized texts
    for _ in range(rounds):
        for e in embedders:
            t0 = time.perf_counter()
            e.encode(texts, is_query=False)
            seconds[e.name].append(time.perf_counter() - t0)
            for q in queries:  # one query at a time, as a search does
                t0 = time.perf_counter()
                e.encode([q], is_query=True)
                query_ms[e.name].append((time.perf_counter() - t0) * 1e3)
    first = float(np.median(seconds[embedders[0].name]))
    for name, values in seconds.items():
        median = float(np.median(values))
        logging.info("%-28s %d passages: median %.1f s over %d rounds (%s), x%.2f of %s; "
                     "one query: median %.1f ms", name, len(texts), median, rounds,
                     ", ".join(f"{v:.1f}" for v in values), median / first, embedders[0].name,
                     float(np.median(query_ms[name])))  # fmt: skip


if __name__ == "__main__":
    main()
