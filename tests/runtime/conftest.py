"""Session fixtures for runtime tests: a seeded tiny model and a small saved index."""

from __future__ import annotations

import pytest

COUNTRIES = [
    ("France", "Paris", "Europe"),
    ("Germany", "Berlin", "Europe"),
    ("Italy", "Rome", "Europe"),
    ("Spain", "Madrid", "Europe"),
    ("Japan", "Tokyo", "Asia"),
    ("India", "New Delhi", "Asia"),
    ("Kenya", "Nairobi", "Africa"),
    ("Egypt", "Cairo", "Africa"),
    ("Peru", "Lima", "South America"),
    ("Chile", "Santiago", "South America"),
    ("Canada", "Ottawa", "North America"),
    ("Mexico", "Mexico City", "North America"),
]


def small_corpus() -> list:
    from ragserve.retrieval import Document

    docs = []
    for name, capital, region in COUNTRIES:
        docs.append(Document(f"{name}-1", f"The capital of {name} is {capital}.", name))
        docs.append(Document(f"{name}-2", f"{name} is a country in {region}.", name))
    return docs


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from testing import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama", seed=0))


@pytest.fixture(scope="session")
def small_index(tmp_path_factory: pytest.TempPathFactory) -> str:
    from ragserve.retrieval import VectorIndex, load_embedder

    index = VectorIndex.build(small_corpus(), load_embedder("all-minilm-l6-v2"), nlist=4)
    out = tmp_path_factory.mktemp("indexes") / "small"
    index.save(out)
    index.close()
    return str(out)


@pytest.fixture(scope="session")
def local_server(tiny_model: str, small_index: str):
    """One in-process ``Server`` over the tiny model and the small index, shared by modules."""
    from ragserve.runtime import Server, ServerConfig

    # NOTE: prefix caching off: these tests compare the server's greedy text with a fresh
    # engine's; a prefix hit computes the same logits in another float order, and on a random
    # tiny model (near-tied logits) that can flip a token. Prefix-hit exactness is tested
    # against transformers in tests/generation.
    config = ServerConfig(
        in_process=True, engine_kwargs={"device": "cpu", "enable_prefix_caching": False}
    )
    with Server(tiny_model, small_index, config=config) as s:
        yield s


@pytest.fixture(scope="session")
def process_server(tiny_model: str, small_index: str):
    """One ``Server`` over worker processes (default config, CPU), shared by the modules that
    only use it: each leaves it as it found it (documents deleted, switches reset); a test
    that kills a worker checks it is back before it ends."""
    from ragserve.runtime import Server, ServerConfig

    config = ServerConfig(engine_kwargs={"device": "cpu"}, queue_size=4)
    with Server(tiny_model, small_index, config=config) as s:
        yield s
