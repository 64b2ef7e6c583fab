"""CacheWeaver's evidence ordering: put a request's passages in the order whose prompt prefix
is longest in the knowledge tree.

Greedy walk (CacheWeaver): starting from the fixed prefix, repeatedly append the passage that
extends the cached prefix the most; once no remaining passage extends it, the rest follow in
relevance order. The answer can change with the order (the model reads the passages in
another order), so this is approximate and off by default; its measured answer agreement is
in ``BENCHMARKS.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def order_evidence(
    num_passages: int,
    render: Callable[[Sequence[int]], list[int]],
    cached_tokens: Callable[[list[int]], int],
) -> list[int]:
    """A permutation of ``range(num_passages)`` (indices in relevance order).

    ``render(order)`` gives the token ids of the prompt up to and including the passages of
    ``order`` (a passage's rendering may depend only on the passage and its position);
    ``cached_tokens(ids)`` how many leading tokens of ``ids`` are cached.
    """
    if num_passages < 0:
        raise ValueError(f"num_passages must be >= 0, got {num_passages}")
    order: list[int] = []
    remaining = list(range(num_passages))
    matched = cached_tokens(render(order))
    while remaining:
        best, best_matched = None, matched
        for i in remaining:
            m = cached_tokens(render([*order, i]))
            if m > best_matched:
                best, best_matched = i, m
        if best is None:
            break
        order.append(best)
        remaining.remove(best)
        matched = best_matched
    return order + remaining
