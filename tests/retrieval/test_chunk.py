"""Chunking in the embedder's tokens: no passage over the window, nothing lost, headings as
titles, paragraphs kept whole when they fit, overlap between consecutive passages."""

from __future__ import annotations

import re

import pytest

from ragserve.retrieval.ingest import Block, ChunkConfig, Chunker, ParsedDocument, Section
from ragserve.retrieval.types import Document


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from ragserve.retrieval.embedder import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("all-minilm-l6-v2"))


def _sentences(prefix: str, n: int) -> str:
    return " ".join(f"{prefix} sentence number {i} talks about topic {i * 7}." for i in range(n))


def _doc() -> ParsedDocument:
    long_code = "\n".join(f"value_{i} = compute(argument_{i}, option={i})" for i in range(60))
    one_long_sentence = " ".join(f"word{i}" for i in range(400))  # no sentence boundary
    return ParsedDocument(
        (
            Section(("Tutorial",), (Block("Short intro."),)),
            Section(
                ("Tutorial", "Data Structures", "Sets"),
                (
                    Block(_sentences("Alpha", 8)),
                    Block(_sentences("Beta", 40)),  # longer than a window: cut at sentences
                    Block(long_code, is_code=True),
                    Block(one_long_sentence),
                ),
            ),
        ),
        {"date": "2024-01-01"},
    )


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text))


@pytest.mark.parametrize("window", [64, 128, 256])
def test_no_passage_over_the_window_and_nothing_lost(tokenizer, window):
    chunker = Chunker(tokenizer, window, ChunkConfig(overlap_tokens=16))
    passages = list(chunker.chunk("docs/sets.rst", _doc()))
    for p in passages:
        assert chunker.passage_tokens(p.title, p.text) <= window, (p.id, p.text)
    source = " ".join(b.text for s in _doc().sections for b in s.blocks)
    assert _words(source) <= set().union(*(_words(p.text) for p in passages))
    assert chunker.stats.num_truncated == 0
    assert chunker.stats.max_passage_tokens <= window


def test_titles_ids_and_metadata(tokenizer):
    passages = list(Chunker(tokenizer, 256).chunk("docs/sets.rst", _doc()))
    assert passages[0].text == "Short intro." and passages[0].title == "Tutorial"
    assert {p.title for p in passages[1:]} == {"Tutorial > Data Structures > Sets"}
    assert [p.id for p in passages] == [f"docs/sets.rst#{i}" for i in range(len(passages))]
    for i, p in enumerate(passages):
        assert p.metadata == {
            "date": "2024-01-01",
            "source": "docs/sets.rst",
            "section": p.title,
            "chunk": i,
        }


def test_paragraphs_stay_whole_when_they_fit(tokenizer):
    paras = tuple(Block(_sentences(f"P{i}", 3)) for i in range(6))
    doc = ParsedDocument((Section(("T",), paras),))
    passages = list(Chunker(tokenizer, 128, ChunkConfig(overlap_tokens=0)).chunk("a.md", doc))
    for p in passages:
        for part in p.text.split("\n\n"):
            assert part in [b.text for b in paras]  # never a paragraph cut in two
    assert len(passages) > 1


def test_overlap_repeats_the_previous_passage_tail(tokenizer):
    doc = ParsedDocument((Section(("T",), (Block(_sentences("Gamma", 30)),)),))
    chunker = Chunker(tokenizer, 96, ChunkConfig(overlap_tokens=24))
    passages = list(chunker.chunk("a.md", doc))
    assert len(passages) >= 3
    for prev, nxt in zip(passages, passages[1:], strict=False):
        first_sentence = re.split(r"(?<=\.)\s", nxt.text)[0]
        assert prev.text.endswith(first_sentence)
        assert len(tokenizer(first_sentence, add_special_tokens=False)["input_ids"]) <= 24
    no_overlap = list(Chunker(tokenizer, 96, ChunkConfig(overlap_tokens=0)).chunk("a.md", doc))
    assert len(no_overlap) < len(passages)


def test_a_huge_heading_path_is_shortened(tokenizer):
    path = tuple(f"Heading level {i} with a long name" for i in range(40))
    doc = ParsedDocument((Section(path, (Block("Body text."),)),))
    chunker = Chunker(tokenizer, 64)
    (p,) = chunker.chunk("a.md", doc)
    assert p.title == path[-1] and chunker.stats.num_titles_shortened == 1
    assert chunker.passage_tokens(p.title, p.text) <= 64


def test_records_keep_their_id_when_they_fit(tokenizer):
    chunker = Chunker(tokenizer, 64)
    short = Document("paris", "Paris is the capital of France.", "Paris", {"k": 1})
    assert list(chunker.chunk_document(short)) == [short]
    long = Document("big", _sentences("Delta", 20), "Big", {"k": 2})
    parts = list(chunker.chunk_document(long))
    assert [p.id for p in parts] == [f"big#{i}" for i in range(len(parts))]
    assert all(p.metadata == {"k": 2, "source_id": "big", "chunk": i} for i, p in enumerate(parts))
    assert all(chunker.passage_tokens(p.title, p.text) <= 64 for p in parts)


def test_bad_config():
    with pytest.raises(ValueError, match="overlap_tokens"):
        ChunkConfig(overlap_tokens=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        ChunkConfig(max_tokens=8)
    with pytest.raises(ValueError, match="half"):
        ChunkConfig(max_tokens=64, overlap_tokens=40)
