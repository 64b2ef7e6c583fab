"""A scripted backend honouring ``ServerBackend`` for unit tests of the HTTP layer only.

It answers deterministically from the question and can hold requests at a gate, so tests of
admission, disconnects and draining need no timing. Integration tests use the real Server.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from ragserve.workflows import oneshot, recomp


@dataclass
class FakeResponse:
    request_id: str
    output: str
    state: dict
    doc_ids: list[str]
    titles: list[str | None]
    timings: dict
    error: Any = None
    error_kind: str | None = None


@dataclass
class FakeOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)


def answer_for(question: str) -> str:
    return f"the answer to {question} is forty two"


class FakeBackend:
    """Answers ``answer_for(question)`` word by word; completion "tokens" are the prompt's
    words reversed. While ``gate`` is clear, every request waits before its first output."""

    def __init__(self) -> None:
        self.workflows = {"oneshot": oneshot(), "recomp": recomp()}
        self.gate = threading.Event()
        self.gate.set()
        self.aborted: list[str] = []
        self.running: set[str] = set()
        self.docs: dict[str, Any] = {}
        self.closed = False
        self.questions: list[tuple[str, Any]] = []
        self.histories: list[tuple] = []  # the ``history`` of each submit / stream
        self.fail_with: Exception | None = None  # raised by submit/stream/complete
        self.fail_response: tuple[str, str] | None = None  # (error, error_kind) of submit
        self.problems: list[str] = []  # what health() reports
        self.stuck_upserts = False
        self.unstuck = threading.Event()  # set by close()

    async def _wait_gate(self, request_id: str) -> None:
        self.running.add(request_id)
        while not self.gate.is_set():
            await asyncio.sleep(0.005)

    async def submit(self, question, graph, *, request_id=None, history=()):
        await self._wait_gate(request_id)
        self.running.discard(request_id)
        self.questions.append((question, graph))
        self.histories.append(tuple(history))
        if self.fail_with is not None:
            raise self.fail_with
        return self._response(question, request_id)

    def _response(self, question: str, request_id: str) -> FakeResponse:
        error, kind = self.fail_response or (None, None)
        return FakeResponse(
            request_id,
            answer_for(question),
            {},
            ["d1", "d2"],
            ["Doc one", None],
            {0: 0.002},
            error=error,
            error_kind=kind,
        )

    async def stream(self, question, graph, *, request_id=None, on_response=None, history=()):
        await self._wait_gate(request_id)
        try:
            self.questions.append((question, graph))
            self.histories.append(tuple(history))
            for i, word in enumerate(answer_for(question).split(" ")):
                yield word if i == 0 else " " + word
                await asyncio.sleep(0)
            if on_response is not None:
                on_response(self._response(question, request_id))
        finally:
            self.running.discard(request_id)

    async def complete(self, prompt, params, *, request_id=None):
        await self._wait_gate(request_id)
        try:
            tokens = prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]
            words = tokens[::-1][: params.max_tokens]  # token ids as the engine takes them too
            prompt_ids = list(range(len(tokens)))
            if not words:  # as the engine: an empty answer still ends with a finished output
                yield FakeOutput(request_id, prompt_ids, [], "", True, "stop")
            for n in range(1, len(words) + 1):
                done = n == len(words)
                reason = ("length" if n == params.max_tokens else "stop") if done else None
                text = " ".join(words[:n])
                yield FakeOutput(request_id, prompt_ids, list(range(n)), text, done, reason)
                await asyncio.sleep(0)
        finally:
            self.running.discard(request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    def add_documents(self, docs) -> None:
        if self.stuck_upserts:  # a worker that never answers, until the Server closes
            self.unstuck.wait()
            raise RuntimeError("the Server is closing")
        for doc in docs:
            self.docs[doc.id] = doc

    def delete_documents(self, doc_ids) -> int:
        return sum(self.docs.pop(i, None) is not None for i in doc_ids)

    def stats(self) -> dict:
        return {  # the shape of ragserve.runtime.Server.stats()
            "num_running": len(self.running),
            "num_waiting": 0,
            "num_blocks_used": 4 * len(self.running),
            "num_blocks_total": 64,
            "cosched": ["split", "similarity"],
            "engine": {"running": len(self.running)},
            "queues": {"generation_queue": 0},
        }

    def health(self) -> dict:
        return {
            "status": "unhealthy" if self.problems else "ok",
            "problems": list(self.problems),
            "cosched": ["split", "similarity"],
        }

    def close(self) -> None:
        self.closed = True
        self.unstuck.set()
