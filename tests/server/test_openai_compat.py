"""OpenAI compatibility with the official client against a live, co-scheduled Server on
loopback: finish_reason, system message and history, chat with the LLM itself, rejected
fields, usage of every node, embeddings, token metrics, ``/health``'s ``cosched``."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
from http_cases import HTTP
from prometheus_client.parser import text_string_to_metric_families

from ragserve.server import BackgroundServer, ServeConfig, create_app
from ragserve.server.graphs import tune_graph

pytestmark = pytest.mark.integration

HISTORY = [
    {"role": "system", "content": "You are a terse geography tutor."},
    {"role": "user", "content": "Tell me about Kenya."},
    {"role": "assistant", "content": "Kenya is in East Africa."},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    from ragserve.retrieval import Document, VectorIndex, load_embedder
    from ragserve.runtime import Server, ServerConfig
    from testing import make_tiny_model

    root = tmp_path_factory.mktemp("openai")
    model = str(make_tiny_model(root / "tiny-llama", "llama", seed=0))
    docs = [Document(f"{c}-cap", f"The capital of {c} is {k}.", c) for c, k in CAPITALS]
    index = VectorIndex.build(docs, load_embedder("all-minilm-l6-v2"), nlist=2)
    index.save(root / "index")
    index.close()
    # NOTE: prefix caching off: outputs are compared with a fresh engine's (see the runtime
    # conftest); the default co-scheduling stays on.
    engine = {"device": "cpu", "enable_prefix_caching": False}
    config = ServerConfig(in_process=True, engine_kwargs=engine)
    with Server(model, str(root / "index"), config=config) as server:
        serve = ServeConfig(port=0, served_model_name="tiny", max_num_inflight=4, tokenizer=model)
        with BackgroundServer(create_app(server, serve), serve) as bg:
            yield server, bg.url, model


CAPITALS = [("France", "Paris"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Japan", "Tokyo")]


@pytest.fixture(scope="module")
def oracle(stack):
    """A separate engine over the same model: what the LLM says for a list of messages."""
    from ragserve.generation import LLMEngine, SamplingParams

    engine = LLMEngine(stack[2], device="cpu", enable_prefix_caching=False)

    def run(messages: list[dict], max_tokens: int, stop: tuple[str, ...] = ()):
        prompt = engine.apply_chat_template(messages)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
        return engine.generate([prompt], params)[0]

    run.engine = engine
    return run


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack[1]}/v1", api_key="unused", max_retries=0, timeout=120)


def samples(url: str) -> dict:
    text = HTTP.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_chat_with_the_llm_itself_sees_system_message_and_history(client, oracle) -> None:
    messages = [*HISTORY, {"role": "user", "content": "And its capital?"}]
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0
    )
    expected = oracle(messages, 5)
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason == "length"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.token_ids) == 5
    assert out.model_extra["documents"] == []  # no retrieval
    alone = oracle(messages[-1:], 5)  # the history changes what the model sees
    assert len(alone.prompt_token_ids) < out.usage.prompt_tokens


def test_finish_reason_stop_when_a_stop_string_ends_the_answer(client, oracle) -> None:
    messages = [{"role": "user", "content": "Name a city."}]
    full = oracle(messages, 8).text
    assert len(full) > 4
    stop = full[3:5]
    expected = oracle(messages, 8, stop=(stop,))
    assert expected.finish_reason == "stop"
    kwargs = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    out = client.chat.completions.create(**kwargs, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == expected.text
    chunks = list(client.chat.completions.create(**kwargs, stop=[stop], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "stop"
    cut = list(client.chat.completions.create(**{**kwargs, "max_tokens": 2}, stream=True))
    assert cut[-1].choices[0].finish_reason == "length"


def test_history_reaches_the_answer_node_and_the_query_writer(stack, oracle) -> None:
    from ragserve.graph import State

    server = stack[0]
    graph = tune_graph(server.workflows["multistep"], max_tokens=4, topk=1)
    question = "What is the capital of Peru?"
    turns = tuple((m["role"], m["content"]) for m in HISTORY)
    single, multi = server.run(question, graph), server.run(question, graph, history=turns)
    assert single.error is None and multi.error is None
    assert "history" not in single.state  # single-turn requests are as before

    def prompt_tokens(node_id, state, history) -> int:
        text = graph.nodes[node_id].prompt.render(state)
        messages = [
            *({"role": r, "content": c} for r, c in history),
            {"role": "user", "content": text},
        ]
        return len(oracle.engine._tokenize(oracle.engine.apply_chat_template(messages)))

    for response, history in ((single, ()), (multi, turns)):
        runs = [t for t in response.node_timings if t.kind == "generation"]
        first, answer = runs[0], runs[-1]
        assert first.node_id == 0 and answer.node_id == 3 and answer.is_answer
        # node 0 writes the search query (with_history=True); its first run saw no notes
        assert first.num_prompt_tokens == prompt_tokens(0, State(input=question), history)
        assert answer.num_prompt_tokens == prompt_tokens(3, response.state, history)


def test_workflow_chat_single_turn_equals_server_run_and_usage_counts_every_node(
    client, stack
) -> None:
    server = stack[0]
    question = "What is the capital of Japan?"
    body = {"model": "ragserve/hyde", "messages": [{"role": "user", "content": question}]}
    out = client.chat.completions.create(**body, max_tokens=4, extra_body={"topk": 1})
    alone = server.run(question, tune_graph(server.workflows["hyde"], max_tokens=4, topk=1))
    assert out.choices[0].message.content == alone.output
    by_node = out.model_extra["usage_by_node"]
    assert [n["node"] for n in by_node] == [0, 2] and [n["is_answer"] for n in by_node] == [
        False,
        True,
    ]
    runs = [t for t in alone.node_timings if t.kind == "generation"]
    assert [n["prompt_tokens"] for n in by_node] == [t.num_prompt_tokens for t in runs]
    assert [n["completion_tokens"] for n in by_node] == [t.num_tokens for t in runs]
    assert out.usage.prompt_tokens == sum(t.num_prompt_tokens for t in runs)
    assert out.usage.completion_tokens == sum(t.num_tokens for t in runs)
    assert out.usage.completion_tokens > runs[-1].num_tokens  # the HyDE passage counts too
    chunks = list(
        client.chat.completions.create(
            **body,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"topk": 1},
        )
    )
    assert chunks[-1].usage == out.usage
    assert chunks[-1].model_extra["usage_by_node"] == by_node


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ("top_logprobs", 2),
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("logprobs", True),
        ("n", 2),
    ],
)
def test_unsupported_fields_are_400_naming_the_field(client, field, value) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="ragserve/oneshot",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            **{field: value},
        )
    assert info.value.param == field and field in info.value.message


def test_response_format_text_is_accepted(client) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "text"},
    )
    assert out.choices[0].finish_reason == "length"


def test_models_list_every_model_with_its_kind_and_embeddings_use_the_listed_id(client) -> None:
    from ragserve.retrieval import load_embedder

    kinds = {m.id: m.model_extra["kind"] for m in client.models.list()}
    assert kinds == {
        **{f"ragserve/{w}": "workflow" for w in ("oneshot", "hyde", "multistep", "irg", "recomp")},
        "tiny": "llm",
        "all-minilm-l6-v2": "embedding",
    }
    (embedder,) = [i for i, kind in kinds.items() if kind == "embedding"]
    assert client.models.retrieve(embedder).model_extra["kind"] == "embedding"
    texts = ["The capital of Kenya is Nairobi.", "Lima"]
    expected = load_embedder(embedder).encode(texts, is_query=False)
    default = client.embeddings.create(model=embedder, input=texts)  # base64 on the wire
    floats = client.embeddings.create(model=embedder, input=texts, encoding_format="float")
    for out in (default, floats):
        got = np.array([d.embedding for d in out.data], dtype=np.float32)
        assert got.shape == (2, 384) and [d.index for d in out.data] == [0, 1]
        np.testing.assert_allclose(got, expected, atol=1e-5)
        assert out.usage.prompt_tokens > 2
    raw = HTTP.post(
        f"{client.base_url}embeddings",
        json={"model": "all-minilm-l6-v2", "input": "Lima", "encoding_format": "base64"},
    ).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vector, expected[1], atol=1e-5)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="all-minilm-l6-v2", input="x", dimensions=8)
    assert info.value.param == "dimensions"


def test_metrics_count_chat_tokens_by_model_and_inter_token_latency(client, stack) -> None:
    url = stack[1]
    model = "ragserve/oneshot"
    tokens = ("ragserve:generation_tokens_total", (("model_name", model),))
    prompt = ("ragserve:prompt_tokens_total", (("model_name", model),))
    itl = ("ragserve:inter_token_latency_seconds_count", (("model_name", model),))
    before = samples(url)
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Capital of France?"}], max_tokens=5
    )
    after = samples(url)
    assert after[tokens] - before.get(tokens, 0) == out.usage.completion_tokens == 5
    assert after[prompt] - before.get(prompt, 0) == out.usage.prompt_tokens
    assert after[itl] - before.get(itl, 0) == 4  # five tokens, four gaps
    for name, labels in (tokens, prompt, itl):  # vLLM's names for the same measures
        vllm = name.replace("ragserve:", "vllm:")
        assert after[(vllm, labels)] == after[(name, labels)]
    ttft = ("vllm:time_to_first_token_seconds_count", (("workflow", "oneshot"),))
    e2e = ("vllm:e2e_request_latency_seconds_count", (("workflow", "oneshot"),))
    assert after[ttft] == after[("ragserve:time_to_first_token_seconds_count", ttft[1])] >= 1
    assert after[e2e] >= 1
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[(f"vllm:{gauge}", ())] == after[(f"ragserve:{gauge}", ())]
    assert after[("vllm:gpu_cache_usage_perc", ())] == after[("vllm:kv_cache_usage_perc", ())]


def test_tokenize_counts_what_the_engine_counts_and_detokenize_inverts_it(client, oracle) -> None:
    url = str(client.base_url).removesuffix("/v1/")
    messages = [*HISTORY, {"role": "user", "content": "And its capital?"}]
    chat = HTTP.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}).json()
    expected = oracle(messages, 1)
    assert chat["tokens"] == list(expected.prompt_token_ids)
    assert chat["count"] == len(expected.prompt_token_ids)
    plain = HTTP.post(f"{url}/tokenize", json={"prompt": "Once upon a time"}).json()
    completion = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=1)
    assert plain["count"] == completion.usage.prompt_tokens
    bare = HTTP.post(f"{url}/tokenize", json={"prompt": "Lima", "add_special_tokens": False})
    back = HTTP.post(f"{url}/detokenize", json={"tokens": bare.json()["tokens"]})
    assert back.json() == {"prompt": "Lima"}
    for path, body, status in (
        ("/tokenize", {"prompt": "x", "messages": messages}, 400),
        ("/tokenize", {"model": "ragserve/hyde", "prompt": "x"}, 404),
        ("/detokenize", {"tokens": [10**9]}, 400),
    ):
        assert HTTP.post(f"{url}{path}", json=body).status_code == status, (path, body)
    assert HTTP.get(f"{url}/version").json()["version"]


def test_async_client_and_its_stream_equal_the_sync_client(client) -> None:
    kwargs = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name a river."}],
        "max_tokens": 4,
        "temperature": 0,
        "seed": 1,
    }
    sync = client.chat.completions.create(**kwargs)

    async def run():
        async with openai.AsyncOpenAI(base_url=str(client.base_url), api_key="-") as aclient:
            out = await aclient.chat.completions.create(**kwargs)
            stream = await aclient.chat.completions.create(
                **kwargs, stream=True, stream_options={"include_usage": True}
            )
            return out, [c async for c in stream]

    out, chunks = asyncio.run(run())
    assert out.choices[0].message.content == sync.choices[0].message.content
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == sync.choices[0].message.content
    assert chunks[-1].usage == sync.usage


def test_health_and_stats_list_the_cosched_optimizations(stack) -> None:
    server, url, _ = stack
    enabled = ["split", "gen_chunks", "similarity", "speculation"]  # the defaults
    assert server.stats()["cosched"] == enabled
    assert HTTP.get(f"{url}/health").json() == {"status": "ok", "problems": [], "cosched": enabled}
