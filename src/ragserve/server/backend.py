"""What the HTTP front needs from ``ragserve.runtime.Server``: exactly its public contract.

``create_app`` is typed against this ``Protocol`` so the front can be unit-tested with any
object that honours it; in production and integration tests it is the real ``Server``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any, Protocol


class ServerBackend(Protocol):
    """``ragserve.runtime.Server``: async requests, abort, upsert, workflows, stats.

    ``stream`` yields text deltas of the answer and hands the final ``Response`` to
    ``on_response`` before it ends; ``complete`` yields cumulative
    ``RequestOutput``s of a plain LLM completion; ``abort`` frees the request's KV blocks.
    ``add_documents`` / ``delete_documents`` return once the change is persisted; their
    failures carry a ``kind`` (``ragserve.runtime.WorkerError``) the front maps to a status.
    ``history`` (``(role, content)`` turns before the question) is passed only when a chat
    has any. ``embed(texts)`` (optional: ``/v1/embeddings`` is a 404 without it) returns
    ``Embeddings(vectors, num_tokens, model)``; ``stats()["cosched"]`` feeds ``/health``.
    """

    workflows: Mapping[str, Any]

    async def submit(
        self,
        question: str,
        graph: Any,
        *,
        request_id: str | None = None,
        history: Sequence[tuple[str, str]] = (),
    ) -> Any: ...

    def stream(
        self,
        question: str,
        graph: Any,
        *,
        request_id: str | None = None,
        on_response: Callable[[Any], Any] | None = None,
        history: Sequence[tuple[str, str]] = (),
    ) -> AsyncIterator[str]: ...

    def complete(
        self, prompt: str, params: Any, *, request_id: str | None = None
    ) -> AsyncIterator[Any]: ...

    def abort(self, request_id: str) -> None: ...

    def add_documents(self, docs: Sequence[Any]) -> Any: ...

    def delete_documents(self, doc_ids: Sequence[str]) -> Any: ...

    def stats(self) -> Mapping[str, Any]: ...

    def health(self) -> Mapping[str, Any]:
        """``{"status": "ok" | "unhealthy", "problems": [...]}`` (``/health`` answers 503
        unless ``"ok"``)."""
        ...

    def close(self) -> None: ...
