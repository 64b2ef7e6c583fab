"""``StagedRetrievalRunner``: the retrieval work, shared by every executor. ``run`` searches a
batch at once, runs its operator tasks and advances ``StagedRetrievalTask``s one sub-stage per
call (``retrieval/staged.py``) while ``has_pending()``; a collapsed staged task is searched
``FETCH_FACTOR`` times deeper and collapsed at the end (as ``search_text`` would collapse it).
Operator tasks: embed (one embedder call per batch), rerank (ties keep the input order), upsert
(strings get ``uuid5`` ids from the task id, so a retry writes the same ids)."""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ragserve.graph import Passage
from ragserve.retrieval.collapse import FETCH_FACTOR, collapse_hits
from ragserve.retrieval.staged import StagedSearch, StageParams, StageProgress
from ragserve.retrieval.types import ScoredDocument
from ragserve.runtime.errors import failed_result, isolated
from ragserve.scheduler import RetrievalResult, RetrievalTask
from ragserve.scheduler.messages import (
    EmbedTask,
    OperatorResult,
    RerankTask,
    RetrievalPartial,
    StagedRetrievalResult,
    StagedRetrievalTask,
    UpsertTask,
)

if TYPE_CHECKING:
    from ragserve.retrieval.index_tier import TierSpec

logger = logging.getLogger(__name__)

OPERATOR_TASKS = (EmbedTask, RerankTask, UpsertTask)


class Embeddings(NamedTuple):
    """``vectors`` ``[n, dim]`` float32 (normalised), ``num_tokens`` read, ``model`` name."""

    vectors: np.ndarray
    num_tokens: int
    model: str


class StagedRetrievalRunner:
    """Owns the embedder and the ``VectorIndex``; a task that fails, fails alone."""

    def __init__(self, index: Any, embedder: Any, default_nprobe: int | None = None) -> None:
        from ragserve.retrieval.limits import DocumentLimits

        self.index = index
        self.embedder = embedder
        self.default_nprobe = default_nprobe
        self.reranker: Any = None
        self.document_limits = DocumentLimits()
        self.search = StagedSearch(index)
        self._tasks: dict[str, StagedRetrievalTask] = {}
        self._collapsed: set[str] = set()  # active task ids whose passages are collapsed

    @classmethod
    def build(
        cls,
        index: Any,
        embedder: Any = None,
        default_nprobe: int | None = None,
        *,
        tier: TierSpec | None = None,
        reranker: str = "embedding",
    ) -> StagedRetrievalRunner:
        """A runner over ``index`` (a folder or a live index) with ``tier`` placed on it;
        ``embedder``: a name or path, a live one, or ``None`` (the index's own)."""
        from ragserve.retrieval import VectorIndex, load_embedder
        from ragserve.retrieval.rerank import load_reranker

        if isinstance(index, (str, Path)):
            index = VectorIndex.load(str(index))
        if tier is not None:
            tier.place(index)
        if embedder is None or isinstance(embedder, (str, Path)):
            embedder = load_embedder(index.embedder_name if embedder is None else str(embedder))
        runner = cls(index, embedder, default_nprobe)
        runner.reranker = load_reranker(reranker, embedder)
        return runner

    def has_pending(self) -> bool:
        return self.search.has_pending()

    def run(self, tasks: list[RetrievalTask]) -> list:
        """The operator and one-shot tasks' results, in order (``search_text`` for a filter, a
        non-dense mode or collapsing, else one Faiss search per ``nprobe``); then the staged
        tasks that failed to start, and the updates of one sub-stage of the active ones."""
        ops = [t for t in tasks if isinstance(t, OPERATOR_TASKS)]
        tasks = [t for t in tasks if not isinstance(t, OPERATOR_TASKS)]
        staged = [
            t for t in tasks if isinstance(t, StagedRetrievalTask) and not self.needs_text_search(t)
        ]
        plain = [t for t in tasks if t not in staged]
        by_text = [t for t in plain if self.needs_text_search(t) or self.collapses(t)]
        vector = [t for t in plain if t not in by_text]
        done = {
            r.task_id: r
            for r in (*self._operators(ops), *self._by_text(by_text), *self._search(vector))
        }
        updates: list = [done[t.task_id] for t in (*ops, *plain)]
        if staged:
            updates.extend(isolated(self._add, staged, failed_result))
        if self.search.has_pending():
            updates.extend(self._step())
        return updates

    def _operators(self, tasks: list) -> list[OperatorResult]:
        """One ``OperatorResult`` per operator task; a bad task fails alone."""
        embeds = [t for t in tasks if isinstance(t, EmbedTask)]
        results = isolated(self._embed_tasks, embeds, failed_result) if embeds else []
        for t in tasks:
            if not isinstance(t, EmbedTask):
                try:
                    value = self._rerank(t) if isinstance(t, RerankTask) else self._upsert(t)
                    results.append(OperatorResult(t.task_id, value))
                except Exception as exc:
                    results.append(failed_result(t, exc))
        return results

    def _embed_tasks(self, tasks: list[EmbedTask]) -> list[OperatorResult]:
        texts = [text for t in tasks for text in t.texts]
        vectors = np.asarray(self.embedder.encode(texts, is_query=False), dtype=np.float32)
        ends = list(itertools.accumulate(len(t.texts) for t in tasks))
        return [
            OperatorResult(t.task_id, rows[0].copy() if t.single else rows.copy())
            for t, rows in zip(tasks, np.split(vectors, ends[:-1]), strict=True)
        ]

    def _rerank(self, task: RerankTask) -> list[Passage]:
        if self.reranker is None:
            from ragserve.retrieval.rerank import EmbeddingReranker

            self.reranker = EmbeddingReranker(self.embedder)
        texts = [f"{p.title}: {p.text}" if p.title else p.text for p in task.passages]
        scores = np.asarray(self.reranker.score(task.query, texts), dtype=np.float32)
        if scores.shape != (len(texts),):
            raise RuntimeError(f"reranker returned {scores.shape} scores for {len(texts)} passages")
        order = np.argsort(-scores, kind="stable")[: task.topk]
        passages = task.passages
        return [
            Passage(passages[i].doc_id, passages[i].text, passages[i].title, float(scores[i]))
            for i in order
        ]

    def _upsert(self, task: UpsertTask) -> list[str]:
        from ragserve.retrieval import Document
        from ragserve.retrieval.limits import check_document

        docs = []
        for i, item in enumerate(task.documents):
            if isinstance(item, str):
                item = Document(uuid.uuid5(uuid.NAMESPACE_URL, f"{task.task_id}/{i}").hex, item)
            elif not isinstance(item, Document):
                item = Document(
                    item.id,
                    item.text,
                    getattr(item, "title", None),
                    dict(getattr(item, "metadata", None) or {}),
                )
            check_document(item, self.document_limits, f"documents[{i}].")
            docs.append(item)
        self.index.add_documents(docs)
        return [d.id for d in docs]

    def _search(self, tasks: list[RetrievalTask]) -> list[RetrievalResult]:
        if not tasks:
            return []
        kmax = max(t.topk for t in tasks)
        ids = np.full((len(tasks), kmax), -1, dtype=np.int64)
        scores = np.zeros((len(tasks), kmax), dtype=np.float32)
        vectors = self.embedder.encode([t.query for t in tasks], is_query=True)
        groups: dict[int | None, list[int]] = defaultdict(list)
        for i, t in enumerate(tasks):
            groups[t.nprobe or self.default_nprobe].append(i)
        for nprobe, rows in groups.items():
            topk = max(tasks[i].topk for i in rows)
            kwargs = {} if nprobe is None else {"nprobe": nprobe}
            found = self.index.search(vectors[rows], topk, **kwargs)
            ids[rows, :topk] = found.ids
            scores[rows, :topk] = found.scores
        return [
            RetrievalResult(t.task_id, _passages(self._scored(ids[i, : t.topk], scores[i])))
            for i, t in enumerate(tasks)
        ]

    def _scored(self, ids: np.ndarray, scores: np.ndarray) -> list[ScoredDocument]:
        """The documents of a ranking (``-1``: no hit) with their scores; deleted ones dropped."""
        row = [int(x) for x in ids if x >= 0]
        docs = self.index.get_documents(row) if row else []
        return [ScoredDocument(d, float(scores[j])) for j, d in enumerate(docs) if d is not None]

    def collapses(self, task: RetrievalTask) -> bool:
        """``VectorIndex.collapses`` (an index without it, e.g. sharded, never collapses)."""
        collapses = getattr(self.index, "collapses", None)
        return collapses is not None and collapses(task.collapse_sections)

    def needs_text_search(self, task: RetrievalTask) -> bool:
        """A non-dense mode or a filter (a collapsed task: ``collapses``)."""
        default_mode = getattr(self.index, "default_mode", "dense")
        return (task.mode or default_mode) != "dense" or bool(task.filter)

    def _by_text(self, tasks: list[RetrievalTask]) -> list[RetrievalResult]:
        """One ``search_text`` per group of equal settings; a bad filter fails its group."""
        groups: dict[str, list[RetrievalTask]] = defaultdict(list)
        for t in tasks:
            fields = [t.mode, t.filter, t.nprobe, t.collapse_sections]
            groups[json.dumps(fields, sort_keys=True, default=str)].append(t)
        out = []
        for group in groups.values():
            t0 = group[0]
            try:
                found = self.index.search_text(
                    [t.query for t in group],
                    max(t.topk for t in group),
                    nprobe=t0.nprobe or self.default_nprobe,
                    mode=t0.mode,
                    filter=t0.filter,
                    collapse_sections=t0.collapse_sections,
                )
            except ValueError as exc:
                out.extend(
                    RetrievalResult(t.task_id, (), str(exc), error_kind="bad_request")
                    for t in group
                )
                continue
            for t, hits in zip(group, found, strict=True):
                out.append(RetrievalResult(t.task_id, _passages(hits[: t.topk])))
        return out

    def embed(self, texts: list[str]) -> Embeddings:
        """``texts`` embedded (document side), and the tokens read (0: no tokenizer)."""
        vectors = self.embedder.encode(list(texts), is_query=False)
        tokenizer = getattr(self.embedder, "tokenizer", None)
        num_tokens = 0
        if tokenizer is not None:
            limit = getattr(self.embedder, "max_length", None)
            ids = tokenizer(list(texts), truncation=limit is not None, max_length=limit)
            num_tokens = sum(len(row) for row in ids["input_ids"])
        return Embeddings(np.asarray(vectors, dtype=np.float32), num_tokens, self.embedder.name)

    def add_documents(self, docs: list) -> Any:
        return self.index.add_documents(docs)

    def delete_documents(self, doc_ids: list[str]) -> Any:
        return self.index.delete_documents(doc_ids)

    def set_gpu_tier(
        self,
        budget_bytes: int,
        device: str = "cuda",
        dtype: str = "float32",
        scan: str = "auto",
        stream_cold: str = "auto",
    ) -> dict[str, Any]:
        tier = self.index.set_gpu_tier(
            budget_bytes, device=device, dtype=dtype, scan=scan, stream_cold=stream_cold
        )
        return {"clusters": len(tier.clusters), "num_bytes": tier.num_bytes, "device": tier.device}

    def drop_gpu_tier(self) -> None:
        self.index.drop_gpu_tier()

    def gpu_tier_stats(self) -> dict[str, Any] | None:
        tier = self.index.gpu_tier
        if tier is None:
            return None
        placed = set(tier.clusters) | set(tier.loading)
        lists = np.flatnonzero(self.index.cluster_sizes())
        return {
            "clusters": len(tier.clusters),
            "num_bytes": tier.num_bytes,
            "hit_rate": tier.hit_rate,
            "holds_index": placed.issuperset(lists.tolist()),
            "scans": tier.scan_counts,
        }

    def _add(self, tasks: list[StagedRetrievalTask]) -> list[RetrievalResult]:
        """Embed and plan ``tasks``; one that cannot be planned fails alone."""
        vectors = self.embedder.encode([t.query for t in tasks], is_query=True)
        failed = []
        for i, t in enumerate(tasks):
            try:
                collapsed = self.collapses(t)
                params = StageParams(
                    k=max(t.topk * FETCH_FACTOR if collapsed else t.topk, t.cache_topk),
                    nprobe=t.nprobe or self.default_nprobe,
                    split=t.split,
                    budget_s=t.budget_s,
                    first_clusters=t.first_clusters,
                    hit_clusters=tuple(t.hit_clusters),
                    previous_clusters=tuple(t.previous_clusters),
                )
                self.search.add(t.task_id, vectors[i], params)
                self._tasks[t.task_id] = t
                if collapsed:
                    self._collapsed.add(t.task_id)
            except Exception as exc:
                self.search.discard([t.task_id])
                self._tasks.pop(t.task_id, None)
                self._collapsed.discard(t.task_id)
                failed.append(failed_result(t, exc))
        return failed

    def _step(self) -> list:
        try:
            progress = self.search.step()
        except Exception as exc:
            logger.exception("staged retrieval sub-stage failed")
            err = f"{type(exc).__name__}: {exc}"
            keys = self.search.clear()
            self._collapsed.difference_update(keys)
            return [RetrievalResult(k, (), err) for k in keys if self._tasks.pop(k, None)]
        updates: list = []
        for p in progress:
            task = self._tasks[p.key]
            if p.done:
                del self._tasks[p.key]
                updates.append(self._final(task, p))
            elif task.emit_partials:
                collapsed = p.key in self._collapsed
                passages, _ = self._top(task, p.state.ids[0], p.state.scores[0], collapsed)
                updates.append(RetrievalPartial(p.key, passages, p.num_substages))
        return updates

    def _final(
        self, task: StagedRetrievalTask, p: StageProgress
    ) -> StagedRetrievalResult | RetrievalResult:
        ids, scores = p.state.ids[0], p.state.scores[0]
        hit: tuple[int, ...] = ()
        if task.cache_topk > 0:
            best = ids[: task.cache_topk]
            clusters = self.index.clusters_of(best[best >= 0])
            hit = tuple(dict.fromkeys(int(c) for c in clusters if c >= 0))
        collapsed = task.task_id in self._collapsed
        self._collapsed.discard(task.task_id)
        passages, short = self._top(task, ids, scores, collapsed)
        if short:
            try:
                passages = self._searched_collapsed(task)
            except Exception as exc:
                return failed_result(task, exc)
        return StagedRetrievalResult(
            task.task_id,
            passages,
            hit_clusters=hit,
            probed_clusters=p.probed_clusters,
            num_substages=p.num_substages,
            scan_seconds=p.scan_seconds,
        )

    def _top(
        self, task: StagedRetrievalTask, ids: np.ndarray, scores: np.ndarray, collapsed: bool
    ) -> tuple[tuple[Passage, ...], bool]:
        """``task``'s passages from a ranking, ``collapsed`` or cut to ``topk``; and whether a
        full collapsed ranking is short of ``topk`` sections (then a deeper search decides)."""
        if not collapsed:
            return _passages(self._scored(ids[: task.topk], scores)), False
        hits = self._scored(ids, scores)
        found = collapse_hits(hits, task.topk)
        full = len(hits) == len(ids) and len(ids) < self.index.num_documents
        return _passages(found), full and len(found) < task.topk

    def _searched_collapsed(self, task: StagedRetrievalTask) -> tuple[Passage, ...]:
        (hits,) = self.index.search_text(
            [task.query],
            task.topk,
            nprobe=task.nprobe or self.default_nprobe,
            mode="dense",
            collapse_sections=True,
        )
        return _passages(hits)


def _passages(hits: Any) -> tuple[Passage, ...]:
    """``Passage``s of scored documents (``ScoredDocument``s, ``search_text`` hits)."""
    return tuple(Passage(h.id, h.text, h.title, h.score) for h in hits)


def run_isolated(runner: StagedRetrievalRunner, tasks: list[RetrievalTask]) -> list[Any]:
    return isolated(runner.run, tasks, failed_result)
