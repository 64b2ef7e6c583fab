"""The HTTP layer on real uvicorn (loopback) with real clients, over a scripted backend.

What the Server does is covered by tests/server/test_integration.py with the real Server; here
the backend is scripted so admission, disconnects, auth and draining are tested exactly.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from http_cases import CHAT, HTTP, MALFORMED, MSG
from prometheus_client.parser import text_string_to_metric_families
from server_fakes import FakeBackend, answer_for

from ragserve.server import BackgroundServer, ServeConfig, create_app

MAX_INFLIGHT = 3
MAX_BODY = 4096


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def url(backend: FakeBackend):
    config = ServeConfig(
        port=0, served_model_name="tiny", max_num_inflight=MAX_INFLIGHT, max_body_bytes=MAX_BODY
    )
    with BackgroundServer(create_app(backend, config), config) as bg:
        yield bg.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = HTTP.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_health_and_models(client: openai.OpenAI, url: str) -> None:
    assert HTTP.get(f"{url}/health").json() == {
        "status": "ok",
        "problems": [],
        "cosched": ["split", "similarity"],  # the backend's health()["cosched"]
    }
    ids = [m.id for m in client.models.list()]
    assert ids == ["ragserve/oneshot", "ragserve/recomp", "tiny"]
    assert client.models.retrieve("ragserve/recomp").id == "ragserve/recomp"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ragserve/nope")


def test_chat_completion(client: openai.OpenAI, backend: FakeBackend) -> None:
    out = client.chat.completions.create(
        model="ragserve/oneshot",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "what is rag?"},
        ],
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.content == answer_for("what is rag?")
    assert out.choices[0].finish_reason == "stop"
    assert out.model_extra["documents"] == [
        {"id": "d1", "title": "Doc one"},
        {"id": "d2", "title": None},
    ]
    assert out.model_extra["workflow"] == "oneshot"
    question, graph = backend.questions[-1]
    assert question == "what is rag?"
    assert graph is backend.workflows["oneshot"]  # no overrides: the compiled graph itself
    assert backend.histories[-1] == (("system", "be brief"),)  # the turns before the question


def test_chat_extensions_tune_the_workflow(client: openai.OpenAI, backend: FakeBackend) -> None:
    client.chat.completions.create(
        model="ignored-when-workflow-is-given",
        messages=[{"role": "user", "content": [{"type": "text", "text": "q"}]}],
        max_tokens=7,
        extra_body={"workflow": "recomp", "topk": 9, "nprobe": 4},
    )
    _, graph = backend.questions[-1]
    assert graph.nodes[0].topk == 9 and graph.nodes[0].nprobe == 4
    assert graph.nodes[1].max_tokens == backend.workflows["recomp"].nodes[1].max_tokens
    assert graph.nodes[2].max_tokens == 7
    assert backend.workflows["recomp"].nodes[0].topk == 4  # the shared graph is untouched


def test_streaming_chat(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="ragserve/oneshot", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == answer_for("hi")
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert len({c.id for c in chunks}) == 1
    # the documents ride on the last chunk (the one with finish_reason), as in chat.completion
    assert chunks[-1].model_extra["documents"] == [
        {"id": "d1", "title": "Doc one"},
        {"id": "d2", "title": None},
    ]
    assert all("documents" not in c.model_extra for c in chunks[:-1])


def test_chat_usage_needs_node_timings(client: openai.OpenAI) -> None:
    # the scripted backend's responses have no node timings: no usage rather than zeros
    out = client.chat.completions.create(model="ragserve/oneshot", messages=MSG)
    assert out.usage is None


def test_stream_ends_with_done(url: str) -> None:
    body = {
        "model": "ragserve/oneshot",
        "stream": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    r = HTTP.post(f"{url}/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="a b c d", max_tokens=3, temperature=0)
    assert out.choices[0].text == "d c b"
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (4, 3)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="a b",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "b a"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == 2


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="ragserve/oneshot"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")


def test_backend_errors_map_to_status(url: str, backend: FakeBackend) -> None:
    body = {"model": "ragserve/oneshot", "messages": [{"role": "user", "content": "x"}]}
    backend.fail_with = ValueError("prompt of 9000 tokens exceeds the context of 2048")
    try:
        r = HTTP.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 400 and "exceeds the context" in r.json()["error"]["message"]
        backend.fail_with = RuntimeError("secret internal detail")
        r = HTTP.post(f"{url}/v1/chat/completions", json=body)
        message = r.json()["error"]["message"]
        assert r.status_code == 500 and "secret internal detail" not in message
        assert "request id chatcmpl-" in message
    finally:
        backend.fail_with = None


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        ("bad_request", 400, "invalid_request"),
        ("worker_died", 503, "worker_died"),
        ("internal", 500, "internal_error"),
        ("aborted", 499, "aborted"),
    ],
)
def test_response_error_kind_sets_status(
    url: str, backend: FakeBackend, kind: str, status: int, code: str
) -> None:
    # the message is the same for every kind (and once matched as "bad input"): only the kind
    # decides the status
    message = "node 0 failed: 600 tokens but the context holds 512"
    body = {"model": "ragserve/oneshot", "messages": [{"role": "user", "content": "x"}]}
    backend.fail_response = (message, kind)
    try:
        r = HTTP.post(f"{url}/v1/chat/completions", json=body)
    finally:
        backend.fail_response = None
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    if kind == "internal":  # the log keeps the text; the client gets the request id
        assert "request id" in r.json()["error"]["message"] and "tokens" not in r.text
    else:
        assert r.json()["error"]["message"] == message


@pytest.mark.parametrize(("path", "body", "mentions"), MALFORMED)
def test_malformed_body_is_400(url: str, path: str, body, mentions: str) -> None:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = HTTP.post(f"{url}{path}", headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert mentions in error["message"]


def test_body_size_limit(url: str) -> None:
    big = {"model": "ragserve/oneshot", "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    r = HTTP.post(f"{url}{CHAT}", json=big)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    chunked = (piece for piece in [json.dumps(big).encode()[:3000], b"y" * 3000])
    r = HTTP.post(f"{url}{CHAT}", content=chunked)  # no Content-Length: counted as it arrives
    assert r.status_code == 413


def test_documents_upsert_and_delete(url: str, backend: FakeBackend) -> None:
    docs = [{"id": "n1", "text": "new passage", "title": "New", "metadata": {"k": 1}}]
    r = HTTP.post(f"{url}/v1/documents", json={"documents": docs})
    assert r.status_code == 200 and r.json()["data"][0]["status"] == "persisted"
    assert backend.docs["n1"].title == "New" and backend.docs["n1"].metadata == {"k": 1}
    assert HTTP.delete(f"{url}/v1/documents/n1").json()["deleted"] is True
    assert "n1" not in backend.docs
    assert HTTP.delete(f"{url}/v1/documents/n1").status_code == 404


def test_metrics_move(url: str, client: openai.OpenAI) -> None:
    ok = ("ragserve:requests_total", (("status", "ok"), ("workflow", "oneshot")))
    e2e = ("ragserve:e2e_request_latency_seconds_count", (("workflow", "oneshot"),))
    before = metric_samples(url)
    client.chat.completions.create(model="ragserve/oneshot", messages=MSG)
    list(client.chat.completions.create(model="ragserve/oneshot", messages=MSG, stream=True))
    after = metric_samples(url)
    assert after[ok] - before.get(ok, 0) == 2
    assert after[e2e] - before.get(e2e, 0) == 2
    ttft = ("ragserve:time_to_first_token_seconds_count", (("workflow", "oneshot"),))
    assert after[ttft] - before.get(ttft, 0) == 1  # only the stream sees its first token
    assert after[("ragserve:retrieval_latency_seconds_count", (("workflow", "oneshot"),))] >= 1
    assert after[("ragserve:kv_cache_blocks_total", ())] == 64
    assert after[("ragserve:num_requests_running", ())] == 0
    assert after[("ragserve:queue_depth", (("queue", "queues.generation_queue"),))] == 0


class OpenStream:
    """A chat stream read up to its first event and held open (the line iterator is kept:
    dropping it would close the connection)."""

    def __init__(self, http: httpx.Client, prompt: str) -> None:
        body = {
            "model": "ragserve/oneshot",
            "stream": True,
            "messages": [{"role": "user", "content": prompt}],
        }
        self.response = http.send(http.build_request("POST", CHAT, json=body), stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()
        self.request_id = json.loads(next(self.lines).removeprefix("data: "))["id"]

    def rest(self) -> list[str]:
        return [line for line in self.lines if line]


def test_burst_past_admission_is_429_and_health_answers(url: str, backend: FakeBackend) -> None:
    backend.gate.clear()
    held = []
    try:
        with httpx.Client(base_url=url) as http:
            held = [OpenStream(http, f"q{i}") for i in range(MAX_INFLIGHT)]
            before = metric_samples(url)
            for _ in range(3):
                r = HTTP.post(f"{url}{CHAT}", json={"model": "ragserve/oneshot", "messages": MSG})
                assert r.status_code == 429
                assert r.headers["retry-after"] == "1"
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert HTTP.get(f"{url}/health").status_code == 200
            after = metric_samples(url)
            assert (
                after[("ragserve:requests_rejected_total", ())]
                - before.get(("ragserve:requests_rejected_total", ()), 0)
                == 3
            )
            assert after[("ragserve:num_requests_admitted", ())] == MAX_INFLIGHT
            backend.gate.set()
            assert all(stream.rest()[-1] == "data: [DONE]" for stream in held)
    finally:
        backend.gate.set()
    r = HTTP.post(f"{url}{CHAT}", json={"model": "ragserve/oneshot", "messages": MSG})
    assert r.status_code == 200


def test_disconnect_mid_stream_aborts(url: str, backend: FakeBackend) -> None:
    backend.gate.clear()
    try:
        with httpx.Client(base_url=url) as http:
            stream = OpenStream(http, "long question")
            request_id = stream.request_id
            wait_for(lambda: request_id in backend.running, "the request to reach the backend")
            stream.response.close()
        wait_for(lambda: request_id in backend.aborted, "the abort")
        wait_for(lambda: not backend.running, "the backend to be idle")
        samples = metric_samples(url)
        assert samples[("ragserve:num_requests_admitted", ())] == 0
        assert (
            samples[("ragserve:requests_total", (("status", "aborted"), ("workflow", "oneshot")))]
            >= 1
        )
    finally:
        backend.gate.set()


def test_disconnect_while_waiting_non_streaming_aborts(url: str, backend: FakeBackend) -> None:
    backend.gate.clear()
    try:
        with httpx.Client(base_url=url, timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
            http.post(CHAT, json={"model": "ragserve/oneshot", "messages": MSG})
        wait_for(lambda: len(backend.aborted) > 0 and not backend.running, "the abort")
    finally:
        backend.gate.set()


def test_auth() -> None:
    backend = FakeBackend()
    config = ServeConfig(port=0, api_key="sekrit", served_model_name="tiny")
    with BackgroundServer(create_app(backend, config), config) as bg:
        assert HTTP.get(f"{bg.url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = HTTP.get(f"{bg.url}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert HTTP.get(f"{bg.url}/metrics").status_code == 401
        assert HTTP.post(f"{bg.url}{CHAT}", json={}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{bg.url}/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="sekrit", max_retries=0)
        assert [m.id for m in good.models.list()][-1] == "tiny"
        out = good.chat.completions.create(model="ragserve/oneshot", messages=MSG)
        assert out.choices[0].message.content == answer_for("x")


def test_graceful_shutdown_drains_inflight_requests() -> None:
    backend = FakeBackend()
    config = ServeConfig(port=0, served_model_name="tiny", drain_timeout_s=30)
    bg = BackgroundServer(create_app(backend, config, own_server=True), config).start()
    results: list[httpx.Response] = []
    backend.gate.clear()
    body = {"model": "ragserve/oneshot", "messages": MSG}
    caller = threading.Thread(
        target=lambda: results.append(HTTP.post(f"{bg.url}{CHAT}", json=body))
    )
    caller.start()
    wait_for(lambda: backend.running, "the request to reach the backend")
    stopper = threading.Thread(target=bg.stop)
    stopper.start()
    wait_for(lambda: not bg._server.servers[0].is_serving(), "the listener to close")
    assert not backend.closed  # draining: the Server stays open while a request is in flight
    backend.gate.set()
    caller.join(10)
    stopper.join(10)
    assert results[0].status_code == 200
    assert results[0].json()["choices"][0]["message"]["content"] == answer_for("x")
    assert backend.closed
