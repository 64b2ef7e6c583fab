"""The HTTP front over the real Server (tiny seeded model, small real index), real uvicorn on
loopback, the official ``openai`` client. One module-scoped stack keeps the suite lean."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from http_cases import HTTP
from prometheus_client.parser import text_string_to_metric_families
from stacks import FACTS

from ragserve.server import BackgroundServer, ServeConfig, create_app
from ragserve.server.graphs import tune_graph

pytestmark = pytest.mark.integration

MAX_INFLIGHT = 3
LONG = 480  # tokens a held request generates (ignore_eos); the tiny model's context is 512


@pytest.fixture(scope="module")
def url(server):
    config = ServeConfig(port=0, served_model_name="tiny", max_num_inflight=MAX_INFLIGHT)
    with BackgroundServer(create_app(server, config), config) as bg:
        yield bg.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def samples(url: str) -> dict[tuple[str, tuple], float]:
    text = HTTP.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_for(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def ask(client: openai.OpenAI, question: str, **extra):
    return client.chat.completions.create(
        model="ragserve/oneshot",
        messages=[{"role": "user", "content": question}],
        max_tokens=6,
        extra_body=extra or None,
    )


def test_chat_and_streaming_chat_equal_server_run(client: openai.OpenAI, server) -> None:
    question = "What is the capital of Kenya?"
    out = ask(client, question, topk=2)
    graph = tune_graph(server.workflows["oneshot"], topk=2, max_tokens=6)
    alone = server.run(question, graph)
    assert alone.error is None
    assert out.choices[0].message.content == alone.output
    documents = out.model_extra["documents"]
    assert [d["id"] for d in documents] == list(alone.doc_ids)
    assert "Kenya-cap" in alone.doc_ids
    kenya = next(d for d in documents if d["id"] == "Kenya-cap")
    assert kenya["title"] == "Kenya" and kenya["text"] == "The capital of Kenya is Nairobi."
    assert isinstance(kenya["score"], float)
    stream = client.chat.completions.create(
        model="ragserve/oneshot",
        messages=[{"role": "user", "content": question}],
        max_tokens=6,
        stream=True,
        extra_body={"topk": 2},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone.output
    # max_tokens=6 cut the answer (the random tiny model does not stop by itself)
    assert alone.node_timings[-1].finish_reason == "length"
    assert out.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["documents"] == documents  # same passages, same scores


def test_chat_usage_of_a_one_node_answer(client: openai.OpenAI, server) -> None:
    question = "What is the capital of Japan?"
    out = ask(client, question, topk=2)
    graph = tune_graph(server.workflows["oneshot"], topk=2, max_tokens=6)
    alone = server.run(question, graph)
    engine = server.executor.generation.engine
    chat = engine.apply_chat_template(
        [{"role": "user", "content": graph.nodes[1].prompt.render(alone.state)}]
    )
    assert out.usage.prompt_tokens == len(engine._tokenize(chat))
    assert 0 < out.usage.completion_tokens <= 6
    assert out.usage.completion_tokens == alone.node_timings[-1].num_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model="ragserve/oneshot",
            messages=[{"role": "user", "content": question}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"topk": 2},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage == out.usage


def test_concurrent_chats_each_get_their_own_answer(url: str, server) -> None:
    questions = [f"What is the capital of {country}?" for country, _ in FACTS[:MAX_INFLIGHT]]

    def post(question: str) -> dict:
        body = {
            "model": "ragserve/hyde",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 6,
        }
        return HTTP.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()

    with ThreadPoolExecutor(len(questions)) as pool:
        answers = list(pool.map(post, questions))
    graph = tune_graph(server.workflows["hyde"], max_tokens=6)
    for question, answer in zip(questions, answers, strict=True):
        alone = server.run(question, graph)
        assert answer["choices"][0]["message"]["content"] == alone.output
        assert [d["id"] for d in answer["documents"]] == list(alone.doc_ids)


def test_completions_streaming_equals_non_streaming(client: openai.OpenAI, server) -> None:
    prompt = "The capital of France is"
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    engine_tokenizer = server.executor.generation.engine.tokenizer
    assert out.usage.prompt_tokens == len(engine_tokenizer(prompt)["input_ids"])
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_token_id_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt=[1, 500, 900], max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens <= 3


def test_prompt_past_the_context_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="tiny", prompt="word " * 2000, max_tokens=4)
    # a chat answer node whose rendered prompt is too long: the runtime's error_kind decides
    with pytest.raises(openai.BadRequestError, match="context") as info:
        ask(client, "word " * 2000)
    assert info.value.code == "invalid_request"


def test_metrics_move(client: openai.OpenAI, url: str) -> None:
    ok = ("ragserve:requests_total", (("status", "ok"), ("workflow", "oneshot")))
    retrieval = ("ragserve:retrieval_latency_seconds_count", (("workflow", "oneshot"),))
    ttft = ("ragserve:time_to_first_token_seconds_count", (("workflow", "completion"),))
    tokens = ("ragserve:generation_tokens_total", (("model_name", "tiny"),))
    before = samples(url)
    ask(client, "What is the capital of Peru?")
    client.completions.create(
        model="tiny", prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = samples(url)
    assert after[ok] - before.get(ok, 0) == 1
    assert after[retrieval] - before.get(retrieval, 0) == 1
    assert after[ttft] - before.get(ttft, 0) == 1
    assert after[tokens] - before.get(tokens, 0) == 5
    assert after[("ragserve:kv_cache_blocks_total", ())] > 0
    assert after[("ragserve:num_requests_running", ())] == 0
    assert ("ragserve:num_requests_waiting", ()) in after
    # the engine's cache-fusion and KV-reuse counters are exported too (issues 12, 13)
    for key in ("engine.num_fused_tokens", "engine.num_recomputed_tokens"):
        assert ("ragserve:server_stat", (("key", key),)) in after, key


def test_upsert_then_retrieve_then_delete(client: openai.OpenAI, url: str) -> None:
    doc = {
        "id": "zorblax",
        "title": "Zorblax festival",
        "text": "The Zorblax lantern festival is held every spring in the town of Quuxville.",
    }
    r = HTTP.post(f"{url}/v1/documents", json={"documents": [doc]}, timeout=60)
    assert r.status_code == 200, r.text
    question = "Where is the Zorblax lantern festival held?"
    found = ask(client, question, topk=1).model_extra["documents"]
    assert [(d["id"], d["title"], d["text"]) for d in found] == [
        ("zorblax", "Zorblax festival", doc["text"])
    ]
    assert HTTP.delete(f"{url}/v1/documents/zorblax", timeout=60).status_code == 200
    after = ask(client, question, topk=3).model_extra["documents"]
    assert "zorblax" not in [d["id"] for d in after]


class HeldStream:
    """A streaming completion of ``max_tokens`` tokens (no EOS), read up to its first event."""

    def __init__(self, http: httpx.Client, max_tokens: int = LONG) -> None:
        body = {
            "model": "tiny",
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        request = http.build_request("POST", "/v1/completions", json=body)
        self.response = http.send(request, stream=True)
        assert self.response.status_code == 200
        self.lines = self.response.iter_lines()  # kept: dropping it closes the connection
        self.first = json.loads(next(line for line in self.lines if line).removeprefix("data: "))


def engine_idle(server) -> bool:
    stats = server.stats()
    return stats["num_running"] == 0 and stats["num_blocks_used"] == 0


def test_disconnect_mid_stream_frees_blocks(url: str, server) -> None:
    aborted = ("ragserve:requests_total", (("status", "aborted"), ("workflow", "completion")))
    before = samples(url).get(aborted, 0)
    with httpx.Client(base_url=url, timeout=60) as http:
        held = HeldStream(http)
        assert held.first["choices"][0]["finish_reason"] is None
        stats = server.stats()
        assert stats["num_running"] == 1 and stats["num_blocks_used"] > 0
        held.response.close()
    wait_for(lambda: engine_idle(server), "the aborted request's blocks to be freed")
    assert samples(url)[aborted] - before == 1


def test_burst_past_admission_is_429_while_health_answers(url: str, server) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=60) as http:
        held = [HeldStream(http) for _ in range(MAX_INFLIGHT)]
        assert server.stats()["num_running"] == MAX_INFLIGHT  # all still generating
        for _ in range(4):
            r = HTTP.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert HTTP.get(f"{url}/health", timeout=5).json()["status"] == "ok"
        for stream in held:
            stream.response.close()
    wait_for(lambda: engine_idle(server), "the held requests to be aborted")
    assert HTTP.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def test_auth_on_the_same_server(server) -> None:
    config = ServeConfig(port=0, api_key="k3y", served_model_name="tiny")
    with BackgroundServer(create_app(server, config), config) as bg:
        assert HTTP.get(f"{bg.url}/health").status_code == 200
        assert HTTP.get(f"{bg.url}/v1/models").status_code == 401
        bad = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model="tiny", prompt="x", max_tokens=2)
        good = openai.OpenAI(base_url=f"{bg.url}/v1", api_key="k3y", max_retries=0, timeout=60)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices


def test_graceful_shutdown_finishes_a_stream(server) -> None:
    config = ServeConfig(port=0, served_model_name="tiny", drain_timeout_s=60)
    bg = BackgroundServer(create_app(server, config), config).start()
    with httpx.Client(base_url=bg.url, timeout=60) as http:
        held = HeldStream(http, max_tokens=200)
        stopper = threading.Thread(target=bg.stop)
        stopper.start()
        wait_for(lambda: not bg._server.servers[0].is_serving(), "the listener to close")
        events = [line for line in held.lines if line]
    stopper.join(60)
    assert not stopper.is_alive()
    assert events[-1] == "data: [DONE]"
    text = held.first["choices"][0]["text"] + "".join(
        json.loads(e.removeprefix("data: "))["choices"][0]["text"] for e in events[:-1]
    )
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    assert text  # the whole answer arrived after shutdown began
