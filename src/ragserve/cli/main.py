"""``ragserve`` entry point: one sub-command per module in this package.

Each module named in ``COMMANDS`` defines ``register(subparsers)``, which adds its parser and
sets ``func`` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# NOTE: sub-command modules are imported only when the parser is built, and each module
# imports its heavy dependencies (torch, faiss) inside its handler, so `ragserve --help` is fast.
COMMANDS: tuple[str, ...] = ("index", "serve", "ask", "demo", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ragserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"ragserve.cli.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
