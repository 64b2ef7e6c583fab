"""The chat endpoint's `mode` / `filter` extensions tune every retrieval node; a bad filter is
a 400 naming the field."""

from __future__ import annotations

import openai
import pytest
from http_cases import HTTP
from server_fakes import FakeBackend

from ragserve.server import BackgroundServer, ServeConfig, create_app


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def url(backend: FakeBackend):
    config = ServeConfig(port=0, served_model_name="tiny")
    with BackgroundServer(create_app(backend, config), config) as bg:
        yield bg.url


def test_mode_and_filter_tune_retrieval_nodes(url: str, backend: FakeBackend) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    flt = {"source": "faq/library.rst", "year": {"gte": 2020}}
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "q"}],
        extra_body={"workflow": "recomp", "mode": "bm25", "filter": flt, "topk": 2},
    )
    _, graph = backend.questions[-1]
    node = graph.nodes[0]
    assert (node.mode, node.filter, node.topk) == ("bm25", flt, 2)
    assert backend.workflows["recomp"].nodes[0].mode is None  # the shared graph is untouched


@pytest.mark.parametrize(
    "extra, mentions",
    [
        ({"mode": "sparse"}, "mode"),
        ({"filter": {"year": {"near": 3}}}, "year"),
        ({"filter": ["source"]}, "filter"),
    ],
)
def test_bad_mode_or_filter_is_400(url: str, extra: dict, mentions: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], **extra}
    r = HTTP.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert mentions in r.json()["error"]["message"]
