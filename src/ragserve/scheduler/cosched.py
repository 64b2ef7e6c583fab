"""Co-scheduling (HedraRAG §4.2-4.3), each optimization exact: ``CoScheduleConfig`` says which
run (built once at the edge; the runtime builds the transforms with ``make_transforms``), and
the transforms themselves:

- node splitting (``SplitTransform``, §4.2): retrieval tasks are marked to run in sub-stages of
  clusters under the time budget ``mb`` (the cutting is ``retrieval.staged``'s, exact), and
  generation tasks report in chunks of about ``mb`` of decode steps (``chunk_s``);
- similarity-aware search (``SimilarityTransform``, §4.3): each request's local cache of the
  clusters its last retrieval hit (``H_v``) and probed (``C_v``), so its next retrieval scans
  ``H_v`` first, then ``C_v``, then the rest (every probed cluster is still scanned: the top-k
  stays Faiss's); ``SpeculativeRetrievalTransform`` warms that cache early, searching with a
  generation's partial text when the next node retrieves with it;
- speculative generation (``SpeculationTransform``, §4.3, RAGCache §5.3): start the next
  greedy generation on a retrieval's partial top-k, while in-flight generations /
  ``capacity`` < ``tau``; adopt it if the final top-k is the same and the real task has exactly
  its prompt and parameters (so greedy decoding gives the same tokens), else abort it."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ragserve.graph import GenerationNode, RetrievalNode
from ragserve.scheduler.messages import (
    GenerationTask,
    GenerationUpdate,
    RetrievalPartial,
    RetrievalResult,
    RetrievalTask,
    StagedRetrievalResult,
    StagedRetrievalTask,
    Update,
    Wavefront,
    as_staged,
)
from ragserve.scheduler.scheduler import generation_task
from ragserve.scheduler.transforms import BaseTransform, TaskView


@dataclass(frozen=True)
class CoScheduleConfig:
    """Switches and knobs of the co-scheduling transforms (``make_transforms``): ``split``,
    ``gen_chunks`` (only with ``split``), ``similarity``, ``speculation`` (``spec_*``) and the
    opt-in ``spec_retrieval`` (needs ``similarity``). ``auto`` (the default): the ``Server``
    resolves it once its workers are up (``resolve``); ``auto=False``: the switches as given."""

    enable_split: bool = True
    enable_gen_chunks: bool = True
    enable_similarity: bool = True
    enable_speculation: bool = True
    budget_s: float | None = None
    cache_topk: int = 20
    spec_tau: float = 0.75
    spec_capacity: int = 64
    spec_first_clusters: int = 0
    spec_max_restarts: int = 1
    enable_spec_retrieval: bool = False
    spec_retrieval_fraction: float = 0.5
    auto: bool = True

    def __post_init__(self) -> None:
        if self.enable_spec_retrieval and not self.enable_similarity:
            raise ValueError("enable_spec_retrieval warms the similarity cache: enable both")

    @classmethod
    def none(cls) -> CoScheduleConfig:
        return cls(**_switches(()), auto=False)

    def resolve(self, tier_holds_index: bool) -> CoScheduleConfig:
        """The config that runs: ``auto`` turns every transform off when the GPU index tier
        holds every non-empty IVF list (a retrieval then takes less than the decode steps it
        would overlap: BENCHMARKS.md, issue 28); else the switches as given."""
        if self.auto and tier_holds_index:
            return replace(self, **_switches(()), auto=False)
        return replace(self, auto=False)

    @classmethod
    def from_names(cls, spec: str, **knobs: object) -> CoScheduleConfig:
        """``"auto"`` (the default: every transform, resolved by ``resolve``), ``"all"``
        (every transform, always), ``"off"``, or a comma list of ``OPTIMIZATIONS`` names:
        exactly those on. ``knobs`` set the other fields."""
        names = [n.strip() for n in spec.split(",") if n.strip()]
        knobs = {**knobs, "auto": names == ["auto"]}
        if names in (["all"], ["auto"]):
            return cls(**knobs)
        if names == ["off"] or names == ["none"]:
            return cls(**{**_switches(()), **knobs})
        unknown = [n for n in names if n not in OPTIMIZATIONS]
        if not names or unknown:
            raise ValueError(
                f"cosched: unknown optimization {', '.join(unknown) or repr(spec)}; use auto, "
                f"off, all or a comma list of {', '.join(OPTIMIZATIONS)}"
            )
        return cls(**{**_switches(names), **knobs})

    @property
    def enabled(self) -> tuple[str, ...]:
        on = [n for n in OPTIMIZATIONS if getattr(self, f"enable_{n}")]
        return tuple(n for n in on if n != "gen_chunks" or self.enable_split)


# The switchable optimizations, by the name ``--cosched`` and ``/health`` use.
OPTIMIZATIONS = tuple(
    f.name.removeprefix("enable_") for f in fields(CoScheduleConfig) if f.name.startswith("enable_")
)


def _switches(names: object) -> dict[str, bool]:
    return {f"enable_{n}": n in names for n in OPTIMIZATIONS}


def make_transforms(config: CoScheduleConfig) -> tuple[BaseTransform, ...]:
    out: list[BaseTransform] = []
    if config.enable_split:
        out.append(SplitTransform(config.budget_s, gen_chunks=config.enable_gen_chunks))
    if config.enable_similarity:
        similarity = SimilarityTransform(config.cache_topk)
        out.append(similarity)
        if config.enable_spec_retrieval:
            out.append(SpeculativeRetrievalTransform(similarity, config.spec_retrieval_fraction))
    if config.enable_speculation:
        out.append(
            SpeculationTransform(
                tau=config.spec_tau,
                capacity=config.spec_capacity,
                first_clusters=config.spec_first_clusters,
                max_restarts=config.spec_max_restarts,
            )
        )
    return tuple(out)


class SplitTransform(BaseTransform):
    """``budget_s`` fixes ``mb`` (None: the worker's Eq. 1 optimum). With ``gen_chunks``,
    generation tasks without their own ``chunk_s`` get ``mb``: ``budget_s``, else
    ``learned_budget_s``, the moving average (weight ``alpha``) of split results' sub-stage
    time (per-token updates until one is known)."""

    def __init__(
        self, budget_s: float | None = None, *, gen_chunks: bool = True, alpha: float = 0.2
    ) -> None:
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"budget_s must be > 0 or None, got {budget_s}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.budget_s = budget_s
        self.gen_chunks = gen_chunks
        self.alpha = alpha
        self.learned_budget_s: float | None = None
        self._split_ids: set[str] = set()  # retrieval tasks marked here, until their result

    @property
    def chunk_s(self) -> float | None:
        if not self.gen_chunks:
            return None
        return self.budget_s if self.budget_s is not None else self.learned_budget_s

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [
            as_staged(t, split=True, budget_s=self.budget_s) for t in wavefront.retrieval
        ]
        self._split_ids.update(t.task_id for t in wavefront.retrieval)
        chunk = self.chunk_s
        if chunk is not None:
            wavefront.generation = [
                t if t.chunk_s is not None else replace(t, chunk_s=chunk)
                for t in wavefront.generation
            ]
        return wavefront

    def on_updates(self, updates: list[Update]) -> list[Update]:
        for u in updates:
            if isinstance(u, RetrievalResult) and u.task_id in self._split_ids:
                self._split_ids.discard(u.task_id)
                if isinstance(u, StagedRetrievalResult) and u.error is None:
                    self._learn(u)
        return updates

    def _learn(self, result: StagedRetrievalResult) -> None:
        if result.num_substages < 2 or result.scan_seconds <= 0:
            return  # not cut: says nothing about mb
        mb = result.scan_seconds / result.num_substages
        old = self.learned_budget_s
        self.learned_budget_s = mb if old is None else (1 - self.alpha) * old + self.alpha * mb


@dataclass(frozen=True)
class CacheEntry:
    hit_clusters: tuple[int, ...]
    probed_clusters: tuple[int, ...]


class LocalCache:
    """Request id -> its latest ``CacheEntry``; least recently used requests dropped first."""

    def __init__(self, max_requests: int = 4096) -> None:
        self.max_requests = max_requests
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()

    def get(self, request_id: str) -> CacheEntry | None:
        entry = self._entries.get(request_id)
        if entry is not None:
            self._entries.move_to_end(request_id)
        return entry

    def put(self, request_id: str, entry: CacheEntry) -> None:
        self._entries[request_id] = entry
        self._entries.move_to_end(request_id)
        while len(self._entries) > self.max_requests:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class SimilarityTransform(BaseTransform):
    """Attach each request's cache entry to its retrieval tasks; refresh it from the results
    (``cache_topk``: how many best results' clusters are kept, 20 in the paper)."""

    def __init__(self, cache_topk: int = 20, max_requests: int = 4096) -> None:
        self.cache_topk = cache_topk
        self.cache = LocalCache(max_requests)
        self._task_request: dict[str, str] = {}
        self.num_reordered = 0

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [self._rewrite(t) for t in wavefront.retrieval]
        return wavefront

    def _rewrite(self, task: RetrievalTask) -> RetrievalTask:
        rid = getattr(task, "request_id", None)
        if rid is None:
            run = self.view.task(task.task_id) if self.view is not None else None
            if run is None:
                return task
            rid = run.request_id
        self._task_request[task.task_id] = rid
        staged = as_staged(task, request_id=rid)
        entry = self.cache.get(rid)
        if entry is not None:
            self.num_reordered += 1
            staged = replace(
                staged, hit_clusters=entry.hit_clusters, previous_clusters=entry.probed_clusters
            )
        return replace(staged, cache_topk=max(staged.cache_topk, self.cache_topk))

    def on_updates(self, updates: list[Update]) -> list[Update]:
        for u in updates:
            rid = (
                self._task_request.pop(u.task_id, None) if isinstance(u, RetrievalResult) else None
            )
            if rid is not None and isinstance(u, StagedRetrievalResult) and u.error is None:
                self.cache.put(rid, CacheEntry(u.hit_clusters, u.probed_clusters))
        return updates


SPEC_PREFIX = "specret/"  # task ids of speculative retrievals


class SpeculativeRetrievalTransform(BaseTransform):
    """Once a generation has ``fraction`` of its ``max_tokens``, and the node after it is a
    dense retrieval reading its output, search once with the partial text and warm
    ``similarity``'s cache with the result (never seen by the scheduler)."""

    needs_partial_updates = True  # it fires on a partial text

    def __init__(self, similarity: SimilarityTransform, fraction: float = 0.5) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        self.similarity = similarity
        self.fraction = fraction
        self.num_issued = 0
        self.num_warmed = 0
        self._done: set[str] = set()  # generation task ids already handled
        self._pending: dict[str, str] = {}  # speculative task id -> request id
        self._seq = itertools.count()

    def on_updates(self, updates: list[Update]) -> list[Update]:
        out: list[Update] = []
        issue: list[StagedRetrievalTask] = []
        for u in updates:
            if u.task_id in self._pending:
                rid = self._pending.pop(u.task_id)
                if isinstance(u, StagedRetrievalResult) and u.error is None:
                    self.similarity.cache.put(rid, CacheEntry(u.hit_clusters, u.probed_clusters))
                    self.num_warmed += 1
                continue
            out.append(u)
            if isinstance(u, GenerationUpdate) and not u.finished:
                task = self._maybe_issue(u)
                if task is not None:
                    issue.append(task)
            elif isinstance(u, GenerationUpdate):
                self._done.discard(u.task_id)
        if issue:
            self.view.submit_retrieval(issue)
        return out

    def _maybe_issue(self, update: GenerationUpdate) -> StagedRetrievalTask | None:
        task_id = update.task_id
        run = None if task_id in self._done else self.view.task(task_id)
        if run is None or not isinstance(run.node, GenerationNode):
            return None
        node = run.node
        # NOTE: the scheduler applies this update after the transforms: add it here
        if run.num_tokens + len(update.new_token_ids) < self.fraction * node.max_tokens:
            return None
        self._done.add(task_id)
        step = self.view.peek_next(run, run.partial_text + update.text_delta)
        if step is None or isinstance(step.node_id, tuple):
            return None
        target = run.graph.nodes.get(step.node_id)
        if not isinstance(target, RetrievalNode) or node.output not in target.inputs:
            return None
        if target.mode not in (None, "dense") or target.filter is not None:
            return None  # speculation reuses dense probe plans only
        spec_id = f"{SPEC_PREFIX}{next(self._seq)}/{task_id}"
        self._pending[spec_id] = run.request_id
        self.num_issued += 1
        return StagedRetrievalTask(
            spec_id,
            target.query.render(step.state),
            target.topk,
            target.nprobe,
            collapse_sections=False,  # only its clusters warm the cache; passages unused
            request_id=run.request_id,
            cache_topk=self.similarity.cache_topk,
        )


@dataclass
class _Spec:
    spec_id: str
    retrieval_task_id: str
    request_id: str
    node_id: Any
    task: GenerationTask
    doc_ids: tuple[str, ...]
    buffered: list[GenerationUpdate] = field(default_factory=list)
    confirmed: bool = False  # the final top-k equals the partial it started from
    adopted_as: str | None = None  # the real task id it stands for


@dataclass
class SpeculationStats:
    """Counters; ``accuracy`` = confirmed / resolved (HedraRAG's speculation accuracy)."""

    num_started: int = 0
    num_confirmed: int = 0
    num_wrong: int = 0  # final top-k differed: aborted
    num_adopted: int = 0
    num_aborted: int = 0  # all aborts (wrong docs, replaced partials, other routes)
    num_failed: int = 0  # ended with an error before adoption: dropped, the real task runs

    @property
    def accuracy(self) -> float | None:
        resolved = self.num_confirmed + self.num_wrong
        return None if resolved == 0 else self.num_confirmed / resolved


class SpeculationTransform(BaseTransform):
    """``first_clusters``: cut a first sub-stage of this many clusters, for an early
    partial; ``max_restarts``: how often a newer, different partial may replace a speculation."""

    def __init__(
        self, tau: float = 0.75, capacity: int = 64, first_clusters: int = 0, max_restarts: int = 1
    ) -> None:
        self.tau, self.capacity = tau, capacity
        self.first_clusters, self.max_restarts = first_clusters, max_restarts
        self.stats = SpeculationStats()
        self._specs: dict[str, _Spec] = {}  # spec id -> spec
        self._by_retrieval: dict[str, _Spec] = {}
        self._restarts: dict[str, int] = {}  # retrieval task id -> replacements so far
        self._replay: list[GenerationUpdate] = []
        self._running: set[str] = set()
        self._seq = 0

    def apply(self, wavefront: Wavefront) -> Wavefront:
        wavefront.retrieval = [self._with_partials(t) for t in wavefront.retrieval]
        kept = [t for t in wavefront.generation if not self._adopt(t)]
        self._drop_stale()
        self._running.update(t.task_id for t in kept)
        wavefront.generation = kept
        return wavefront

    def _with_partials(self, task):
        first = getattr(task, "first_clusters", 0) or self.first_clusters
        return as_staged(task, emit_partials=True, first_clusters=first)

    def _adopt(self, task: GenerationTask) -> bool:
        run = self.view.task(task.task_id)
        spec = self._match(run, task) if run is not None else None
        if spec is None:
            return False
        spec.adopted_as = task.task_id
        self.stats.num_adopted += 1
        # NOTE: ``_replay`` holds every adoption of this cycle: whether this speculation has
        # finished is read from its own updates, never from ``_replay[-1]`` (another
        # request's; docs/scale_out.md, the lost adopted task).
        replay = [replace(u, task_id=task.task_id) for u in spec.buffered]
        spec.buffered = []
        self._replay.extend(replay)
        if replay and replay[-1].finished:
            self._forget(spec)
        return True

    def _match(self, run: TaskView, task: GenerationTask) -> _Spec | None:
        for spec in self._specs.values():
            if spec.request_id != run.request_id or not spec.confirmed:
                continue
            # NOTE: the same work up to how updates are coalesced: the same greedy tokens
            same = replace(spec.task, task_id=task.task_id, chunk_s=task.chunk_s)
            if spec.adopted_as is None and spec.node_id == run.node_id and same == task:
                return spec
        return None

    def _drop_stale(self) -> None:
        for spec in list(self._specs.values()):
            if self._is_stale(spec):
                self._abort(spec)
        has_task = self.view.has_task
        self._running = {t for t in self._running if t in self._specs or has_task(t)}

    def _is_stale(self, spec: _Spec) -> bool:
        """Request gone; retrieval ended unconfirmed; confirmed but not adopted by the real
        task dispatched this cycle; or adopted by a task no longer running."""
        view = self.view
        if not view.is_active(spec.request_id):
            return True
        if not spec.confirmed:
            return not view.has_task(spec.retrieval_task_id)
        if spec.adopted_as is None:
            return True
        return spec.adopted_as not in view.running_task_ids(spec.request_id)

    def on_updates(self, updates: list[Update]) -> list[Update]:
        out: list[Update] = list(self._replay)
        self._replay = []
        for u in updates:
            if isinstance(u, RetrievalPartial):
                self._on_partial(u)
            elif isinstance(u, GenerationUpdate) and u.task_id in self._specs:
                out.extend(self._on_spec_update(self._specs[u.task_id], u))
            else:
                if isinstance(u, RetrievalResult):
                    self._on_final(u)
                elif isinstance(u, GenerationUpdate) and u.finished:
                    self._running.discard(u.task_id)
                out.append(u)
        return out

    def _on_spec_update(self, spec: _Spec, u: GenerationUpdate) -> list[Update]:
        if u.finished:
            self._running.discard(spec.spec_id)
        if spec.adopted_as is None and u.error is not None:
            self.stats.num_failed += 1
            self._forget(spec)  # e.g. its replica died: the real task will run as usual
            return []
        if spec.adopted_as is None:
            spec.buffered.append(u)
            return []
        if u.finished:
            self._forget(spec)
        return [replace(u, task_id=spec.adopted_as)]

    def _on_final(self, result: RetrievalResult) -> None:
        self._restarts.pop(result.task_id, None)
        spec = self._by_retrieval.get(result.task_id)
        if spec is None:
            return
        if result.error is None and _ids(result.passages) == spec.doc_ids:
            spec.confirmed = True
            self.stats.num_confirmed += 1
        else:
            self.stats.num_wrong += 1
            self._abort(spec)

    def _on_partial(self, partial: RetrievalPartial) -> None:
        run = self.view.task(partial.task_id)
        if run is None or not partial.passages:
            return
        old = self._by_retrieval.get(partial.task_id)
        if old is not None:
            if old.doc_ids == _ids(partial.passages):
                return
            restarts = self._restarts.get(partial.task_id, 0)
            if restarts >= self.max_restarts:
                return
            self._restarts[partial.task_id] = restarts + 1
            self._abort(old)
        if len(self._running) / self.capacity >= self.tau:
            return
        made = self._speculative_task(run, partial)
        if made is None:
            return
        task, node_id = made
        spec = _Spec(
            task.task_id, partial.task_id, run.request_id, node_id, task, _ids(partial.passages)
        )
        self._specs[spec.spec_id] = spec
        self._by_retrieval[partial.task_id] = spec
        # dispatched after the next wavefront; coalesced as the request's own task would be
        self.view.submit_generation([task], request_id=run.request_id)
        self._running.add(task.task_id)
        self.stats.num_started += 1

    def _speculative_task(self, run: TaskView, partial: RetrievalPartial) -> tuple | None:
        """The (task, node id) the scheduler would run next if ``partial`` were final."""
        if not isinstance(run.node, RetrievalNode):
            return None
        step = self.view.peek_next(run, list(partial.passages))
        if step is None or isinstance(step.node_id, tuple):
            return None
        node = run.graph.nodes.get(step.node_id)
        if not isinstance(node, GenerationNode) or node.temperature != 0.0:
            return None
        self._seq += 1
        task_id = f"spec/{self._seq}/{partial.task_id}"
        return generation_task(task_id, node, step.state), step.node_id

    def _abort(self, spec: _Spec) -> None:
        self.view.abort([spec.spec_id])  # dropped if not dispatched yet, else aborted
        self.stats.num_aborted += 1
        self._forget(spec)

    def _forget(self, spec: _Spec) -> None:
        self._specs.pop(spec.spec_id, None)
        self._running.discard(spec.spec_id)
        if self._by_retrieval.get(spec.retrieval_task_id) is spec:
            del self._by_retrieval[spec.retrieval_task_id]

    @property
    def num_in_flight(self) -> int:
        return len(self._specs)

    def check_integrity(self) -> None:
        for retrieval_task_id, spec in self._by_retrieval.items():
            assert self._specs.get(spec.spec_id) is spec, spec.spec_id
            assert spec.retrieval_task_id == retrieval_task_id, spec.spec_id
        for spec_id, spec in self._specs.items():
            assert spec.spec_id == spec_id
            assert spec.adopted_as is None or (spec.confirmed and not spec.buffered), spec_id
        assert not self._replay, "replayed updates left over after on_updates"


def _ids(passages) -> tuple[str, ...]:
    return tuple(p.doc_id for p in passages)
