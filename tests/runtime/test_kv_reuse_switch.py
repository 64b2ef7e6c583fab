"""``set_kv_reuse`` through the server's executors: the RAG benchmark runs systems with and
without document-KV reuse on one engine (in a worker process and in process)."""

from __future__ import annotations

import pytest

from ragserve.runtime import Server, ServerConfig

QUESTION = "What is the capital of Peru?"


@pytest.mark.parametrize("in_process", [True, False])
def test_reuse_switch_reaches_the_engine(tiny_model, small_index, in_process) -> None:
    config = ServerConfig(in_process=in_process, engine_kwargs={"device": "cpu"})
    with Server(tiny_model, small_index, config=config) as s:

        def hits_of_two_runs() -> int:
            before = s.stats()["engine"].get("prefix_cache_hit_tokens", 0)
            for _ in range(2):
                assert s.run(QUESTION, "oneshot").error is None
            return s.stats()["engine"]["prefix_cache_hit_tokens"] - before

        assert s.executor.call_generation("set_kv_reuse", False).result(30) == {"kv_reuse": False}
        assert hits_of_two_runs() == 0
        s.executor.call_generation("set_kv_reuse", True).result(30)
        assert hits_of_two_runs() > 0  # the second run reuses the first one's prompt
        with pytest.raises(Exception, match="bool"):
            s.executor.call_generation("set_kv_reuse", "yes").result(30)
