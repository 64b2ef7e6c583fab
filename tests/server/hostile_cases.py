"""Hostile request bodies (the findings of issue 11 and their neighbours), shared by the
HTTP-layer and the real-server tests: ``(path, body, a word the 400's message must contain)``.
Bodies are raw bytes where JSON escapes matter (a lone surrogate cannot be sent otherwise)."""

from __future__ import annotations

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
DOCS = "/v1/documents"
MSG = [{"role": "user", "content": "What is the capital of France?"}]


def chat(**extra) -> dict:
    return {"model": "ragserve/oneshot", "messages": MSG, "max_tokens": 4, **extra}


def cmpl(**extra) -> dict:
    return {"model": "tiny", "prompt": "The capital of", "max_tokens": 4, **extra}


def nested(depth: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def doc(**fields) -> dict:
    return {"documents": [{"id": "d1", "text": "A passage.", **fields}]}


SURROGATE_CHAT = (
    b'{"model": "ragserve/oneshot", "max_tokens": 4, '
    b'"messages": [{"role": "user", "content": "What \\ud800 is Python?"}]}'
)
SURROGATE_TITLE = b'{"documents": [{"id": "s1", "text": "A passage.", "title": "T \\udfff"}]}'

POISON = [
    # finding 1: one field crashed the generation worker
    (CMPL, cmpl(seed=2**64), "seed"),
    (CMPL, cmpl(seed=-(2**63) - 1), "seed"),
    (CMPL, cmpl(seed=-1), "seed"),
    (CMPL, cmpl(temperature=1e-45), "temperature"),
    (CMPL, cmpl(temperature=5e-324), "temperature"),
    (CMPL, cmpl(temperature=1e-39), "temperature"),
    (CMPL, cmpl(top_p=5e-324), "top_p"),
    (CMPL, cmpl(stream=True, seed=2**64), "seed"),
    (CHAT, chat(seed=2**64), "seed"),
    (CHAT, chat(temperature=1e-45), "temperature"),
    (CHAT, chat(stream=True, top_p=5e-324), "top_p"),
    (CMPL, b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    (CMPL, b'{"model": "tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
    # finding 2: deeply nested metadata
    (DOCS, doc(metadata=nested(600)), "deeper"),
    (DOCS, doc(metadata=nested(20)), "metadata"),
    (DOCS, doc(metadata={"k": "x" * 20_000}), "metadata"),
    # finding 3: a lone surrogate
    (CHAT, SURROGATE_CHAT, "surrogate"),
    (DOCS, SURROGATE_TITLE, "surrogate"),
    # finding 4: one oversized document
    (DOCS, doc(text="x" * 1_000_000), "text"),
    # smaller: loose types, ids the API could not delete
    (CMPL, cmpl(max_tokens="10"), "max_tokens"),
    (CMPL, cmpl(max_tokens=True), "max_tokens"),
    (CHAT, chat(max_tokens=10.0), "max_tokens"),
    (CHAT, chat(topk="3"), "topk"),
    (CHAT, chat(seed=True), "seed"),
    (CHAT, chat(temperature=True), "temperature"),
    (DOCS, doc(id="a/b"), "id"),
    (DOCS, doc(id="a\x00b"), "id"),
    (DOCS, doc(id="a\r\nb"), "id"),
    (DOCS, doc(id=".."), "id"),
    (DOCS, doc(id="x" * 300), "id"),
    (DOCS, doc(id=5), "id"),
]
DEEP_BODY = b"[" * 100_000 + b"]" * 100_000
