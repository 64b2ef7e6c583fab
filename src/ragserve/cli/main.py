"""``ragserve`` entry point: each module in ``COMMANDS`` has ``register(subparsers)``, which
adds its parser and sets ``func`` (namespace -> exit code). An error a user can cause ends the
command with one ``error: ...`` line (exit code 1, 2 for usage errors); ``-v`` adds the
traceback and debug logging."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

from ragserve.cli.errors import UsageError

# NOTE: sub-command modules are imported only when the parser is built, and each module
# imports its heavy dependencies (torch, faiss) inside its handler, so `ragserve --help` is fast.
COMMANDS: tuple[str, ...] = ("index", "serve", "ask", "demo", "bench", "setup", "profile_memory")
# Third-party loggers that report progress or load details at INFO: quiet unless -v.
_QUIET_LOGGERS = ("faiss", "faiss.loader", "httpx", "urllib3", "transformers", "torch", "bm25s")


class Parser(argparse.ArgumentParser):
    """Every ``ragserve`` parser (sub-commands inherit it): no prefix matching of long flags
    (``--api-key`` is not ``--api-key-file``); a usage error is one ``error:`` line (exit 2)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = Parser(prog="ragserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks")
    parser.add_argument("--version", action="version", version=f"ragserve {version('ragserve')}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"ragserve.cli.{name}").register(subparsers)
    return parser


def configure_logging(verbose: bool) -> None:
    """INFO from ragserve, WARNING from everyone else; third-party progress bars off unless
    ``verbose`` (set before transformers is imported; the workers inherit it)."""
    if not verbose:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if "transformers" in sys.modules:  # imported already (main() called from Python)
            sys.modules["transformers"].utils.logging.disable_progress_bar()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("ragserve").setLevel(logging.DEBUG if verbose else logging.INFO)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.verbose:
            logging.getLogger("ragserve.cli").exception("%s failed", args.command)
        expected = isinstance(exc, (ValueError, KeyError, OSError, RuntimeError, ImportError))
        hint = "" if expected or args.verbose else " (run with -v for the traceback)"
        print(f"error: {one_line(exc)}{hint}", file=sys.stderr)
        return 2 if isinstance(exc, UsageError) else 1


def one_line(exc: BaseException) -> str:
    """The error as one line: for a worker's start failure, the last line of its traceback
    (``ModelLoadError: ...``); a ``KeyError``'s message without the quotes."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) < 2:
        return lines[0] if lines else type(exc).__name__
    return f"{lines[0].rstrip(':')}: {lines[-1]}"


if __name__ == "__main__":
    sys.exit(main())
