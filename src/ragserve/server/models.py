"""The endpoints of the models themselves (no workflow): ``GET /v1/models`` (every model the
server answers to, with its ``kind``: the workflows ``ragserve/<name>``, the LLM itself under
the served model name, the index's embedder), ``POST /v1/embeddings`` (the embedder's vectors,
document side) and vLLM's ``POST /tokenize`` / ``/detokenize`` (the LLM's tokenizer,
``ServeConfig.tokenizer``, loaded in this process on first use)."""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from ragserve.server.context import AppContext, call_backend, get_context
from ragserve.server.errors import APIError, model_not_found
from ragserve.server.graphs import workflow_model_ids
from ragserve.server.protocol import DetokenizeRequest, EmbeddingRequest, TokenizeRequest

logger = logging.getLogger(__name__)
router = APIRouter()
_LOCK = threading.Lock()


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
    raise model_not_found(f"model {model_id!r} does not exist", param=None)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    """``model`` names the embedder (its id in ``/v1/models``) or the served model name."""
    ctx = get_context(request)
    embed = getattr(ctx.server, "embed", None)
    if embed is None:
        raise model_not_found("this server has no embedder", param=None)
    out = await call_backend(embed, body.texts())
    ctx.cache["embedder"] = out.model
    if body.model not in (out.model, ctx.config.served_model_name):
        raise model_not_found(f"model {body.model!r} does not exist; the embedder is {out.model!r}")
    vectors = np.asarray(out.vectors, dtype=np.float32)
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise APIError(
            400,
            f"dimensions: the embedder gives {vectors.shape[1]}, not {body.dimensions}",
            param="dimensions",
        )
    ctx.metrics.embedding_tokens.labels(out.model).inc(out.num_tokens)
    if body.encoding_format == "base64":  # little-endian float32, as OpenAI's
        rows = [base64.b64encode(row.astype("<f4").tobytes()).decode() for row in vectors]
    else:
        rows = vectors.tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(rows)],
        "model": body.model,
        "usage": {"prompt_tokens": out.num_tokens, "total_tokens": out.num_tokens},
    }


def _load_tokenizer(ctx: AppContext) -> Any:
    with _LOCK:
        if "tokenizer" not in ctx.cache:
            from ragserve.generation.builtin import resolve_model
            from ragserve.generation.engine_setup import load_tokenizer

            ctx.cache["tokenizer"] = load_tokenizer(Path(resolve_model(ctx.config.tokenizer)))
    return ctx.cache["tokenizer"]


async def tokenizer_of(ctx: AppContext, model: str | None) -> Any:
    if model is not None and model != ctx.config.served_model_name:
        llm = ctx.config.served_model_name
        raise model_not_found(f"model {model!r} has no tokenizer here; the LLM is {llm!r}")
    tokenizer = (
        None if ctx.config.tokenizer is None else await asyncio.to_thread(_load_tokenizer, ctx)
    )
    if tokenizer is None:  # none configured, or the LLM's folder holds none
        raise model_not_found("this server has no tokenizer", param=None)
    return tokenizer


def chat_prompt(tokenizer: Any, messages: list[dict], add_generation_prompt: bool) -> str:
    """The engine's prompt for ``messages`` (``LLMEngine.apply_chat_template``)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant:" if add_generation_prompt else "")


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """A prompt is tokenized as the engine does (special tokens unless it starts with BOS);
    ``messages`` go through the chat template first."""
    tokenizer = await tokenizer_of(get_context(request), body.model)
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = chat_prompt(tokenizer, messages, body.add_generation_prompt)
    else:
        text = body.prompt
    add_special = body.add_special_tokens
    if add_special is None:  # as the engine: no second BOS
        bos = getattr(tokenizer, "bos_token", None)
        add_special = not (bos and text.startswith(bos))
    ids = list(tokenizer(text, add_special_tokens=add_special)["input_ids"])
    return {"count": len(ids), "tokens": ids, "token_strs": None}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    tokenizer = await tokenizer_of(get_context(request), body.model)
    if body.tokens and max(body.tokens) >= len(tokenizer):
        raise APIError(400, f"tokens: ids must be < {len(tokenizer)}", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
