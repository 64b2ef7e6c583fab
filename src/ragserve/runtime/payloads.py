"""How a results message's rows cross to the server, and reading them back. ``uses_arrow`` is
the one place that picks: an Arrow batch in a shared-memory slot when ``small_message_bytes
<= estimate <= slot_bytes``, else the rows pickled in the message (threshold measured:
``bench/message_threshold.py``, BENCHMARKS.md "Orchestration overhead"). Both carry the same
values."""

from __future__ import annotations

from typing import Any

from ragserve.runtime.arrow_batches import attach_retrieval, read_generation
from ragserve.runtime.shm import ShmRing
from ragserve.runtime.wire import GenerationResultsMsg, RetrievalResultsMsg

ROW_BYTES = 64  # a row's fixed part in the estimate (ids, flags, offsets)


def uses_arrow(num_bytes: int, small_message_bytes: int, slot_bytes: int) -> bool:
    """Whether rows of ``num_bytes`` (estimated) cross as Arrow in a shared-memory slot of
    ``slot_bytes`` (else pickled in the message)."""
    return small_message_bytes <= num_bytes <= slot_bytes


def generation_bytes(updates: list[Any]) -> int:
    """The estimated payload size of ``updates`` (``GenerationUpdate``s)."""
    total = 0
    for u in updates:
        total += ROW_BYTES + len(u.text_delta) + 8 * len(u.new_token_ids)
        total += 8 * len(u.prompt_token_ids) if u.prompt_token_ids else 0
        total += len(u.final_text) if u.final_text else 0
        total += len(u.error) if u.error else 0
    return total


def retrieval_bytes(results: list[Any]) -> int:
    """The estimated payload size of ``results`` (their passages; an operator result, which
    has none, counts its fixed part only)."""
    total = 0
    for r in results:
        total += ROW_BYTES
        for p in getattr(r, "passages", ()):
            total += 8 + len(p.doc_id) + len(p.text) + (len(p.title) if p.title else 0)
    return total


def read_results(msg: GenerationResultsMsg | RetrievalResultsMsg, ring: ShmRing) -> list[Any]:
    """The ``GenerationUpdate``s / retrieval results of ``msg``: its own rows when it carries
    no payload, else its payload read in place from ``ring`` (a slot is freed here).
    ``ValueError`` for a payload that does not match the message (``arrow_batches``)."""
    is_gen = isinstance(msg, GenerationResultsMsg)
    if msg.payload is None:
        rows = list(msg.updates) if is_gen else list(msg.results)
        if is_gen and tuple(u.task_id for u in rows) != msg.task_ids:
            raise ValueError("the message's updates are not those of its task ids")
        return rows
    read = read_generation if is_gen else attach_retrieval
    with ring.read(msg.payload) as batch:
        rows = read(msg.task_ids if is_gen else msg.results, batch)
        del batch
    return rows
