"""Fine-tuning the encoder on the corpus (`finetune.py`) and `index build --finetune-encoder`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ragserve.cli.main import main
from ragserve.retrieval import Document, load_embedder
from ragserve.retrieval.finetune import FinetuneConfig, finetune_embedder, save_embedder

TEXTS = [
    "Paris is the capital and largest city of France. It lies on the river Seine.",
    "The Nile is a major river of Africa. It flows north into the Mediterranean Sea.",
    "Tea is an aromatic drink made from leaves. It is popular in many countries.",
    "Python is a programming language for scripts. It is used for data analysis too.",
    "The Moon orbits the Earth once a month. Its phases follow the orbit.",
    "Bread is baked from flour and water. Yeast makes the dough rise.",
]
QUERIES = ["Which river flows into the sea?", "What makes dough rise?"]
FAST = FinetuneConfig(epochs=1, lr=1e-4, batch_size=3)


@pytest.fixture(scope="module")
def base():
    return load_embedder("all-minilm-l6-v2")


def docs() -> list[Document]:
    return [Document(f"d{i}", t, f"Doc {i}", {}) for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def tuned(base):
    return finetune_embedder(base, docs(), FAST)[0]


def test_finetune_is_deterministic_leaves_the_base_and_the_rng_alone(base, tuned):
    before = base.encode(QUERIES, is_query=True)
    rng_state = torch.random.get_rng_state()
    b, num_pairs = finetune_embedder(base, docs(), FAST)
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    a = tuned
    assert num_pairs == len(TEXTS)
    np.testing.assert_array_equal(base.encode(QUERIES, is_query=True), before)
    qa, qb = a.encode(QUERIES, is_query=True), b.encode(QUERIES, is_query=True)
    np.testing.assert_array_equal(qa, qb)
    assert np.abs(qa - before).max() > 1e-4  # it trained
    np.testing.assert_allclose(np.linalg.norm(qa, axis=1), 1.0, atol=1e-5)


def test_saved_encoder_loads_back_equal(tuned, tmp_path):
    path = save_embedder(tuned, tmp_path / "encoder")
    loaded = load_embedder(str(path))
    assert loaded.max_length == tuned.max_length and loaded.pooling == tuned.pooling
    np.testing.assert_allclose(
        loaded.encode(TEXTS, is_query=False), tuned.encode(TEXTS, is_query=False), atol=1e-5
    )


def test_bad_inputs_say_what_is_wrong(base):
    with pytest.raises(ValueError, match="finetune epochs"):
        FinetuneConfig(batch_size=1)
    with pytest.raises(ValueError, match="no pseudo-queries"):
        finetune_embedder(base, [Document("a", "Too short.", "", {})], FAST)


def test_build_with_finetune_encoder_and_a_damaged_encoder(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(
        "\n".join(json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(TEXTS))
    )
    out = tmp_path / "idx"
    args = ["index", "build", "--corpus", str(corpus), "--out", str(out), "--finetune-encoder"]
    assert main(args) == 0
    assert f"fine-tuned on {len(TEXTS)} pseudo-queries" in capsys.readouterr().out
    assert main(["index", "info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["live"]["embedder"] == str((out / "encoder").absolute())
    assert main(["index", "search", str(out), "Which river flows into the sea?", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0][0]["id"] == "d1"
    (out / "encoder" / "config.json").unlink()
    assert main(["index", "search", str(out), "river"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "encoder" in err and "\n" not in err
