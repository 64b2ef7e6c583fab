"""Which tokens of each reused passage to recompute: a selector scores every token and
``pick_rows`` takes the ``ceil(ratio * n)`` top-scored of each keyed segment. ``"qcfuse"``:
attention the query pays at a probe layer; ``"cacheblend"``: layer-1 KV deviation; ``"sift"``:
attention each token receives inside its passage alone."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ragserve.generation.segments import num_picked


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


def pick_rows(
    scores: torch.Tensor, spans: Sequence[tuple[int, int, str | None]], ratio: float
) -> list[int]:
    """The top ``ceil(ratio * n)`` positions of each keyed segment by ``scores`` (sorted); one
    device-to-host copy for all segments (each copy waits for the device)."""
    picked: list[torch.Tensor] = []
    for start, end, key in spans:
        if key is None:
            continue
        num = num_picked(end - start, ratio)
        if num <= 0:
            continue
        seg = scores[start:end].float()
        # NOTE: stable descending sort so equal scores keep the earlier token first.
        picked.append(torch.sort(-seg, stable=True).indices[:num] + start)
    return sorted(torch.cat(picked).tolist()) if picked else []
