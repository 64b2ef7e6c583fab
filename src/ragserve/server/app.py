"""``create_app(server, config)``: the OpenAI-compatible ASGI app in front of a ``Server``:
the routers of the API's modules, ``/v1/documents``, ``/metrics``, ``/health`` (200 only while
the backend can make progress), ``/version``, every request through ``GuardMiddleware``."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse
from starlette.responses import Response as HTTPResponse

from ragserve.server import chat, completions, models
from ragserve.server.config import ServeConfig
from ragserve.server.context import Admission, AppContext, ServerBackend, call_backend, get_context
from ragserve.server.errors import APIError, install_error_handlers
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
        num_threads = config.max_num_inflight + config.max_num_upserts + 8
        pool = ThreadPoolExecutor(num_threads, thread_name_prefix="ragserve-http")
        asyncio.get_running_loop().set_default_executor(pool)
        yield
        pool.shutdown(wait=False, cancel_futures=True)
        if own_server:
            await _close_backend(server)

    app = FastAPI(title="ragserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    admission = Admission(config.max_num_inflight, config.retry_after_s)
    metrics = ServerMetrics(server.stats, lambda: admission.num_inflight)
    app.state.ctx = AppContext(server, config, metrics, admission)
    install_error_handlers(app)
    app.state.upserts = Admission(config.max_num_upserts, config.retry_after_s)
    app.add_middleware(GuardMiddleware, config=config)
    for module in (chat, completions, models):
        app.include_router(module.router)
    _add_admin_routes(app)
    return app


def _add_admin_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health(request: Request) -> HTTPResponse:
        report = dict(get_context(request).server.health())  # cheap, thread-safe: no thread
        report.setdefault("cosched", [])
        status = 200 if report.get("status") == "ok" else 503
        return JSONResponse(report, status_code=status)

    @app.get("/version")
    async def version() -> dict:
        try:
            return {"version": importlib.metadata.version("ragserve")}
        except importlib.metadata.PackageNotFoundError:  # run from a source tree
            return {"version": "unknown"}

    @app.get("/metrics")
    async def metrics(request: Request) -> HTTPResponse:
        body = await asyncio.to_thread(get_context(request).metrics.render)
        return HTTPResponse(body, media_type=PROMETHEUS_TEXT)

    @app.post("/v1/documents")
    async def upsert(body: DocumentsRequest, request: Request) -> dict:
        from ragserve.retrieval import Document

        docs = [Document(d.id, d.text, d.title, dict(d.metadata)) for d in body.documents]
        if len({d.id for d in docs}) != len(docs):
            raise APIError(400, "documents: duplicate ids in one request", param="documents")
        with request.app.state.upserts.admit():
            await call_backend(get_context(request).server.add_documents, docs)
        return {
            "object": "list",
            "data": [{"id": d.id, "object": "document", "status": "persisted"} for d in docs],
        }

    @app.delete("/v1/documents/{doc_id}")
    async def delete(doc_id: str, request: Request) -> dict:
        with request.app.state.upserts.admit():
            result = await call_backend(get_context(request).server.delete_documents, [doc_id])
        if result is not None and not result:
            raise APIError(404, f"document {doc_id!r} does not exist", code="document_not_found")
        return {"id": doc_id, "object": "document", "deleted": True}


async def _close_backend(server: ServerBackend) -> None:
    """``server.close()`` on a thread of its own: the pool's threads may all be blocked in
    backend calls, which only closing the Server wakes."""
    logger.info("closing the Server")
    closer = threading.Thread(target=server.close, name="ragserve-close", daemon=True)
    closer.start()
    while closer.is_alive():
        await asyncio.sleep(0.05)
