"""``ragserve bench``: the RAG co-scheduling benchmark (``bench/rag_bench.py``).

The harness lives in the repository's ``bench/`` folder (next to the other benchmarks), so
this command needs a source checkout (``pip install -e .``); its flags are the script's.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"


def _harness():
    if not (BENCH_DIR / "rag_bench.py").is_file():
        return None
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module("rag_bench")


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
    print(
        f"ragserve bench needs the source checkout's bench/ folder ({BENCH_DIR})", file=sys.stderr
    )
    return 2
