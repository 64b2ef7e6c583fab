"""``create_app(server, config)``: the OpenAI-compatible ASGI app in front of a ``Server``.

Routes: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings`` (``chat.py``,
``completions.py``, ``embeddings.py``), ``/v1/models``, ``/v1/documents`` (upsert, delete),
``/metrics``, ``/health``. Every request passes ``GuardMiddleware`` (auth, body size) first;
errors use OpenAI's error format.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response as HTTPResponse

from ragserve.server import chat, completions, embeddings
from ragserve.server.admission import Admission
from ragserve.server.backend import ServerBackend
from ragserve.server.config import ServeConfig
from ragserve.server.context import AppContext, backend_error, get_context
from ragserve.server.errors import APIError, install_error_handlers
from ragserve.server.graphs import workflow_model_ids
from ragserve.server.metrics import ServerMetrics
from ragserve.server.middleware import GuardMiddleware
from ragserve.server.protocol import DocumentsRequest

logger = logging.getLogger(__name__)
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def create_app(server: ServerBackend, config: ServeConfig, *, own_server: bool = False) -> FastAPI:
    """Build the app. With ``own_server`` the app closes ``server`` at shutdown (after uvicorn
    has drained the in-flight requests); otherwise the caller owns it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # NOTE: the Server's async methods hand work to threads (asyncio.to_thread); size the
        # pool so admitted requests, upserts and scrapes never queue behind each other.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(config.max_num_inflight + 8, thread_name_prefix="ragserve-http")
        )
        yield
        if own_server:
            logger.info("closing the Server")
            await asyncio.to_thread(server.close)

    app = FastAPI(title="ragserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    admission = Admission(config.max_num_inflight, config.retry_after_s)
    metrics = ServerMetrics(server.stats, lambda: admission.num_inflight)
    app.state.ctx = AppContext(server, config, metrics, admission)
    install_error_handlers(app)
    app.add_middleware(
        GuardMiddleware, api_key=config.api_key, max_body_bytes=config.max_body_bytes
    )
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(embeddings.router)
    _add_admin_routes(app)
    return app


def _add_admin_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> dict:
        """``status`` and ``cosched``: the co-scheduling optimizations that run."""
        stats = await asyncio.to_thread(get_context(request).server.stats)
        return {"status": "ok", "cosched": list(stats.get("cosched", ()))}

    def model_cards(request: Request) -> list[dict]:
        ctx = get_context(request)
        ids = [*workflow_model_ids(ctx.server.workflows), ctx.config.served_model_name]
        card = {"object": "model", "created": int(time.time()), "owned_by": "ragserve"}
        return [{"id": i, **card} for i in ids]

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return {"object": "list", "data": model_cards(request)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        for card in model_cards(request):
            if card["id"] == model_id:
                return card
        raise APIError(404, f"model {model_id!r} does not exist", code="model_not_found")

    @app.get("/metrics")
    async def metrics(request: Request) -> HTTPResponse:
        ctx = get_context(request)
        body = await asyncio.to_thread(ctx.metrics.render)
        return HTTPResponse(body, media_type=PROMETHEUS_TEXT)

    @app.post("/v1/documents")
    async def upsert(body: DocumentsRequest, request: Request) -> dict:
        from ragserve.retrieval import Document

        ctx = get_context(request)
        docs = [Document(d.id, d.text, d.title, dict(d.metadata)) for d in body.documents]
        if len({d.id for d in docs}) != len(docs):
            raise APIError(400, "documents: duplicate ids in one request", param="documents")
        await _call(ctx.server.add_documents, docs)
        return {
            "object": "list",
            "data": [{"id": d.id, "object": "document", "status": "persisted"} for d in docs],
        }

    @app.delete("/v1/documents/{doc_id}")
    async def delete(doc_id: str, request: Request) -> dict:
        ctx = get_context(request)
        result = await _call(ctx.server.delete_documents, [doc_id])
        if result is not None and not result:
            raise APIError(404, f"document {doc_id!r} does not exist", code="document_not_found")
        return {"id": doc_id, "object": "document", "deleted": True}


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a (possibly blocking, possibly async) Server method without blocking the loop."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)
    except APIError:
        raise
    except Exception as exc:
        raise backend_error(exc) from exc
