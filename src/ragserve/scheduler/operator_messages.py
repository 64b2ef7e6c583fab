"""Messages of the retrieval-worker operators (embed, rerank, upsert) and their one result type.

They travel like ``RetrievalTask``s (``BaseExecutor.submit_operators``: by default in the same
batch message to the retrieval worker), and ``RetrievalRunner.run`` answers each with an
``OperatorResult`` whose ``value`` is what the node writes into the state. Function and
memory nodes run in the server process and answer with the same ``OperatorResult``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragserve.graph import Passage


@dataclass(frozen=True)
class EmbedTask:
    """Embed ``texts`` (document side); ``single``: the node's input was one string, so the
    value is ``[dim]`` rather than ``[n, dim]``."""

    task_id: str
    texts: tuple[str, ...]
    single: bool = False


@dataclass(frozen=True)
class RerankTask:
    """Re-score ``passages`` against ``query``; keep the best ``topk``, best first."""

    task_id: str
    query: str
    passages: tuple[Passage, ...]
    topk: int


@dataclass(frozen=True)
class UpsertTask:
    """Upsert ``documents`` (``Document`` objects or strings, which get generated ids); the
    value is the list of ids, in order, once the index has made them durable."""

    task_id: str
    documents: tuple[Any, ...]


OperatorTask = EmbedTask | RerankTask | UpsertTask


@dataclass(frozen=True)
class OperatorResult:
    """The outcome of an operator task: ``value`` for the node's output, or ``error``."""

    task_id: str
    value: Any = None
    error: str | None = None
    error_kind: str | None = None  # an ``ErrorKind`` with ``error`` (None: "internal")
