"""Which tokens of each reused passage to recompute.

A selector scores every token of the prompt (higher: recompute first); ``pick_rows`` then
takes ``ceil(ratio * n)`` top-scored tokens of each keyed segment of length ``n`` (ties: the
earlier token). Scores come from a cheap partial forward (``forward.py``):

- ``"qcfuse"`` (QCFuse-style, query-aware): the unkeyed tokens (instructions, question) run
  up to a probe layer over the stored passage KV; a token's score is the attention the
  query tokens (those after the last passage, else the last token) pay it at that layer,
  summed over heads and query tokens.
- ``"cacheblend"`` (CacheBlend-style, query-agnostic): every token runs the first layer with
  full attention; a token's score is how far its fresh layer-1 keys and values are from the
  stored ones (L2 over heads), the tokens whose KV deviates most from the isolated passage.
- ``"sift"`` (SIFT-style, query-agnostic, precomputed): when a passage is stored, the
  attention each of its tokens receives from the passage's own tokens at the probe layer
  (computed alone) is kept as its index; SIFT's cross-attention consistency says the keys
  that draw attention inside a document also draw it from what follows, so those tokens are
  recomputed. Selection costs no forward at request time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FUSION_SELECTORS = ("qcfuse", "cacheblend", "sift")


def query_rows(spans: Sequence[tuple[int, int, str | None]], num_tokens: int) -> list[int]:
    """Positions of the query: unkeyed tokens after the last keyed segment, else the last."""
    last_keyed_end = max((e for _, e, key in spans if key is not None), default=0)
    rows = list(range(last_keyed_end, num_tokens))
    return rows or [num_tokens - 1]


def attention_scores(probs: torch.Tensor, rows: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Per-token attention received from the ``query`` positions: ``probs`` is ``[heads,
    len(rows), num_tokens]`` for the computed ``rows``; returns ``[num_tokens]``."""
    picked = torch.isin(rows, query)
    return probs[:, picked].float().sum(dim=(0, 1))


def received_attention(probs: torch.Tensor) -> torch.Tensor:
    """``[n]`` attention each key receives, summed over heads and queries, from ``probs``
    ``[heads, n, n]`` (a passage attending to itself, causally)."""
    return probs.float().sum(dim=(0, 1))


def kv_deviation(fresh: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """``[num_tokens]`` L2 distance between fresh and stored ``[2, num_tokens, heads, dim]``."""
    diff = (fresh.float() - stored.float()).pow(2)
    return diff.sum(dim=(0, 2, 3)).sqrt()


def num_picked(num_tokens: int, ratio: float) -> int:
    """Tokens recomputed of a keyed segment of ``num_tokens``: ``ceil(ratio * n)``."""
    return min(num_tokens, math.ceil(ratio * num_tokens - 1e-9))


def pick_rows(
    scores: torch.Tensor, spans: Sequence[tuple[int, int, str | None]], ratio: float
) -> list[int]:
    """The top ``ceil(ratio * n)`` positions of each keyed segment by ``scores`` (sorted)."""
    picked: list[int] = []
    for start, end, key in spans:
        if key is None:
            continue
        num = num_picked(end - start, ratio)
        if num <= 0:
            continue
        seg = scores[start:end].float()
        # NOTE: stable descending sort so equal scores keep the earlier token first.
        order = torch.sort(-seg, stable=True).indices[:num].tolist()
        picked.extend(start + i for i in order)
    return sorted(picked)
