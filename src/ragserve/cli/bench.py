"""``ragserve bench``: the RAG co-scheduling benchmark, ``rag_bench.py`` of the repository's
``bench/`` (which a wheel does not ship), found in ``$RAGSERVE_BENCH_DIR``, the source
checkout or ``./bench``; its flags are the script's."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from ragserve.cli.errors import UsageError

BENCH_DIR_ENV = "RAGSERVE_BENCH_DIR"
CHECKOUT_BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def _harness():
    """``rag_bench`` of the first folder holding it, or ``None``."""
    candidates = [os.environ.get(BENCH_DIR_ENV), CHECKOUT_BENCH_DIR, Path.cwd() / "bench"]
    for folder in candidates:
        if folder and (Path(folder) / "rag_bench.py").is_file():
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
            return importlib.import_module("rag_bench")
    return None


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="RAG co-scheduling benchmark (sequential / async / ragserve + ablations)",
        description="Poisson arrivals over the built-in workflows; JSON results and "
        "latency-vs-rate plots in --out. Presets: smoke, cpu-small, h200.",
    )
    harness = _harness()
    if harness is None:
        p.set_defaults(func=_missing)
        return
    harness.build_parser(p)
    p.set_defaults(func=harness.run)


def _missing(args: argparse.Namespace) -> int:
    raise UsageError(
        "ragserve bench runs the harness in the source repository's bench/ folder, which the "
        "installed package does not include: run it from a checkout (git clone ...; "
        f"pip install -e '.[dev]'), or set {BENCH_DIR_ENV} to that folder; it also needs "
        "matplotlib (the [dev] extra)"
    )
