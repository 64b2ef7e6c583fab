"""``ragserve index build|info|search``: build a vector index from a corpus, inspect, query."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)
# NOTE: = retrieval.build.ENSEMBLE_EMBEDDER, not imported: that would load Faiss for every command.
ENSEMBLE_EMBEDDER = "multilingual-e5-small-q4"  # the side encoder measured (BENCHMARKS.md)
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
        choices=["dense", "bm25", "hybrid", "ensemble"],
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
        "--finetune",
        "--finetune-encoder",
        dest="finetune",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="corpus adaptation: fine-tune the encoder on the corpus's own (first sentence -> "
        "rest of passage) pairs (at most 1000, a seeded sample above) and save it in OUT/encoder. "
        "Default: on for a folder of at least 100 passages with the default embedder (held-out "
        "recall rose; BENCHMARKS.md), off otherwise; `index info` says which. It takes minutes "
        "on a CPU (an estimate and a progress bar are shown first); --no-finetune skips it",
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
        choices=["dense", "bm25", "hybrid", "ensemble"],
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
    from ragserve.retrieval.build import BuildError, build_index
    from ragserve.retrieval.builtin import builtin_index, builtin_index_dir

    start = time.perf_counter()
    if args.corpus == "factbook" and (args.out is None or Path(args.out) == builtin_index_dir()):
        out = builtin_index("factbook", progress=True)
        print(f"factbook index at {out} ({time.perf_counter() - start:.1f} s)")
        return 0
    if args.out is None:
        print("error: --out is required for this corpus", file=sys.stderr)
        return 2
    try:
        config = _build_config(args)
        report = build_index(args.corpus, args.out, config, force=args.force, progress=True)
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if report.skipped:
        print(f"warning: {report.skipped_summary}", file=sys.stderr)
    if report.num_files is not None:
        print(f"{report.num_ingested_files} of {report.num_files} files ingested")
    if report.empty:
        names = ", ".join(report.empty[:5]) + (", ..." if len(report.empty) > 5 else "")
        print(f"{len(report.empty)} file(s) without text: {names}")
    print(
        f"{report.num_passages} passages of <= {report.passage_window} tokens "
        f"(longest {report.max_passage_tokens}, {report.num_truncated} truncated)"
    )
    tuned = report.finetune
    print(f"encoder fine-tuning {'on' if tuned['enabled'] else 'off'} ({tuned['reason']})")
    if tuned["enabled"]:
        print(f"fine-tuned on {tuned['num_pairs']} pseudo-queries ({tuned['train_seconds']} s)")
    if report.ensemble:
        print(f"ensemble: {report.ensemble} beside the index's encoder")
    print(
        f"index at {report.out}: {report.num_passages} passages, nlist={report.nlist}, "
        f"{args.kind}/{args.metric}, default mode {report.default_mode} "
        f"({report.seconds['total']:.1f} s)"
    )
    return 0


def _build_config(args: argparse.Namespace):
    """`index build`'s flags as a `BuildConfig` (a bad combination: `BuildError`)."""
    from ragserve.retrieval.build import BuildConfig

    return BuildConfig(
        embedder=args.embedder,
        nlist=args.nlist,
        nprobe=args.nprobe,
        kind=args.kind,
        metric=args.metric,
        chunk_tokens=args.chunk_tokens,
        chunk_overlap=args.chunk_overlap,
        strict=args.strict,
        enable_bm25=not args.no_bm25,
        default_mode=args.default_mode,
        ensemble=args.ensemble,
        passage_header=args.passage_header,
        collapse_sections=args.collapse_sections,
        finetune=args.finetune,
    )


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
    from ragserve.retrieval.latency_model import measure_profile

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
