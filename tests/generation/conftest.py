"""Session fixtures for the engine tests: tiny seeded models and their HF oracles."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def session_home() -> str:
    """The per-run ``$RAGSERVE_HOME`` (set for the session by the root conftest)."""
    return os.environ["RAGSERVE_HOME"]


ARCHS = ("llama", "qwen2", "qwen3")


class _TinyModels(dict):
    """arch -> folder of a seeded tiny model, written on first use (a worker whose tests use
    only llama writes only llama)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, arch: str):
        from testing import make_tiny_model

        self[arch] = make_tiny_model(self.root / arch, arch)
        return self[arch]


@pytest.fixture(scope="session")
def tiny_models(session_home, tmp_path_factory: pytest.TempPathFactory):
    """arch -> folder of a seeded tiny model (llama, qwen2, qwen3)."""
    return _TinyModels(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def hf_oracles(tiny_models):
    """arch -> the ``transformers`` model loaded from the same folder (the oracle)."""
    from transformers import AutoModelForCausalLM

    models = {}
    for arch in ARCHS:
        model = AutoModelForCausalLM.from_pretrained(tiny_models[arch]).eval()
        model.generation_config.eos_token_id = None  # compare fixed-length greedy runs
        models[arch] = model
    return models


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine
    OpenMP barriers make them many times slower; restored after each test."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
