"""The small dataclasses that cross from the scheduler to the workers and back.

Everything here is plain data (picklable, no torch): the runtime ships these between
processes, the in-process executor passes them by reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ragserve.graph import Passage
from ragserve.graph.checks import check_sampling


@dataclass(frozen=True)
class GenerationParams:
    """Mirror of ``ragserve.generation.SamplingParams`` without importing the engine."""

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
        check_sampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
        )

    @classmethod
    def for_node(cls, node: Any) -> GenerationParams:
        """The sampling a ``GenerationNode`` asks for."""
        return cls(
            max_tokens=node.max_tokens,
            temperature=node.temperature,
            top_p=node.top_p,
            seed=node.seed,
            stop=node.stop,
            ignore_eos=node.ignore_eos,
            fusion_ratio=node.fusion_ratio,
        )

    @classmethod
    def from_any(cls, params: Any) -> GenerationParams:
        """Copy the matching attributes of any SamplingParams-like object."""
        if isinstance(params, cls):
            return params
        values = {f.name: getattr(params, f.name) for f in fields(cls) if hasattr(params, f.name)}
        for key in ("stop", "stop_token_ids"):
            if key in values:
                values[key] = tuple(values[key] or ())
        return cls(**values)


@dataclass(frozen=True)
class GenerationTask:
    """Generate for ``prompt``; ``chat`` wraps it as a user message with the chat template,
    after the ``(role, content)`` turns of ``history`` (a system message, earlier turns).

    ``chunk_s`` (node splitting, generation side): ``None`` sends an update after every engine
    step that gives the task a token. A number coalesces them into sub-stages of decode steps:
    a non-final update goes out once the engine steps since the task's last update add up to
    ``chunk_s`` seconds; the first token, the final update and errors go out at once. The
    concatenated deltas and token ids are the same either way.
    """

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
    """Embed ``query`` and return its ``topk`` passages (``nprobe=None``: index default;
    ``mode``/``filter``/``collapse_sections``: as ``VectorIndex.search_text``, None = the
    index's defaults, unfiltered)."""

    task_id: str
    query: str
    topk: int
    nprobe: int | None = None
    mode: str | None = None
    filter: dict | None = None  # noqa: A003 - the retrieval API's name
    collapse_sections: bool | None = None


@dataclass(frozen=True)
class GenerationUpdate:
    """Progress of one generation task: new text and token ids since the last update."""

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


# -- operators (embed, rerank, upsert) --------------------------------------------------------
# They travel like ``RetrievalTask``s (``BaseExecutor.submit_operators``), and the retrieval
# runner answers each with an ``OperatorResult`` whose ``value`` the node writes into the state;
# function and memory nodes, run in the server process, answer with the same type.
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


# -- staged retrieval (a retrieval node cut into cluster sub-stages) --------------------------
# Back come ``RetrievalPartial``s (for the transforms only) and one ``StagedRetrievalResult``.
@dataclass(frozen=True)
class StagedRetrievalTask(RetrievalTask):
    """A retrieval run in sub-stages of clusters.

    - ``split``: pack each sub-stage under the time budget ``mb`` (``budget_s``, or Eq. 1's
      optimum from the worker's measurements when ``None``); ``False``: one sub-stage.
    - ``first_clusters``: when > 0, the first sub-stage scans exactly this many clusters
      (an early partial result for speculation even without budget splitting).
    - ``hit_clusters`` / ``previous_clusters``: the request's local cache (HedraRAG §4.3):
      scan probed clusters in ``hit_clusters`` first, then those in ``previous_clusters``,
      then the rest (each group in coarse order). Exact: every probed cluster is scanned.
    - ``cache_topk``: also report the clusters of this many best results (the local cache).
    - ``emit_partials``: send a ``RetrievalPartial`` after every non-final sub-stage.
    """

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
    """The final result plus the local-cache data and how the stage was cut.

    ``hit_clusters``: clusters holding the best ``cache_topk`` results; ``probed_clusters``:
    every cluster this retrieval scanned (coarse order); ``num_substages``: how many
    sub-stages it took; ``scan_seconds``: the scan time attributed to it.
    """

    hit_clusters: tuple[int, ...] = ()
    probed_clusters: tuple[int, ...] = ()
    num_substages: int = 1
    scan_seconds: float = 0.0


@dataclass
class Wavefront:
    """The ready work of one scheduling cycle, across all active requests, by resource:
    ``generation`` (the engine), ``retrieval`` and ``operators`` (embed / rerank / upsert
    tasks: the retrieval worker). Function nodes go to the CPU pool and memory nodes run
    inline; neither passes through the wavefront.

    Transformations (``scheduler.transforms``) may rewrite it before dispatch.
    """

    generation: list[GenerationTask] = field(default_factory=list)
    retrieval: list[RetrievalTask] = field(default_factory=list)
    operators: list[OperatorTask] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.generation or self.retrieval or self.operators)
