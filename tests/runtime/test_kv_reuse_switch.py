"""``set_kv_reuse`` through the server's executors: the RAG benchmark runs systems with and
without document-KV reuse on one engine (in a worker process and in process)."""

from __future__ import annotations

import pytest

from ragserve.runtime import Server, ServerConfig
from ragserve.workflows import get_workflow

SHORT = get_workflow("oneshot", max_tokens=6)  # the built-in, with a short answer

QUESTION = "What is the capital of Peru?"


@pytest.fixture(params=[True, False], ids=["in_process", "processes"])
def server(request: pytest.FixtureRequest, tiny_model: str, small_index: str):
    if not request.param:
        yield request.getfixturevalue("process_server")
        return
    config = ServerConfig(in_process=True, engine_kwargs={"device": "cpu"})
    with Server(tiny_model, small_index, config=config) as s:
        yield s


def test_reuse_switch_reaches_the_engine(server: Server) -> None:
    def hits_of_two_runs() -> int:
        before = server.stats()["engine"].get("prefix_cache_hit_tokens", 0)
        for _ in range(2):
            assert server.run(QUESTION, SHORT).error is None
        return server.stats()["engine"]["prefix_cache_hit_tokens"] - before

    call = server.executor.call_generation
    assert call("set_kv_reuse", False).result(30) == {"kv_reuse": False}
    assert hits_of_two_runs() == 0
    call("set_kv_reuse", True).result(30)  # the default again: the shared server is left as found
    assert hits_of_two_runs() > 0  # the second run reuses the first one's prompt
    with pytest.raises(Exception, match="bool"):
        call("set_kv_reuse", "yes").result(30)
