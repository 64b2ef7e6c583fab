"""Hostile input against the HTTP layer (real uvicorn on loopback, scripted backend): the
poison bodies of issue 11 are 400s naming the field, nothing is a 5xx, slow or silent sockets
are cut, 5xx bodies hold a request id and no internal text, /health tells the truth.

The same cases against the real Server and worker processes: test_hostile_real.py."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import pytest
from hostile_cases import CHAT, CMPL, DEEP_BODY, DOCS, POISON, chat, cmpl
from http_cases import HTTP
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_fakes import FakeBackend

from ragserve.retrieval import Document
from ragserve.retrieval.limits import DocumentLimits, check_document
from ragserve.server import BackgroundServer, ServeConfig, create_app
from ragserve.server.middleware import json_depth

HEADER_TIMEOUT = 0.3
BODY_TIMEOUT = 0.3
KEEP_ALIVE = 0.5


@pytest.fixture(scope="module")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="module")
def bg(backend: FakeBackend):
    config = ServeConfig(
        port=0,
        served_model_name="tiny",
        max_body_bytes=2 << 20,
        header_timeout_s=HEADER_TIMEOUT,
        body_timeout_s=BODY_TIMEOUT,
        keep_alive_s=KEEP_ALIVE,
        max_connections=16,
    )
    with BackgroundServer(create_app(backend, config), config) as server:
        yield server


def post(url: str, path: str, body) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    return HTTP.post(f"{url}{path}", headers=headers, timeout=30, **kwargs)


@pytest.mark.parametrize(("path", "body", "mentions"), POISON)
def test_poison_body_is_400_naming_the_field(bg, path: str, body, mentions: str) -> None:
    r = post(bg.url, path, body)
    assert r.status_code == 400, r.text
    assert mentions in r.json()["error"]["message"]
    assert r.headers["x-request-id"]


def test_json_nested_past_the_limit_is_400_before_parsing(bg) -> None:
    r = post(bg.url, CHAT, DEEP_BODY)
    assert r.status_code == 400 and "nests deeper" in r.json()["error"]["message"]
    # brackets inside strings do not count
    r = post(bg.url, CHAT, chat(messages=[{"role": "user", "content": "[" * 1000}]))
    assert r.status_code == 200, r.text


def test_json_depth_skips_strings_and_escapes() -> None:
    assert json_depth(b'{"a": "[[[[\\"[[", "b": [[1]]}') == 3
    assert json_depth(b"[]") == 1 and json_depth(b'"x"') == 0 and json_depth(b"") == 0
    assert json_depth(b'{"a": "\\\\"}') == 1
    assert json_depth(b"[" * 5000) == 5000
    assert json_depth(b'["unterminated [[[[') == 1


def test_document_limits_name_the_field() -> None:
    limits = DocumentLimits(max_text_chars=10, max_metadata_depth=2)
    check_document(Document("ok-1", "short", "T", {"a": {"b": 1}}), limits)
    cases = [
        (Document("a/b", "x"), "id"),
        (Document("", "x"), "id"),
        (Document("a", "x" * 11), "text"),
        (Document("a", "  "), "text"),
        (Document("a", "x", "\ud800"), "title"),
        (Document("a", "x", None, {"a": {"b": {"c": 1}}}), "metadata"),
        (Document("a", "x", None, {"a": float("nan")}), "metadata.a"),
        (Document("a", "x", None, {"a": object()}), "metadata.a"),
    ]
    for doc, field in cases:
        with pytest.raises(ValueError, match=field):
            check_document(doc, limits, "documents[0].")


def test_ids_the_api_accepts_it_can_delete(bg, backend: FakeBackend) -> None:
    ids = ["plain", "with space", "ünïcode-✓", "a?b#c%d", "x" * 256, "a:b@c;d"]
    body = {"documents": [{"id": i, "text": "A passage."} for i in ids]}
    assert post(bg.url, DOCS, body).status_code == 200
    for doc_id in ids:
        r = httpx.delete(f"{bg.url}/v1/documents/{quote(doc_id, safe='')}")
        assert r.status_code == 200 and r.json()["id"] == doc_id, (doc_id, r.text)


def test_internal_errors_hide_their_text_and_give_a_request_id(bg, backend) -> None:
    backend.fail_with = RuntimeError("/secret/path/model.bin exploded")
    try:
        r = post(bg.url, CHAT, chat())
        assert r.status_code == 500 and "secret" not in r.text
        assert "request id" in r.json()["error"]["message"]
    finally:
        backend.fail_with = None


def test_health_is_503_while_the_backend_cannot_make_progress(bg, backend) -> None:
    backend.problems = ["retrieval worker is not running"]
    try:
        r = httpx.get(f"{bg.url}/health")
        assert r.status_code == 503 and r.json()["problems"] == backend.problems
    finally:
        backend.problems = []
    assert httpx.get(f"{bg.url}/health").status_code == 200


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing ``sock``; fails if it is still open."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        pytest.fail(f"connection still open after {seconds} s (got {data!r})")
    return data


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response (headers and its Content-Length body) read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += sock.recv(4096)
    return data


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le"],
    ids=["nothing", "partial-headers"],
)
def test_slowloris_connections_are_cut(bg, sent: bytes) -> None:
    with socket.create_connection((bg.host, bg.port)) as sock:
        sock.sendall(sent)
        data = _closed_within(sock, HEADER_TIMEOUT + 5)
    if sent:
        assert data.startswith(b"HTTP/1.1 408")


def test_short_body_is_408(bg) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
    with socket.create_connection((bg.host, bg.port)) as sock:
        sock.sendall(head + b"content-type: application/json\r\n\r\n{")
        data = _closed_within(sock, BODY_TIMEOUT + 5)
    assert data.startswith(b"HTTP/1.1 408"), data


def test_kept_alive_connection_with_partial_next_request_is_cut(bg) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((bg.host, bg.port)) as sock:
        sock.sendall(request)
        assert _response(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")
        data = _closed_within(sock, HEADER_TIMEOUT + 5)
    assert data.startswith(b"HTTP/1.1 408")


def test_idle_kept_alive_connection_is_closed(bg) -> None:
    """After a complete request, an idle keep-alive connection is closed by the server once
    ``keep_alive_s`` has passed, without a further request."""
    with socket.create_connection((bg.host, bg.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200")
        assert _closed_within(sock, KEEP_ALIVE + 5) == b""


def test_connections_past_the_limit_get_503(bg) -> None:
    socks = [socket.create_connection((bg.host, bg.port)) for _ in range(16)]
    try:
        # NOTE: on a loaded machine the server may take a while to accept all 16.
        deadline = time.monotonic() + 10
        while (status := httpx.get(f"{bg.url}/health", timeout=5).status_code) != 503:
            assert status == 200 and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{bg.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline


# -- property-based fuzzing ---------------------------------------------------------------

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
)
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = {
    CHAT: [
        "model",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "topk",
        "nprobe",
        "n",
        "workflow",
        "max_completion_tokens",
        "stream_options",
    ],
    CMPL: [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "top_k",
        "ignore_eos",
        "echo",
        "logprobs",
        "n",
    ],
    DOCS: ["documents"],
}


@st.composite
def bodies(draw) -> tuple[str, dict]:
    """A valid base body with some fields replaced by arbitrary JSON."""
    path = draw(st.sampled_from(sorted(FIELDS)))
    base = {CHAT: chat(), CMPL: cmpl(), DOCS: {"documents": [{"id": "f", "text": "t"}]}}[path]
    for field in draw(st.lists(st.sampled_from(FIELDS[path]), max_size=3, unique=True)):
        base[field] = draw(JSON)
    return path, base


def _never_5xx(bg, case: tuple[str, dict]) -> None:
    path, body = case
    r = post(bg.url, path, json.dumps(body).encode())
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


FUZZ = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@settings(max_examples=25, **FUZZ)
@given(case=bodies())
def test_fuzzed_bodies_never_5xx(bg, case) -> None:
    _never_5xx(bg, case)


@pytest.mark.slow
@settings(max_examples=300, **FUZZ)
@given(case=bodies())
def test_fuzzed_bodies_never_5xx_long_run(bg, case) -> None:
    _never_5xx(bg, case)


def test_upserts_past_the_limit_get_429() -> None:
    """``max_num_upserts`` document calls may wait on the backend; the next one is a 429 with
    ``Retry-After`` at once; once the backend answers, the slots are free again."""
    backend = FakeBackend()
    backend.stuck_upserts = True
    config = ServeConfig(port=0, served_model_name="tiny", max_num_upserts=2)
    app = create_app(backend, config, own_server=True)
    server = BackgroundServer(app, config).start()
    body = {"documents": [{"id": "u", "text": "A passage."}]}
    try:
        with ThreadPoolExecutor(2) as pool:
            stuck = [pool.submit(post, server.url, DOCS, body) for _ in range(2)]
            deadline = time.monotonic() + 30
            while app.state.upserts.num_inflight < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            r = post(server.url, DOCS, body)
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            backend.stuck_upserts = False
            backend.unstuck.set()
            for f in stuck:
                f.result()  # answered (the fake's stuck calls end with an error)
        assert post(server.url, DOCS, body).status_code == 200
    finally:
        server.stop(timeout_s=30)


def test_shutdown_is_bounded_with_stuck_requests() -> None:
    """SIGTERM's path (uvicorn's graceful exit): drain for ``drain_timeout_s``, cancel, close
    the Server, which frees the threads blocked in it; the process can then exit."""
    backend = FakeBackend()
    backend.stuck_upserts = True
    config = ServeConfig(port=0, served_model_name="tiny", drain_timeout_s=0.3)
    app = create_app(backend, config, own_server=True)
    server = BackgroundServer(app, config).start()
    body = {"documents": [{"id": f"s{i}", "text": "A passage."} for i in range(1)]}
    with ThreadPoolExecutor(4) as pool:
        stuck = [pool.submit(post, server.url, DOCS, body) for _ in range(4)]
        deadline = time.monotonic() + 30
        while app.state.upserts.num_inflight < 4:  # all four blocked in the backend
            assert time.monotonic() < deadline
            time.sleep(0.02)
        start = time.monotonic()
        server.stop(timeout_s=30)
        # NOTE: uvicorn's thread ends after asyncio.run has joined the app's thread pool, so
        # this also says that every HTTP thread blocked in the backend has returned.
        assert not server._thread.is_alive(), "shutdown did not finish"
        assert time.monotonic() - start < 15 and backend.closed
        for f in stuck:
            with pytest.raises(httpx.HTTPError):
                f.result(timeout=30).raise_for_status()
