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


def test_build_with_query_adapter_and_a_corrupt_adapter_file(tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    texts = [
        "Paris is the capital and largest city of France. It lies on the Seine.",
        "The Nile is a major river of Africa. It flows north into the Mediterranean Sea.",
        "Tea is an aromatic drink made from leaves. It is popular in many countries.",
        "Python is a programming language. It is used for scripting and data analysis.",
    ]
    corpus.write_text(
        "\n".join(json.dumps({"id": f"d{i}", "text": t}) for i, t in enumerate(texts))
    )
    out = tmp_path / "idx"
    args = ["index", "build", "--corpus", str(corpus), "--out", str(out), "--query-adapter"]
    assert main(args) == 0
    assert "query adapter trained on 4 pseudo-queries" in capsys.readouterr().out
    assert main(["index", "info", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["live"]["query_adapter"]["num_pairs"] == 4
    assert main(["index", "search", str(out), "Which river flows into the sea?", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0][0]["id"] == "d1"
    (out / "query_adapter.npy").write_bytes(b"not an array")
    assert main(["index", "search", str(out), "river"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "query_adapter.npy" in err and "\n" not in err
