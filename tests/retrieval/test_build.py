"""`build_index` (retrieval/build.py): the folder build in Python with the CLI's defaults, and
an index it replaces kept whole until the new one is saved."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ragserve.cli.main import main
from ragserve.retrieval import BuildConfig, BuildError, VectorIndex, build_index, persist
from ragserve.retrieval import finetune as finetune_module
from ragserve.retrieval.passages import passage_text

DOCS = Path(__file__).parent / "fixtures" / "docs"
QUESTION = "how do I install with pip?"
DENSE = BuildConfig(ensemble=None)  # the side encoder's own tests are elsewhere (test_ensemble)


def _clean_docs(tmp_path: Path) -> Path:
    corpus = tmp_path / "docs"
    shutil.copytree(DOCS, corpus, ignore=shutil.ignore_patterns("broken.txt", "slides.pptx"))
    return corpus


def _ids(directory: Path, query: str = QUESTION) -> list[str]:
    index = VectorIndex.load(directory)
    try:
        return [h.id for h in index.search_text([query], 3)[0]]
    finally:
        index.close()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_a_folder_build_in_python_reports_what_it_did_and_records_the_defaults(tmp_path):
    out = tmp_path / "idx"
    report = build_index(DOCS, out, DENSE)
    assert report.out == out.absolute()
    assert (report.num_files, report.num_ingested_files) == (7, 5)
    assert sorted(name for name, _ in report.skipped) == ["broken.txt", "slides.pptx"]
    assert report.skipped_summary.startswith("2 file(s) skipped: broken.txt")
    assert 0 < report.max_passage_tokens <= report.passage_window and report.num_truncated == 0
    reason = f"default: off below 100 passages ({report.num_passages})"
    assert report.finetune == {"enabled": False, "reason": reason}
    assert report.default_mode == "dense" and report.ensemble is None
    index = VectorIndex.load(out)
    info = index.info()
    assert info["default_mode"] == "dense" and info["collapse_sections"] is True
    assert info["finetune_encoder"] == report.finetune and info["has_bm25"]
    hits = index.search_text([QUESTION], 3)[0]
    assert hits[0].document.metadata["source"] == "guide/install.md"
    assert all(h.document.metadata["section"] for h in hits)
    index.close()
    assert _leftovers(tmp_path) == []


def test_python_and_cli_builds_are_the_same_index(tmp_path, capsys):
    corpus = _clean_docs(tmp_path)
    (corpus / "toc.rst").write_text(".. toctree::\n\n   tutorial\n   guide/install\n")
    assert build_index(corpus, tmp_path / "py", DENSE).empty == ["toc.rst"]
    args = ["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "cli")]
    assert main([*args, "--no-ensemble"]) == 0
    out = capsys.readouterr().out
    assert "5 of 6 files ingested" in out and "1 file(s) without text: toc.rst" in out
    a, b = VectorIndex.load(tmp_path / "py"), VectorIndex.load(tmp_path / "cli")
    queries = [QUESTION, "What does the tutorial cover?", "report figures"]
    found_a, found_b = a.search_text(queries, 3), b.search_text(queries, 3)
    assert [[h.id for h in r] for r in found_a] == [[h.id for h in r] for r in found_b]
    assert a.num_documents == b.num_documents and a.metadata == b.metadata
    a.close()
    b.close()


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "idx"
    with pytest.raises(FileNotFoundError, match="no corpus at"):
        build_index(tmp_path / "missing", out)
    with pytest.raises(BuildError, match=r"2 file\(s\)"):
        build_index(DOCS, out, BuildConfig(strict=True, ensemble=None))
    with pytest.raises(BuildError, match="embedder: unknown name"):
        build_index(DOCS, out, BuildConfig(embedder="no-such-model"))
    with pytest.raises(BuildError, match="needs the BM25 index"):
        BuildConfig(enable_bm25=False, default_mode="hybrid")
    with pytest.raises(BuildError, match="kind must be one of"):
        BuildConfig(kind="hnsw")
    with pytest.raises(BuildError, match="needs a side encoder"):
        build_index(DOCS, out, BuildConfig(ensemble=None, default_mode="ensemble"))
    with pytest.raises(BuildError, match="needs a .jsonl/.parquet corpus"):
        build_index(DOCS, out, BuildConfig(chunk_tokens=0, ensemble=None))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BuildError, match="no documents in"):
        build_index(empty, out, DENSE)
    assert not out.exists()
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("not an index")
    with pytest.raises(BuildError, match="is not empty"):
        build_index(DOCS, other, DENSE, force=True)  # force replaces indexes only
    assert (other / "notes.txt").read_text() == "not an index"
    assert _leftovers(tmp_path) == []


def test_force_replaces_an_index_only_once_the_new_one_is_saved(tmp_path, monkeypatch):
    corpus = _clean_docs(tmp_path)
    out = tmp_path / "idx"
    build_index(corpus, out, DENSE)
    before = _ids(out)
    manifest = (out / "manifest.json").read_text()
    with pytest.raises(BuildError, match="is not empty"):
        build_index(corpus, out, DENSE)  # without force
    with pytest.raises(FileNotFoundError):
        build_index(tmp_path / "typo", out, DENSE, force=True)
    with pytest.raises(BuildError):
        build_index(corpus, out, BuildConfig(embedder="no-such-model"), force=True)

    monkeypatch.setattr(persist, "write_manifest", _disk_full)  # after the new snapshot's write
    with pytest.raises(OSError, match="No space left"):
        build_index(corpus, out, DENSE, force=True)
    assert (out / "manifest.json").read_text() == manifest and _ids(out) == before
    assert _leftovers(tmp_path) == []
    monkeypatch.undo()
    (corpus / "guide" / "install.md").unlink()
    report = build_index(corpus, out, DENSE, force=True)
    assert "guide/install.md" not in {
        h.document.metadata["source"]
        for h in VectorIndex.load(out).search_text([QUESTION], report.num_passages)[0]
    }
    assert json.loads((out / "manifest.json").read_text()) != json.loads(manifest)
    assert _leftovers(tmp_path) == []


def _disk_full(*args, **kwargs):
    raise OSError(28, "No space left on device")


@pytest.mark.slow  # a training run, to fail after it
def test_a_failed_tuned_encoder_write_keeps_the_index_it_would_replace(tmp_path, monkeypatch):
    corpus = _clean_docs(tmp_path)
    out = tmp_path / "idx"
    build_index(corpus, out, DENSE)
    before, manifest = _ids(out), (out / "manifest.json").read_text()
    monkeypatch.setattr(finetune_module, "save_embedder", _disk_full)  # after the index's write
    with pytest.raises(OSError, match="No space left"):
        build_index(corpus, out, BuildConfig(ensemble=None, finetune=True), force=True)
    assert (out / "manifest.json").read_text() == manifest and _ids(out) == before
    assert _leftovers(tmp_path) == []


def test_a_tuned_build_saves_its_encoder_and_embedded_with_what_queries_use(tmp_path, capsys):
    """The stored passage vectors equal the reloaded index's encoder on the same passages (the
    tuned copy returns to the base's dtype before it embeds anything); without `progress` the
    build draws no estimate or bar."""
    out = tmp_path / "idx"
    config = BuildConfig(ensemble=None, finetune=True)
    capsys.readouterr()
    report = build_index(_clean_docs(tmp_path), out, config)
    assert "fine-tuning" not in capsys.readouterr().err
    assert report.finetune["enabled"] and report.finetune["reason"] == "--finetune"
    assert report.finetune["num_pairs"] > 0 and (out / "encoder" / "config.json").is_file()
    index = VectorIndex.load(out)
    assert index.embedder_name == str(out.absolute() / "encoder")
    rows, stored = index._store.vectors()
    docs = index._store.get(rows.tolist())
    again = index.embedder.encode([passage_text(d) for d in docs], is_query=False)
    index.close()
    assert len(docs) == report.num_passages
    np.testing.assert_allclose(again, stored, atol=1e-5)
