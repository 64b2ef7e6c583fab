"""``GET /v1/models``: every model the server answers to, each with its ``kind`` (an
extension field): the workflows (``ragserve/<name>``, chat), the LLM itself (the served model
name: chat and completions) and the index's embedder (``/v1/embeddings``)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request

from ragserve.server.context import AppContext, call_backend, get_context
from ragserve.server.errors import APIError
from ragserve.server.graphs import workflow_model_ids

logger = logging.getLogger(__name__)
router = APIRouter()


async def embedder_id(ctx: AppContext) -> str | None:
    """The embedder's model id (asked of the backend once: ``embed`` names it), or ``None``
    when the backend has no embedder or cannot answer now."""
    if "embedder" not in ctx.cache:
        embed = getattr(ctx.server, "embed", None)
        if embed is None:
            return None
        try:
            ctx.cache["embedder"] = (await call_backend(embed, ["model"])).model
        except APIError as exc:  # e.g. the retrieval worker restarting: listed next time
            logger.warning("the embedder's name is unknown for now: %s", exc.message)
            return None
    return ctx.cache["embedder"]


async def model_cards(ctx: AppContext) -> list[dict]:
    kinds = [(i, "workflow") for i in workflow_model_ids(ctx.server.workflows)]
    kinds.append((ctx.config.served_model_name, "llm"))
    if (embedder := await embedder_id(ctx)) is not None:
        kinds.append((embedder, "embedding"))
    card = {"object": "model", "created": int(time.time()), "owned_by": "ragserve"}
    return [{"id": i, **card, "root": i, "parent": None, "kind": kind} for i, kind in kinds]


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": await model_cards(get_context(request))}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict:
    for card in await model_cards(get_context(request)):
        if card["id"] == model_id:
            return card
    raise APIError(404, f"model {model_id!r} does not exist", code="model_not_found")
