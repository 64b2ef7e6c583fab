"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): the served LLM's tokenizer
(``ServeConfig.tokenizer``, loaded in this process on first use). A prompt is tokenized as
the engine does (special tokens added unless it starts with BOS); ``messages`` go through the
chat template first, as ``/v1/chat/completions`` does with the LLM itself."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request

from ragserve.server.context import AppContext, get_context
from ragserve.server.errors import APIError
from ragserve.server.protocol import DetokenizeRequest, TokenizeRequest

router = APIRouter()
_LOCK = threading.Lock()


def _load(ctx: AppContext) -> Any:
    with _LOCK:
        if "tokenizer" not in ctx.cache:
            from ragserve.generation.builtin import resolve_model
            from ragserve.generation.engine_setup import load_tokenizer

            ctx.cache["tokenizer"] = load_tokenizer(Path(resolve_model(ctx.config.tokenizer)))
    return ctx.cache["tokenizer"]


async def tokenizer_of(ctx: AppContext, model: str | None) -> Any:
    if model is not None and model != ctx.config.served_model_name:
        raise APIError(
            404,
            f"model {model!r} has no tokenizer here; the LLM is {ctx.config.served_model_name!r}",
            param="model",
            code="model_not_found",
        )
    tokenizer = None if ctx.config.tokenizer is None else await asyncio.to_thread(_load, ctx)
    if tokenizer is None:
        raise APIError(404, "this server has no tokenizer", code="model_not_found")
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
