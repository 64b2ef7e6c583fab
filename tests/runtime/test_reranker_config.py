"""The rerank nodes' reranker as configuration (``OperatorConfig.reranker``): a
``module:factory`` reranker is built by the real retrieval worker process and changes the
order; a name that cannot be built fails the start in one line."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest

from ragserve.graph import END, START, RAGraph
from ragserve.retrieval.rerank import EmbeddingReranker, RerankerLoadError, load_reranker
from ragserve.runtime import Server, ServerConfig
from ragserve.scheduler import OperatorConfig

# scores each passage by its position: the last one in is the best
REVERSING = """
import numpy as np

class Reversing:
    def __init__(self, embedder):
        self.embedder = embedder

    def score(self, query, texts):
        return np.arange(len(texts), dtype=np.float32)

def make(embedder):
    return Reversing(embedder)

NOT_CALLABLE = 3
"""


@pytest.fixture
def reranker_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"rr_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(REVERSING))
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    return name


def _graph() -> RAGraph:
    g = RAGraph("rerank")
    g.add_retrieval("search", query="input", topk=4, output="docs")
    g.add_rerank("best", query="input", docs="docs", topk=3, output="top")
    g.add_edge(START, "search").add_edge("search", "best")
    return g.add_edge("best", END)


def test_config_checks_the_form_only() -> None:
    assert OperatorConfig().reranker == "embedding"
    assert OperatorConfig(reranker="pkg.mod:Factory.build").reranker == "pkg.mod:Factory.build"
    for bad in ("", "cosine", "mod:", ":f", "a:b:c", "a b:c", 3):
        with pytest.raises(ValueError, match="reranker must be 'embedding' or 'module:factory'"):
            OperatorConfig(reranker=bad)


def test_load_reranker_names_what_failed(reranker_module: str) -> None:
    assert isinstance(load_reranker("embedding", object()), EmbeddingReranker)
    built = load_reranker(f"{reranker_module}:make", "emb")
    assert built.embedder == "emb" and list(built.score("q", ["a", "b"])) == [0.0, 1.0]
    # a BaseReranker subclass is its own factory
    assert isinstance(
        load_reranker("ragserve.retrieval.rerank:EmbeddingReranker", "e"), EmbeddingReranker
    )
    cases = {
        "no_such_module_z:make": "cannot import no_such_module_z (ModuleNotFoundError",
        f"{reranker_module}:missing": f"{reranker_module} has no attribute missing",
        f"{reranker_module}:NOT_CALLABLE": "NOT_CALLABLE is a int, not callable",
        f"{reranker_module}:Reversing.score": "the factory raised TypeError",
        "builtins:str": "the factory returned a str, which has no score(query, texts) method",
    }
    for name, text in cases.items():
        with pytest.raises(RerankerLoadError) as info:
            load_reranker(name, "emb")
        message = str(info.value)
        assert message.startswith(f"reranker {name!r}: ") and text in message, message
        assert "\n" not in message


@pytest.mark.integration
def test_a_configured_reranker_orders_through_the_worker_processes(
    tiny_model: str, small_index: str, reranker_module: str, process_server: Server
) -> None:
    q = "What is the capital of France?"
    orders = {}
    for name in ("embedding", f"{reranker_module}:make"):
        if name == "embedding":  # the default
            r = process_server.run(q, _graph())
        else:
            config = ServerConfig(
                engine_kwargs={"device": "cpu"}, operators=OperatorConfig(reranker=name)
            )
            with Server(tiny_model, small_index, config=config) as s:
                r = s.run(q, _graph())
        assert r.error is None, r.error
        docs, top = r.state["docs"], r.state["top"]
        assert len(docs) == 4
        orders[name] = [p.doc_id for p in top]
        if name != "embedding":  # the factory's scores: position in the input, reversed
            assert orders[name] == [p.doc_id for p in docs[::-1][:3]]
            assert [p.score for p in top] == [3.0, 2.0, 1.0]
    assert orders["embedding"] != orders[f"{reranker_module}:make"]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("no_such_module_w:make", "cannot import no_such_module_w"),
        ("builtins:str", "the factory returned a str"),
    ],
)
def test_a_bad_reranker_fails_the_start_in_one_line(
    tiny_model: str, small_index: str, name: str, text: str
) -> None:
    config = ServerConfig(engine_kwargs={"device": "cpu"}, operators=OperatorConfig(reranker=name))
    with pytest.raises(RuntimeError) as info:
        Server(tiny_model, small_index, config=config)
    message = str(info.value)
    assert message.startswith("retrieval worker failed to start: reranker ") and text in message
    assert "\n" not in message, message


def test_in_process_server_builds_the_reranker(
    tiny_model: str, small_index: str, reranker_module: str
) -> None:
    config = ServerConfig(
        in_process=True,
        engine_kwargs={"device": "cpu"},
        operators=OperatorConfig(reranker=f"{reranker_module}:make"),
    )
    with Server(tiny_model, small_index, config=config) as s:
        r = s.run("What is the capital of Japan?", _graph())
    assert r.error is None, r.error
    assert [p.doc_id for p in r.state["top"]] == [p.doc_id for p in r.state["docs"][::-1][:3]]
    assert np.allclose([p.score for p in r.state["top"]], [3.0, 2.0, 1.0])


def test_serve_flag_and_config_file_name_the_reranker(tmp_path: Path, capsys) -> None:
    from ragserve.cli.launch_config import from_mapping, read_file
    from ragserve.cli.main import main

    assert main(["serve", "--reranker", "pkg.rr:make", "--print-config"]) == 0
    dumped = tmp_path / "dumped.toml"
    dumped.write_text(capsys.readouterr().out)
    assert from_mapping(read_file(str(dumped))).runtime.operators.reranker == "pkg.rr:make"
    config = tmp_path / "c.toml"
    config.write_text('[operators]\nreranker = "other.rr:build"\nfunction_workers = 2\n')
    assert main(["serve", "--config", str(config), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert 'reranker = "other.rr:build"' in out and "function_workers = 2" in out
    # the flag wins over the file
    assert (
        main(["serve", "--config", str(config), "--reranker", "embedding", "--print-config"]) == 0
    )
    assert 'reranker = "embedding"' in capsys.readouterr().out
