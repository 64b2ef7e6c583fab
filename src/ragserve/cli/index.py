"""``ragserve index build|info|search``: build a vector index from a corpus, inspect, query."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ragserve.cli.errors import UsageError
from ragserve.cli.options import resolve_index

# NOTE: = retrieval.build.ENSEMBLE_EMBEDDER, not imported: that would load Faiss for every command.
ENSEMBLE_EMBEDDER = "multilingual-e5-small-q4"  # the side encoder measured (BENCHMARKS.md)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("index", help="build, inspect and query vector indexes")
    sub = p.add_subparsers(dest="index_command", required=True)
    modes = ["dense", "bm25", "hybrid", "ensemble"]

    b = sub.add_parser("build", help="embed a corpus into a Faiss IVF index")
    corpus = "a .jsonl or .parquet file, a folder of documents (.rst .md .html .pdf .txt), or "
    b.add_argument("--corpus", required=True, help=corpus + "'factbook'")
    b.add_argument("--out", help="index folder (default for factbook: the built-in location)")
    b.add_argument("--nlist", type=int, help="IVF clusters (default: ~4 sqrt(n))")
    b.add_argument("--nprobe", type=int, help="default clusters probed per query")
    b.add_argument("--kind", default="ivf_flat", choices=["ivf_flat", "ivf_sq8", "ivf_pq"])
    b.add_argument("--metric", default="ip", choices=["ip", "l2"])
    b.add_argument("--embedder", default="all-minilm-l6-v2", help="built-in name or HF folder")
    chunk = "text tokens per passage (default: the embedder's measured size); 0 = none"
    b.add_argument("--chunk-tokens", type=int, help=chunk)
    b.add_argument("--chunk-overlap", type=int, default=32, help="tokens repeated between passages")
    b.add_argument("--strict", action="store_true", help="fail on unsupported/unreadable files")
    no_bm25 = "build no BM25 index (dense only)"
    b.add_argument("--no-bm25", dest="enable_bm25", action="store_false", help=no_bm25)
    mode = "search mode when a query names none (default: ensemble if built, else dense)"
    b.add_argument("--default-mode", choices=modes, help=mode)
    b.add_argument(
        "--ensemble",
        nargs="?",
        const=ENSEMBLE_EMBEDDER,
        default="auto",
        metavar="EMBEDDER",
        help="also embed every passage with EMBEDDER for mode 'ensemble' (default, for a "
        "folder of documents: all-mpnet-base-v2 with ragserve[mpnet], else "
        f"{ENSEMBLE_EMBEDDER} with ragserve[e5])",
    )
    b.add_argument("--no-ensemble", dest="ensemble", action="store_const", const=None)
    header = "embed each passage with its heading path in front (path) or alone (none)"
    b.add_argument("--passage-header", default="path", choices=["path", "none"], help=header)
    boolean = argparse.BooleanOptionalAction
    one = "text searches return at most one passage per section by default"
    b.add_argument("--collapse-sections", action=boolean, default=True, help=one)
    b.add_argument(
        "--finetune",
        "--finetune-encoder",
        dest="finetune",
        action=boolean,
        help="fine-tune the encoder on the corpus's own (first sentence -> rest of passage) "
        "pairs, saved in OUT/encoder (default: on for a folder of >= 100 passages with the "
        "default embedder; minutes on a CPU)",
    )
    b.add_argument("--force", action="store_true", help="replace an existing index at --out")
    b.set_defaults(func=_build)

    folder = "index folder, or 'factbook' for the built-in one"
    i = sub.add_parser("info", help="print an index's manifest and statistics (JSON)")
    i.add_argument("dir", help=folder)
    i.set_defaults(func=_info)

    s = sub.add_parser("search", help="search an index with a text query")
    s.add_argument("dir", help=folder)
    s.add_argument("query", nargs="+", help="query text (several = several queries)")
    s.add_argument("-k", "--topk", type=int, default=5)
    s.add_argument("--nprobe", type=int)
    s.add_argument("--mode", choices=modes, help="default: the index's")
    flt = 'metadata filter as JSON, e.g. \'{"source": "faq.md", "year": {"gte": 2020}}\''
    s.add_argument("--filter", help=flt)
    one = "at most one passage per section (default: the index's)"
    s.add_argument("--collapse-sections", action=boolean, help=one)
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(func=_search)


def _build(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from ragserve.retrieval.build import BuildConfig, BuildError, build_index
    from ragserve.retrieval.builtin import builtin_index, builtin_index_dir

    start = time.perf_counter()
    if args.corpus == "factbook" and (args.out is None or Path(args.out) == builtin_index_dir()):
        out = builtin_index("factbook", progress=True)
        print(f"factbook index at {out} ({time.perf_counter() - start:.1f} s)")
        return 0
    if args.out is None:
        raise UsageError("--out is required for this corpus")
    try:
        # NOTE: each BuildConfig field is the `dest` of its flag
        config = BuildConfig(**{f.name: getattr(args, f.name) for f in fields(BuildConfig)})
        report = build_index(args.corpus, args.out, config, force=args.force, progress=True)
    except BuildError as exc:
        raise UsageError(str(exc)) from None
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


def _info(args: argparse.Namespace) -> int:
    from ragserve.retrieval import VectorIndex
    from ragserve.retrieval.storage import read_manifest

    directory = Path(resolve_index(args.dir))
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
        raise UsageError(f"--filter is not valid JSON ({exc.msg})") from None
    index = VectorIndex.load(resolve_index(args.dir))
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
        raise UsageError(str(exc)) from None
    finally:
        index.close()
    if args.json:
        fields = ("id", "title", "score", "text")
        rows = [
            [{**{f: getattr(h, f) for f in fields}, "metadata": h.document.metadata} for h in hits]
            for hits in results
        ]
        print(json.dumps(rows, indent=2))
        return 0
    for query, hits in zip(args.query, results, strict=True):
        print(f"query: {query}")
        for rank, hit in enumerate(hits, 1):
            snippet = hit.text if len(hit.text) <= 160 else hit.text[:157] + "..."
            print(f"  {rank}. [{hit.score:.3f}] {hit.title or hit.id}  ({hit.id})\n     {snippet}")
    return 0
