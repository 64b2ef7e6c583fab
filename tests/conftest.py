"""Shared test configuration: `gpu` tests are skipped where CUDA is absent."""

from __future__ import annotations

import pytest


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


@pytest.fixture(scope="session", autouse=True)
def _isolated_session_home(tmp_path_factory: pytest.TempPathFactory):
    """The same home for session/module fixtures (e.g. ``make_tiny_model``), which run before
    the function-scoped fixture below could set it."""
    import os

    if "RAGSERVE_TEST_HOME" not in os.environ:
        os.environ["RAGSERVE_TEST_HOME"] = str(tmp_path_factory.getbasetemp() / "ragserve-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAGSERVE_HOME", os.environ["RAGSERVE_TEST_HOME"])
        yield


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Tests never write into the user's ~/.cache/ragserve unless they opt in.

    A session-wide home keeps expensive conversions (the built-in model) to one per run.
    """
    import os

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
