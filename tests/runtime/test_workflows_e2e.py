"""Every built-in workflow end to end on a tiny model and a small index (in process)."""

from __future__ import annotations

import asyncio

import pytest

from ragserve.graph import END, START, RAGraph
from ragserve.runtime import RequestError, Server
from ragserve.workflows import BUILTIN_WORKFLOWS, get_workflow

SMALL = {"max_tokens": 6}
EXTRA = {
    "hyde": {"hypo_tokens": 6},
    "multistep": {"step_tokens": 6, "rounds": 2},
    "irg": {"rounds": 2},
    "recomp": {"summary_tokens": 6},
}


def small_workflow(name: str):
    return get_workflow(name, **SMALL, **EXTRA.get(name, {}))


@pytest.fixture
def server(local_server: Server) -> Server:
    return local_server


EXPECTED_KINDS = {
    "oneshot": ["retrieval", "generation"],
    "hyde": ["generation", "retrieval", "generation"],
    "multistep": ["generation", "retrieval", "generation"] * 2 + ["generation"],
    "irg": ["retrieval", "generation", "retrieval", "generation"],
    "recomp": ["retrieval", "generation", "generation"],
}


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKFLOWS))
def test_builtin_workflow_end_to_end(server: Server, name: str) -> None:
    r = server.run("What is the capital of Kenya?", small_workflow(name))
    assert r.error is None
    assert [t.kind for t in r.node_timings] == EXPECTED_KINDS[name]
    assert r.doc_ids and len(r.doc_ids) == len(r.titles)
    assert all(t.finished_at is not None for t in r.node_timings)
    assert r.output == r.state["output"] and isinstance(r.output, str)


def test_answer_equals_the_engine_on_the_rendered_prompt(server: Server, tiny_model: str) -> None:
    from ragserve.generation import LLMEngine

    r = server.run("What is the capital of Kenya?", small_workflow("oneshot"))
    assert "Kenya" in r.titles
    engine = LLMEngine(tiny_model, device="cpu")  # a second engine: the server's is not ours
    prompt = small_workflow("oneshot").nodes[1].prompt.render(r.state)
    assert "[1] Kenya\nThe capital of Kenya is Nairobi." in prompt
    from ragserve.generation import SamplingParams

    chat = engine.apply_chat_template([{"role": "user", "content": prompt}])
    alone = engine.generate([chat], SamplingParams(max_tokens=6))[0]
    assert r.output == alone.text


def test_conditional_loop_terminates_on_state(server: Server) -> None:
    g = RAGraph()
    g.add_generation("write", prompt="{input} {draft}", output="draft", max_tokens=2, append=True)
    g.add_edge(START, "write")
    g.add_edge("write", lambda s: "write" if s.visit_count("write") < 4 else END)
    r = server.run("count", g)
    assert r.error is None and [t.node_id for t in r.node_timings] == ["write"] * 4


def test_submit_stream_and_bad_prompts(server: Server) -> None:
    graph = small_workflow("hyde")

    final: list = []

    async def go():
        deltas = [
            d async for d in server.stream("Capital of Peru?", graph, on_response=final.append)
        ]
        many = await asyncio.gather(*(server.submit(f"Capital of {c}?", graph) for c in "ABC"))
        return deltas, many

    deltas, many = asyncio.run(go())
    alone = server.run("Capital of Peru?", graph)
    assert "".join(deltas) == alone.output
    assert len(final) == 1 and final[0].output == alone.output and final[0].error is None
    assert final[0].doc_ids == alone.doc_ids and len(final[0].titles) == len(alone.doc_ids) > 0
    assert [r.error for r in many] == [None] * 3
    assert [r.error_kind for r in many] == [None] * 3
    too_long = RAGraph().add_generation(0, prompt="{input}").add_edge(START, 0).add_edge(0, END)
    r = server.run("word " * 50_000, too_long)
    assert r.error is not None and r.error.startswith("node 0 failed:")
    assert r.error_kind == "bad_request"

    async def stream_too_long():
        return [
            d async for d in server.stream("word " * 50_000, too_long, on_response=final.append)
        ]

    with pytest.raises(RequestError, match="node 0 failed") as info:
        asyncio.run(stream_too_long())
    assert info.value.kind == "bad_request" and info.value.response.error == info.value.args[0]
    assert final[-1] is info.value.response  # handed over before the error is raised
    with pytest.raises(KeyError, match="unknown workflow"):
        server.run("q", "nope")


def test_worker_mode_needs_paths_not_live_objects(tiny_model: str) -> None:
    with pytest.raises(TypeError, match="index must be a name or a path"):
        Server(tiny_model, object())
