"""``POST /v1/embeddings``: vectors of the index's own embedder (``Server.embed``), in
OpenAI's ``list`` of ``embedding`` objects; ``model`` names that embedder (its id in
``/v1/models``) or the served model name (the deployment). Vectors are L2-normalised,
document side."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request

from ragserve.server.context import call_backend, get_context
from ragserve.server.errors import APIError
from ragserve.server.protocol import EmbeddingRequest

router = APIRouter()


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    ctx = get_context(request)
    embed = getattr(ctx.server, "embed", None)
    if embed is None:
        raise APIError(404, "this server has no embedder", code="model_not_found")
    out = await call_backend(embed, body.texts())
    ctx.cache["embedder"] = out.model
    if body.model not in (out.model, ctx.config.served_model_name):
        raise APIError(
            404,
            f"model {body.model!r} does not exist; the embedder is {out.model!r}",
            param="model",
            code="model_not_found",
        )
    vectors = np.asarray(out.vectors, dtype=np.float32)
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise APIError(
            400,
            f"dimensions: the embedder gives {vectors.shape[1]}, not {body.dimensions}",
            param="dimensions",
        )
    ctx.metrics.embedding_tokens.labels(out.model).inc(out.num_tokens)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(row, body.encoding_format)}
        for i, row in enumerate(vectors)
    ]
    return {
        "object": "list",
        "data": data,
        "model": body.model,
        "usage": {"prompt_tokens": out.num_tokens, "total_tokens": out.num_tokens},
    }


def _encode(row: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's
        return base64.b64encode(row.astype("<f4").tobytes()).decode()
    return row.tolist()
