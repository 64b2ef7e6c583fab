"""Workflow inputs over HTTP (``inputs`` of ``POST /v1/chat/completions``): a memory
workflow through real uvicorn on loopback remembers a session across requests; bad inputs
are a 400 naming the key."""

from __future__ import annotations

import json

import httpx
import pytest
from http_cases import HTTP

from ragserve.server import BackgroundServer, ServeConfig, create_app

pytestmark = pytest.mark.integration


def memo_graph():
    """recall the session's entries -> write them as the answer -> remember the question."""
    from ragserve.graph import END, START, RAGraph

    g = RAGraph("memo", inputs=("session",))
    g.add_memory("recall", key="session", output="memory")
    g.add_function("show", lambda s: json.dumps(list(s["memory"])), output="output")
    g.add_memory("remember", key="session", mode="append", text="{input}")
    g.add_edge(START, "recall").add_edge("recall", "show").add_edge("show", "remember")
    return g.add_edge("remember", END).compile()


@pytest.fixture(scope="module")
def url(server):
    server.workflows["memo"] = memo_graph()
    serve = ServeConfig(port=0, served_model_name="tiny")
    try:
        with BackgroundServer(create_app(server, serve), serve) as bg:
            yield bg.url
    finally:
        del server.workflows["memo"]


def chat(url: str, question: str, **extra) -> httpx.Response:
    body = {"model": "ragserve/memo", "messages": [{"role": "user", "content": question}]}
    return HTTP.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60)


def answer(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    return json.loads(r.json()["choices"][0]["message"]["content"])


def test_a_session_remembers_across_requests(url: str) -> None:
    assert answer(chat(url, "Where is Lima?", inputs={"session": "abc"})) == []
    assert answer(chat(url, "And Quito?", inputs={"session": "abc"})) == ["Where is Lima?"]
    # another session sees nothing of it
    assert answer(chat(url, "Hello?", inputs={"session": "xyz"})) == []
    assert answer(chat(url, "Third?", inputs={"session": "abc"})) == [
        "Where is Lima?",
        "And Quito?",
    ]


def test_streaming_passes_the_inputs_too(url: str) -> None:
    assert answer(chat(url, "First words", inputs={"session": "streamed"})) == []
    body = {
        "model": "ragserve/memo",
        "messages": [{"role": "user", "content": "Second"}],
        "inputs": {"session": "streamed"},
        "stream": True,
    }
    with HTTP.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data")]
    assert lines[-1] == "[DONE]"
    assert all("error" not in json.loads(line) for line in lines[:-1]), lines
    # the streamed request ran in the session: it read it and appended its question
    assert answer(chat(url, "Third", inputs={"session": "streamed"})) == ["First words", "Second"]


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        ({}, "workflow 'memo' needs input 'session'"),
        ({"inputs": {}}, "workflow 'memo' needs input 'session'"),
        ({"inputs": {"session": "a", "user": "b"}}, "workflow 'memo' has no input 'user'"),
        ({"inputs": {"session": "a", "input": "b"}}, "has no input 'input'"),
        ({"inputs": {"session": ["a"]}}, "inputs: 'session' must be a string, a boolean"),
        ({"inputs": {"session": {"id": 1}}}, "number, not an object"),
        (
            {"inputs": {"session": None}},
            "'session' must be a string, a boolean, an integer or a number, not null",
        ),
        ({"inputs": {"session": "x" * 70_000}}, "'session': at most 65536 characters, got 70000"),
        ({"inputs": {"bad key": "a"}}, "'bad key' is not an input name"),
        ({"inputs": {f"k{i}": "v" for i in range(65)}}, "at most 64 inputs, got 65"),
        ({"inputs": ["session", "a"]}, "inputs: must be an object"),
        # a well-typed input the node cannot use fails the request as bad_request: a 400 too
        ({"inputs": {"session": 7}}, "must hold a non-empty session id string"),
    ],
)
def test_bad_inputs_are_a_400_naming_the_key(url: str, extra: dict, mentions: str) -> None:
    r = chat(url, "Hi", **extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert mentions in error["message"], error


def test_a_workflow_without_inputs_refuses_any(url: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = HTTP.post(
        f"{url}/v1/chat/completions", json={**body, "inputs": {"session": "a"}}, timeout=60
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert "has no input 'session' (it takes: none)" in error["message"]
    assert error["param"] == "inputs.session"
    assert HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
