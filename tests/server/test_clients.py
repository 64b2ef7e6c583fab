"""Issue 29's acceptance: ``ragserve serve --api-key KEY`` (a real process) serves the clients
vLLM users already have, unchanged: the ``openai`` package (sync, async, streaming),
LangChain's ``ChatOpenAI`` / ``OpenAIEmbeddings`` and LlamaIndex's ``OpenAILike`` /
``OpenAILikeEmbedding`` complete chat, streaming chat and embeddings; a wrong key gets 401.

One server for the module. LangChain and LlamaIndex come with the ``clients`` extra
(``make test-all``): their tests are skipped where it is not installed.
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import openai
import pytest
from stacks import make_assets, serve_process

pytestmark = [pytest.mark.slow, pytest.mark.integration]

KEY = "sk-test-29"
QUESTION = "Tell me about the river Ix."


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("clients")
    model, index = make_assets(root)
    argv = [model, "--index", index, "--api-key", KEY, "--served-model-name", "tiny"]
    argv += ["--device", "cpu", "--cpu-threads", "1", "--in-process", "--max-model-len", "512"]
    env = {k: v for k, v in os.environ.items() if k != "RAGSERVE_API_KEY"}
    with serve_process(argv, root / "serve.log", env) as (_, url):
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def embedder(url: str) -> str:
    """The embedding model's id, as a client discovers it from ``/v1/models``."""
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    (name,) = [m.id for m in client.models.list() if m.model_extra["kind"] == "embedding"]
    return name


def _expected_vectors(name: str, texts: list[str]) -> np.ndarray:
    from ragserve.retrieval import load_embedder

    return load_embedder(name).encode(texts, is_query=False)


def test_openai_sync_async_streaming_and_embeddings(url: str, embedder: str) -> None:
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4}
    out = client.chat.completions.create(model="ragserve/oneshot", **chat)
    assert out.model_extra["documents"] and out.choices[0].message.content is not None
    chunks = list(client.chat.completions.create(model="tiny", stream=True, **chat))
    assert chunks[-1].choices[0].finish_reason == "length"

    async def run() -> tuple[str, list]:
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0) as aclient:
            one = await aclient.chat.completions.create(model="tiny", temperature=0, **chat)
            stream = await aclient.chat.completions.create(
                model="tiny", temperature=0, stream=True, **chat
            )
            return one.choices[0].message.content, [c async for c in stream]

    text, achunks = asyncio.run(run())
    assert "".join(c.choices[0].delta.content or "" for c in achunks) == text
    vectors = client.embeddings.create(model=embedder, input=[QUESTION, "Ix"])
    got = np.array([d.embedding for d in vectors.data], dtype=np.float32)
    np.testing.assert_allclose(got, _expected_vectors(embedder, [QUESTION, "Ix"]), atol=1e-5)
    wrong = openai.OpenAI(base_url=url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model="tiny", **chat)
    assert info.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model=embedder, input="Ix")


def test_langchain_chat_streaming_and_embeddings(url: str, embedder: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    common = {"base_url": url, "api_key": KEY, "max_retries": 0}
    llm = langchain_openai.ChatOpenAI(model="ragserve/oneshot", max_tokens=4, **common)
    answer = llm.invoke(QUESTION)
    assert isinstance(answer.content, str)
    tiny = langchain_openai.ChatOpenAI(model="tiny", max_tokens=4, temperature=0, **common)
    streamed = "".join(chunk.content for chunk in tiny.stream(QUESTION))
    assert streamed == tiny.invoke(QUESTION).content
    # check_embedding_ctx_length=False: token ids would come from tiktoken (OpenAI's models)
    emb = langchain_openai.OpenAIEmbeddings(
        model=embedder, check_embedding_ctx_length=False, **common
    )
    got = np.array(emb.embed_documents([QUESTION, "Ix"]), dtype=np.float32)
    np.testing.assert_allclose(got, _expected_vectors(embedder, [QUESTION, "Ix"]), atol=1e-5)
    wrong = langchain_openai.ChatOpenAI(model="tiny", **{**common, "api_key": "sk-wrong"})
    with pytest.raises(openai.AuthenticationError):
        wrong.invoke(QUESTION)


def test_llama_index_chat_streaming_and_embeddings(url: str, embedder: str) -> None:
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    embeddings_like = pytest.importorskip("llama_index.embeddings.openai_like")
    from llama_index.core.llms import ChatMessage

    common = {"api_base": url, "api_key": KEY, "max_retries": 0}
    llm = openai_like.OpenAILike(
        model="tiny", is_chat_model=True, max_tokens=4, temperature=0, **common
    )
    messages = [ChatMessage(role="user", content=QUESTION)]
    answer = llm.chat(messages).message.content
    streamed = [r.delta or "" for r in llm.stream_chat(messages)]
    assert "".join(streamed) == answer
    rag = openai_like.OpenAILike(model="ragserve/oneshot", is_chat_model=True, **common)
    assert isinstance(rag.chat(messages).message.content, str)
    emb = embeddings_like.OpenAILikeEmbedding(model_name=embedder, **common)
    got = np.array(emb.get_text_embedding_batch([QUESTION, "Ix"]), dtype=np.float32)
    np.testing.assert_allclose(got, _expected_vectors(embedder, [QUESTION, "Ix"]), atol=1e-5)
    wrong = openai_like.OpenAILike(model="tiny", is_chat_model=True, **{**common, "api_key": "x"})
    with pytest.raises(openai.AuthenticationError):
        wrong.chat(messages)
