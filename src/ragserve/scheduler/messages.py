"""The boundary between the scheduler and its workers: the plain dataclasses (picklable, no
torch) that cross it (tasks out, updates and results back) and ``BaseExecutor``, the contract
of what carries them."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Any

from ragserve.graph import Passage
from ragserve.graph.checks import check_sampling_of


@dataclass(frozen=True)
class GenerationParams:
    """``ragserve.generation.SamplingParams`` without importing the engine."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    fusion_ratio: float | None = None  # engine ``add_request(fusion_ratio=...)``, not sampling

    def __post_init__(self) -> None:
        check_sampling_of(self)

    @classmethod
    def from_any(cls, params: Any) -> GenerationParams:
        """The matching attributes of a ``SamplingParams``-like object or a ``GenerationNode``."""
        if isinstance(params, cls):
            return params
        values = {f.name: getattr(params, f.name) for f in fields(cls) if hasattr(params, f.name)}
        for key in ("stop", "stop_token_ids"):
            if key in values:
                values[key] = tuple(values[key] or ())
        return cls(**values)


@dataclass(frozen=True)
class GenerationTask:
    """Generate for ``prompt``; ``chat`` applies the chat template after ``history``'s
    ``(role, content)`` turns. ``chunk_s``: ``None`` sends an update per engine step, a number
    one per ``chunk_s`` seconds of steps (first token, final update and errors at once)."""

    task_id: str
    prompt: str | tuple[int, ...]
    params: GenerationParams
    chat: bool = True
    chunk_s: float | None = None
    history: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.chunk_s is not None and not self.chunk_s > 0:
            raise ValueError(f"chunk_s must be > 0 or None, got {self.chunk_s}")


@dataclass(frozen=True)
class RetrievalTask:
    """Return ``query``'s ``topk`` passages; the rest as ``VectorIndex.search_text`` (None:
    the index's defaults)."""

    task_id: str
    query: str
    topk: int
    nprobe: int | None = None
    mode: str | None = None
    filter: dict | None = None  # noqa: A003 - the retrieval API's name
    collapse_sections: bool | None = None


@dataclass(frozen=True)
class GenerationUpdate:
    """New text and token ids of one generation task since its last update."""

    task_id: str
    text_delta: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # sent with the first update only
    final_text: str | None = None  # the whole text (stop strings cut), with the last update
    error: str | None = None
    error_kind: str | None = None  # an ``ErrorKind`` with ``error`` (None: "internal")


@dataclass(frozen=True)
class RetrievalResult:
    """The passages found for one retrieval task, best first."""

    task_id: str
    passages: tuple[Passage, ...] = ()
    error: str | None = None
    error_kind: str | None = None  # an ``ErrorKind`` with ``error`` (None: "internal")


# Operators travel with the retrieval tasks and are answered with an ``OperatorResult``.
@dataclass(frozen=True)
class EmbedTask:
    """Embed ``texts`` (document side); ``single``: the value is ``[dim]``, not ``[n, dim]``."""

    task_id: str
    texts: tuple[str, ...]
    single: bool = False


@dataclass(frozen=True)
class RerankTask:
    task_id: str
    query: str
    passages: tuple[Passage, ...]
    topk: int


@dataclass(frozen=True)
class UpsertTask:
    """Upsert ``documents`` (``Document``s or strings); the value is the ids, once durable."""

    task_id: str
    documents: tuple[Any, ...]


OperatorTask = EmbedTask | RerankTask | UpsertTask


@dataclass(frozen=True)
class OperatorResult:
    """An operator's (or function / memory node's) ``value`` for the node's output, or
    ``error``."""

    task_id: str
    value: Any = None
    error: str | None = None
    error_kind: str | None = None  # an ``ErrorKind`` with ``error`` (None: "internal")


@dataclass(frozen=True)
class StagedRetrievalTask(RetrievalTask):
    """A retrieval run in sub-stages of clusters, answered by ``RetrievalPartial``s and one
    ``StagedRetrievalResult``. ``split``: sub-stages under the budget ``budget_s`` (None: Eq.
    1's); ``first_clusters`` > 0: a first sub-stage of that many; ``hit_clusters`` then
    ``previous_clusters`` are scanned first (the local cache); ``cache_topk``: report the
    clusters of that many best results; ``emit_partials``: a partial per sub-stage."""

    request_id: str | None = None
    split: bool = False
    budget_s: float | None = None
    first_clusters: int = 0
    hit_clusters: tuple[int, ...] = ()
    previous_clusters: tuple[int, ...] = ()
    cache_topk: int = 0
    emit_partials: bool = False


@dataclass(frozen=True)
class RetrievalPartial:
    """The top-k after ``num_substages`` sub-stages of a staged retrieval (not final)."""

    task_id: str
    passages: tuple[Passage, ...]
    num_substages: int
    finished: bool = False
    error: str | None = None


@dataclass(frozen=True)
class StagedRetrievalResult(RetrievalResult):
    """The final result, the clusters of the best ``cache_topk`` results and of every probe,
    and how the stage was cut."""

    hit_clusters: tuple[int, ...] = ()
    probed_clusters: tuple[int, ...] = ()
    num_substages: int = 1
    scan_seconds: float = 0.0


@dataclass
class Wavefront:
    """One cycle's ready tasks of all requests by resource (the engine; the retrieval
    worker's retrievals and operators); transforms may rewrite it before dispatch."""

    generation: list[GenerationTask] = field(default_factory=list)
    retrieval: list[RetrievalTask] = field(default_factory=list)
    operators: list[OperatorTask] = field(default_factory=list)


def as_staged(task: RetrievalTask, **changes: Any) -> StagedRetrievalTask:
    """``task`` as a ``StagedRetrievalTask`` (fields it already has kept), with ``changes``."""
    if isinstance(task, StagedRetrievalTask):
        return dataclasses.replace(task, **changes) if changes else task
    base = {f.name: getattr(task, f.name) for f in fields(RetrievalTask)}
    return StagedRetrievalTask(**base, **changes)


Update = GenerationUpdate | RetrievalResult | OperatorResult


class BaseExecutor(ABC):
    """Runs the scheduler's tasks (its only caller, one thread): generation tasks join the
    engine's batch, one cycle's retrieval tasks are searched as one batch. ``poll(timeout)``
    waits at most ``timeout`` for updates; every task gets a final update, possibly with
    ``error`` (also when a worker dies). ``abort``: no more updates for those generations.
    ``wake()`` (any thread, only with ``can_wake``) makes a waiting ``poll`` return."""

    can_wake: bool = False

    @abstractmethod
    def submit_generation(self, tasks: list[GenerationTask]) -> None: ...

    @abstractmethod
    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None: ...

    def submit_operators(self, tasks: list[OperatorTask]) -> None:
        """By default operators share the retrieval batch (told apart by type)."""
        self.submit_retrieval(tasks)  # type: ignore[arg-type]

    @abstractmethod
    def abort(self, task_ids: list[str]) -> None: ...

    @abstractmethod
    def poll(self, timeout: float) -> list[Update]: ...

    def wake(self) -> None:  # noqa: B027 - optional hook
        pass

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
