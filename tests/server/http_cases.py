"""Request bodies the HTTP front must refuse with a 400 naming the problem (shared by the
HTTP-layer and the integration tests): ``(path, body, a word the message must contain)``."""

from __future__ import annotations

import httpx

# NOTE: one client for the tests' plain requests: building an httpx.Client (its SSL context)
# costs more than a request on loopback.
HTTP = httpx.Client(timeout=60)
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "x"}]
MALFORMED = [
    (CHAT, b"{not json", "JSON"),
    (CHAT, b"[1, 2]", ""),
    (CHAT, {"model": "ragserve/oneshot"}, "messages"),
    (CHAT, {"messages": MSG}, "model"),
    (CHAT, {"model": 5, "messages": MSG}, "model"),
    (CHAT, {"model": "ragserve/oneshot", "messages": []}, "messages"),
    (CHAT, {"model": "ragserve/oneshot", "messages": "hello"}, "messages"),
    (CHAT, {"model": "ragserve/oneshot", "messages": [{"role": "wizard", "content": "x"}]}, "role"),
    (CHAT, {"model": "ragserve/oneshot", "messages": [{"role": "system", "content": "x"}]}, "user"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "stream": "yes"}, "stream"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "temperature": -1}, "temperature"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "temperature": "hot"}, "temperature"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "n": 2}, "n"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "topk": 0}, "topk"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "stop": ["ok", ""]}, "stop"),
    (CHAT, {"model": "ragserve/oneshot", "messages": MSG, "tools": [{"x": 1}]}, "tools"),
    (
        CHAT,
        {
            "model": "ragserve/oneshot",
            "messages": [{"role": "user", "content": [{"type": "image_url"}]}],
        },
        "content",
    ),
    ("/v1/completions", {"model": "tiny"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": 5}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [True, 3]}, "token ids"),
    ("/v1/completions", {"model": "tiny", "prompt": [-1]}, "token ids"),
    ("/v1/completions", {"model": "tiny", "prompt": []}, "token ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "echo": True}, "echo"),
    ("/v1/documents", {"documents": []}, "documents"),
    ("/v1/documents", {"documents": [{"text": "t"}]}, "id"),
    ("/v1/documents", {"documents": [{"id": "a", "text": ""}]}, "text"),
]
