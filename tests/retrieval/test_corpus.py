"""Corpus records (JSONL, Parquet), the factbook passages, and ``bench/window_chunks.py``'s
raw folder and word/token windows (the previous default passages)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ragserve.retrieval import Document, load_corpus
from ragserve.retrieval.factbook import factbook_documents


@pytest.fixture(scope="module")
def windows(bench_module):
    return bench_module("window_chunks")


def test_jsonl_records(tmp_path):
    path = tmp_path / "c.jsonl"
    rows = [
        {"id": "a", "text": "alpha", "title": "A", "lang": "en"},
        {"text": "no id", "metadata": {"k": 1}},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(load_corpus(path)) == [
        Document("a", "alpha", "A", {"lang": "en"}),
        Document("c:2", "no id", None, {"k": 1}),
    ]


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "a", "text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        list(load_corpus(path))
    path.write_text('{"id": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*'text'"):
        list(load_corpus(path))


def test_folder_and_parquet(tmp_path, windows):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("# Heading A\nbody a\n")
    (tmp_path / "docs" / "sub" / "b.txt").write_text("plain b\n")
    (tmp_path / "docs" / "skip.bin").write_text("ignored")
    got = list(windows.raw_folder(tmp_path / "docs"))
    assert [(d.id, d.title) for d in got] == [("a.md", "Heading A"), ("sub/b.txt", "b")]
    table = pa.table({"id": ["x", "y"], "text": ["tx", "ty"], "year": [2020, 2021]})
    pq.write_table(table, tmp_path / "c.parquet")
    got = list(load_corpus(tmp_path / "c.parquet"))
    assert got == [
        Document("x", "tx", None, {"year": 2020}),
        Document("y", "ty", None, {"year": 2021}),
    ]
    with pytest.raises(ValueError, match="unsupported corpus"):
        list(load_corpus(tmp_path / "docs" / "skip.bin"))


def test_word_chunks_overlap_and_cover_everything(windows):
    chunk_documents = windows.chunk_documents
    text = " ".join(f"w{i}" for i in range(25))
    chunks = list(chunk_documents([Document("d", text, "T", {"m": 1})], size=10, overlap=3))
    words = [c.text.split() for c in chunks]
    assert [c.id for c in chunks] == ["d#0", "d#1", "d#2", "d#3"]
    assert words[0] == [f"w{i}" for i in range(10)]
    assert words[1][:3] == words[0][-3:]  # overlap
    assert words[-1][-1] == "w24"
    assert chunks[2].metadata == {"m": 1, "source_id": "d", "chunk": 2}
    short = Document("s", "just a few words")
    assert list(chunk_documents([short], size=10, overlap=3)) == [short]
    with pytest.raises(ValueError):
        list(chunk_documents([short], size=5, overlap=5))


def test_token_chunks_keep_original_text(windows):
    from transformers import AutoTokenizer

    from ragserve.retrieval.embedder import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(resolve_model_dir("all-minilm-l6-v2"))
    text = "Paris is the Capital of FRANCE. " * 20
    chunks = list(
        windows.chunk_documents(
            [Document("d", text)], size=16, overlap=4, unit="token", tokenizer=tok
        )
    )
    assert len(chunks) > 1
    assert all(
        c.text in text and len(tok(c.text, add_special_tokens=False)["input_ids"]) <= 16
        for c in chunks
    )
    assert "FRANCE" in chunks[0].text  # casing preserved (the tokenizer is uncased)


def test_factbook_passages_are_answerable_sections():
    docs = list(factbook_documents(limit=20))
    assert len(docs) >= 80 and len({d.id for d in docs}) == len(docs)
    gov = {d.metadata["country"]: d for d in docs if d.metadata["section"] == "Government"}
    assert "Capital: Algiers" in gov["Algeria"].text
    assert gov["Algeria"].title == "Algeria — Government"
    overview = next(d for d in docs if d.id == "ag/overview")
    assert overview.text.startswith("Capital: Algiers;")
    assert all(20 <= len(d.text.split()) <= 250 for d in docs)
    assert not any("<" in d.text and ">" in d.text for d in docs)  # HTML stripped
