"""Session fixtures for the engine tests: tiny seeded models and their HF oracles."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def session_home() -> str:
    """The per-run ``$RAGSERVE_HOME`` (set for the session by the root conftest)."""
    return os.environ["RAGSERVE_HOME"]


@pytest.fixture(scope="session")
def tiny_models(session_home, tmp_path_factory: pytest.TempPathFactory):
    """arch -> folder of a seeded tiny model (llama, qwen2, qwen3)."""
    from testing import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def hf_oracles(tiny_models):
    """arch -> the ``transformers`` model loaded from the same folder (the oracle)."""
    from transformers import AutoModelForCausalLM

    models = {}
    for arch, path in tiny_models.items():
        model = AutoModelForCausalLM.from_pretrained(path).eval()
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
