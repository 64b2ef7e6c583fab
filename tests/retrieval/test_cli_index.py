"""`ragserve index build|info|search` on a small JSONL corpus."""

from __future__ import annotations

import json

from ragserve.cli.main import main


def test_build_info_search(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    rows = [
        {
            "id": "paris",
            "title": "Paris",
            "text": "Paris is the capital and largest city of France.",
        },
        {
            "id": "nile",
            "title": "Nile",
            "text": "The Nile is a major river flowing into the Mediterranean Sea through Egypt.",
        },
        {"id": "tea", "title": "Tea", "text": "Tea is an aromatic drink made from leaves."},
    ]
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "idx"
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(out)]) == 0
    assert "3 passages" in capsys.readouterr().out
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(out)]) == 2

    assert main(["index", "info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["manifest"]["num_vectors"] == 3 and info["live"]["num_documents"] == 3

    assert (
        main(
            [
                "index",
                "search",
                str(out),
                "Which city is the capital of France?",
                "-k",
                "2",
                "--json",
            ]
        )
        == 0
    )
    hits = json.loads(capsys.readouterr().out)
    assert hits[0][0]["id"] == "paris" and len(hits[0]) == 2


def test_an_index_with_a_removed_query_adapter_is_refused_not_ranked_differently(
    tmp_path, make_corpus
):
    """Indexes built with `--query-adapter` (removed after e82677a) fail to load, naming why."""
    import pytest

    from ragserve.retrieval import IndexCorruptError, VectorIndex

    docs, x = make_corpus(40)
    vi = VectorIndex.from_vectors(docs, x, embedder_name="none", nlist=2, nprobe=2)
    vi.metadata["query_adapter"] = {"num_pairs": 4}
    vi.save(tmp_path / "ix")
    vi.close()
    with pytest.raises(IndexCorruptError, match="query adapter was removed"):
        VectorIndex.load(tmp_path / "ix")
