"""The scheduler: every cycle, the wavefront of ready nodes across all active requests, each
run lowered to its resource's task (``lower``).

One thread calls ``step()``; other threads only call ``add_request`` / ``abort`` /
``set_transforms``, which go through a thread-safe inbox."""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from ragserve.graph import END, START, GraphError, Passage, State
from ragserve.scheduler.messages import (
    BaseExecutor,
    EmbedTask,
    GenerationParams,
    GenerationTask,
    GenerationUpdate,
    OperatorResult,
    RerankTask,
    RetrievalResult,
    RetrievalTask,
    Update,
    UpsertTask,
    Wavefront,
)
from ragserve.scheduler.operators import CpuPool, MemoryStore, OperatorConfig
from ragserve.scheduler.request import NodeRun, NodeTiming, OpenJoin, RequestState
from ragserve.scheduler.transforms import BaseTransform, SchedulerView

logger = logging.getLogger(__name__)


class Scheduler:
    """Advances many graph requests at once over one executor.

    ``max_node_runs`` bounds the node runs of one request (routers that never exit fail).
    ``busy_poll_timeout``: how long a poll with tasks in flight may wait when the executor
    ``can_wake`` (else ``poll_timeout``). ``enable_update_coalescing``: generation tasks
    nobody reads mid-way (no ``on_delta``/``on_update``, no transform that
    ``needs_partial_updates``) get ``chunk_s = inf``: first token and end only.
    ``abort(id)`` of an id not yet added is remembered (``abort_memory_s``, at most
    ``max_remembered_aborts`` ids, oldest forgotten first): the request finishes aborted when
    it arrives.
    """

    abort_memory_s = 300.0
    max_remembered_aborts = 4096

    def __init__(
        self,
        executor: BaseExecutor,
        transforms: Sequence[BaseTransform] = (),
        *,
        max_node_runs: int = 256,
        poll_timeout: float = 0.05,
        operators: OperatorConfig | None = None,
        busy_poll_timeout: float | None = None,
        enable_update_coalescing: bool = False,
    ) -> None:
        self.executor = executor
        self.transforms = tuple(transforms)
        self.max_node_runs = max_node_runs
        self.poll_timeout = poll_timeout
        wakes = busy_poll_timeout is not None and executor.can_wake
        self.busy_poll_timeout = busy_poll_timeout if wakes else poll_timeout
        self.enable_update_coalescing = enable_update_coalescing
        self.operators = operators or OperatorConfig()
        self.memory = MemoryStore(
            self.operators.memory_max_entries,
            self.operators.memory_max_bytes,
            self.operators.memory_max_sessions,
        )
        self._pool: CpuPool | None = None  # started with the first function node
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, RequestState] = {}
        self._by_task: dict[str, tuple[RequestState, NodeRun]] = {}
        self._side = Wavefront()  # transforms' side tasks, dispatched after the next wavefront
        self._inline: list[Update] = []  # results made during collection (memory, bad input)
        self.num_cycles = 0
        self.num_node_runs = 0  # started, over all requests
        self.busy_s = 0.0  # scheduler work: cycles' time outside admission and polling
        self._poll_s = 0.0
        self._has_new_runs = False  # a run was started since the last wavefront collection
        self._early_aborts: OrderedDict[str, float] = OrderedDict()  # id -> when aborted
        self._pending_transforms: tuple | None = None  # (chain, future) until it can swap
        self._deferred: list[RequestState] = []  # adds that arrived behind a pending swap
        self.view = SchedulerView(self)
        for transform in self.transforms:
            transform.bind(self.view)

    def add_request(self, request: RequestState) -> None:
        self._inbox.put(("add", request))
        self.executor.wake()

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self.executor.wake()

    def set_transforms(self, transforms: Sequence[BaseTransform]) -> Future:
        """Replace the transform chain once no request is active and no task in flight (the
        future resolves then); requests added meanwhile wait for the new chain."""
        done: Future = Future()
        self._inbox.put(("transforms", (tuple(transforms), done)))
        self.executor.wake()
        return done

    def step(self) -> None:
        """One cycle: admit, collect, transform, dispatch, apply updates (``busy_s``: the
        cycle's time outside admission and polling)."""
        self._admit()
        started = time.perf_counter()
        wavefront = self._collect_wavefront()
        for transform in self.transforms:
            wavefront = transform.apply(wavefront)
        self._dispatch(wavefront)
        updates = self._poll()
        for transform in self.transforms:
            updates = transform.on_updates(updates)
        for update in updates:
            self._apply(update)
        self.num_cycles += 1
        self.busy_s += time.perf_counter() - started - self._poll_s

    def has_unfinished(self) -> bool:
        return bool(self._active or self._deferred) or not self._inbox.empty()

    @property
    def num_active(self) -> int:
        return len(self._active)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()

    def _admit(self) -> None:
        idle = not self._active and not self._by_task
        while True:
            if self._pending_transforms is not None and not self._active and not self._by_task:
                self._swap_transforms()
                deferred, self._deferred = self._deferred, []
                for item in deferred:
                    self._admit_one("add", item)
            try:
                get = self._inbox.get
                kind, item = get(timeout=self.poll_timeout) if idle else get(block=False)
            except queue.Empty:
                return
            idle = False
            if kind == "transforms":
                self._pending_transforms = item
            elif kind == "add" and self._pending_transforms is not None:
                self._deferred.append(item)  # admitted under the new chain
            else:
                self._admit_one(kind, item)

    def _admit_one(self, kind: str, item) -> None:
        if kind == "add" and item.request_id in self._active:
            _refuse(item, f"duplicate request id {item.request_id!r}", "bad_request")
        elif kind == "add" and self._take_early_abort(item.request_id):
            _refuse(item, "aborted", "aborted")
        elif kind == "add":
            self._active[item.request_id] = item
            self._advance(item, START, item.state, None)
        elif item in self._active:
            self._finish(self._active[item], "aborted", "aborted")
        elif waiting := [r for r in self._deferred if r.request_id == item]:
            for req in waiting:
                self._deferred.remove(req)
                _refuse(req, "aborted", "aborted")
        else:
            self._remember_abort(item)

    def _swap_transforms(self) -> None:
        transforms, done = self._pending_transforms
        self._pending_transforms = None
        try:
            for transform in transforms:
                transform.bind(self.view)
        except Exception as exc:
            done.set_exception(exc)
            return
        self.transforms = transforms
        done.set_result(None)

    def _remember_abort(self, request_id: str) -> None:
        now = time.monotonic()
        self._early_aborts[request_id] = now
        self._early_aborts.move_to_end(request_id)
        while self._early_aborts and (
            len(self._early_aborts) > self.max_remembered_aborts
            or now - next(iter(self._early_aborts.values())) >= self.abort_memory_s
        ):
            self._early_aborts.popitem(last=False)

    def _take_early_abort(self, request_id: str) -> bool:
        aborted_at = self._early_aborts.pop(request_id, None)
        return aborted_at is not None and time.monotonic() - aborted_at < self.abort_memory_s

    def _collect_wavefront(self) -> Wavefront:
        wavefront = Wavefront()
        if not self._has_new_runs:
            return wavefront
        # NOTE: runs become ready only in ``_start``; a collection dispatches every ready run,
        # so without a ``_start`` since the last one there is nothing to scan for.
        now = time.monotonic()
        for req in list(self._active.values()):
            for run in req.runs:
                if run.task_id is not None:
                    continue
                run.task_id = f"{req.request_id}/{run.node_id}/{run.seq}"
                self._by_task[run.task_id] = (req, run)
                run.timing.dispatched_at = now
                resource, task = lower(run, req.graph.nodes[run.node_id], run.task_id, self.memory)
                if resource == "cpu":
                    self._function_pool().submit(run.task_id, *task)
                elif resource == "inline":
                    self._inline.append(task)
                elif resource == "generation":
                    wavefront.generation.append(self._coalesced(req, task))
                else:
                    getattr(wavefront, resource).append(task)
        self._has_new_runs = False
        return wavefront

    def _coalesced(self, req: RequestState, task: GenerationTask) -> GenerationTask:
        if (
            not self.enable_update_coalescing
            or task.chunk_s is not None
            or req.on_delta is not None
            or req.on_update is not None
            or any(t.needs_partial_updates for t in self.transforms)
        ):
            return task
        return dataclasses.replace(task, chunk_s=math.inf)

    def _function_pool(self) -> CpuPool:
        if self._pool is None:
            ops = self.operators
            self._pool = CpuPool(
                ops.function_workers, ops.function_timeout_s, ops.function_max_stuck
            )
        return self._pool

    def _dispatch(self, wavefront: Wavefront) -> None:
        side, self._side = self._side, Wavefront()
        generation = [*wavefront.generation, *side.generation]
        retrieval = [*wavefront.retrieval, *side.retrieval]
        if generation:
            self.executor.submit_generation(generation)
        if retrieval:
            self.executor.submit_retrieval(retrieval)
        if wavefront.operators:
            self.executor.submit_operators(wavefront.operators)

    def _poll(self) -> list[Update]:
        updates, self._inline = self._inline, []
        timeout = 0.0 if updates or self._has_new_runs else self.busy_poll_timeout
        if self._pool is not None and self._pool.has_work():
            timeout = min(timeout, 0.005)  # NOTE: the pool's results are polled, not waited on
        polled = time.perf_counter()
        updates.extend(self.executor.poll(timeout if self._by_task else 0.0))
        self._poll_s = time.perf_counter() - polled
        if self._pool is not None:
            updates.extend(self._pool.poll())
        return updates

    def _apply(self, update: Update) -> None:
        entry = self._by_task.get(update.task_id)
        if entry is None:
            return  # a task of an aborted or failed request, or a transform's side task
        req, run = entry
        if update.error is not None:
            del self._by_task[update.task_id]
            run.task_id = None
            kind = getattr(update, "error_kind", None) or "internal"
            self._finish(req, f"node {run.node_id!r} failed: {update.error}", kind)
            return
        node = req.graph.nodes[run.node_id]
        if isinstance(update, GenerationUpdate):
            if not self._on_tokens(req, run, node, update):
                return
            value = run.partial_text if update.final_text is None else update.final_text
            run.partial_text = ""
        elif isinstance(update, RetrievalResult):
            found = req.retrieved if run.branch is None else req.join.retrieved[run.branch]
            for passage in update.passages:
                found.setdefault(passage.doc_id, passage)
            value = list(update.passages)
        else:
            value = update.value
        run.timing.finished_at = time.monotonic()
        del self._by_task[update.task_id]
        req.runs.remove(run)
        state = run.state.write(node, value)
        if run.branch is None:
            req.state = state
        self._advance(req, run.node_id, state, run.branch)

    def _on_tokens(self, req: RequestState, run: NodeRun, node: Any, update: Any) -> bool:
        """``True`` when ``update`` is the node's last."""
        timing = run.timing
        if update.new_token_ids and timing.first_token_at is None:
            timing.first_token_at = time.monotonic()
        timing.num_tokens += len(update.new_token_ids)
        if update.prompt_token_ids:
            timing.num_prompt_tokens = len(update.prompt_token_ids)
        run.partial_text += update.text_delta
        if node.kind == "completion" and req.on_update is not None:
            req.on_update(update)
        if timing.is_answer and req.on_delta is not None and update.text_delta:
            req.on_delta(update.text_delta)
        if update.finished:
            timing.finish_reason = update.finish_reason
        return update.finished

    def _advance(self, req: RequestState, src: Any, state: State, branch: int | None) -> None:
        """Follow ``src``'s edge: start the next node run(s), wait at a join, or finish."""
        try:
            nxt = req.graph.next_node(src, state)
        except Exception as exc:  # a user router raised
            msg = str(exc) if isinstance(exc, GraphError) else f"router after {src!r}: {exc!r}"
            self._finish(req, msg)
            return
        if nxt is END:
            self._finish(req, None)
        elif isinstance(nxt, tuple):
            req.join = OpenJoin(req.graph.fanouts[src], [None] * len(nxt), [{} for _ in nxt])
            for i, target in enumerate(nxt):
                if not self._start(req, target, state.fork(), i):
                    return
        elif branch is not None and req.join is not None and nxt == req.join.fanout.join:
            req.join.states[branch] = state
            if None not in req.join.states:
                req.state = _merged(req)
                req.join = None
                self._start(req, nxt, req.state, None)
        else:
            self._start(req, nxt, state, branch)

    def _start(self, req: RequestState, node_id: Any, state: State, branch: int | None) -> bool:
        """A ready run of ``node_id``; ``False`` if the request failed (run limit)."""
        if req.num_node_runs >= self.max_node_runs:
            self._finish(req, f"request ran {self.max_node_runs} nodes without reaching END")
            return False
        req.num_node_runs += 1
        self.num_node_runs += 1
        node = req.graph.nodes[node_id]
        is_answer = node.kind in ("generation", "completion") and node.output == "output"
        timing = NodeTiming(node_id, node.kind, time.monotonic(), is_answer=is_answer)
        req.timings.append(timing)
        req.runs.append(NodeRun(node_id, state, timing, branch=branch, seq=req.num_node_runs))
        self._has_new_runs = True
        return True

    def _finish(self, req: RequestState, error: str | None, kind: str = "internal") -> None:
        """End ``req`` (failed with ``error`` of ``kind`` unless ``None``); its runs in flight
        are dropped."""
        for run in req.runs:
            if run.task_id is None:
                continue
            self._by_task.pop(run.task_id, None)
            resource = req.graph.nodes[run.node_id].resource
            if resource == "engine":
                self.executor.abort([run.task_id])
            elif resource == "cpu" and self._pool is not None:
                self._pool.abort([run.task_id])
        req.runs = []
        req.join = None
        req.error = error
        req.error_kind = None if error is None else kind  # type: ignore[assignment]
        del self._active[req.request_id]
        if error is not None:
            logger.debug("request %s failed: %s", req.request_id, error)
        try:
            req.on_done(req.response())
        except Exception:
            logger.exception("on_done callback of request %s raised", req.request_id)


def _refuse(req: RequestState, error: str, kind: str) -> None:
    req.error, req.error_kind = error, kind  # type: ignore[assignment]
    req.on_done(req.response())


def _merged(req: RequestState) -> State:
    """The state at the fan-out, then each branch's output keys, visits and passages."""
    join = req.join
    merged = req.state.fork()
    for i, branch_state in enumerate(join.states):
        for node_id in join.fanout.branches[i]:
            key = req.graph.nodes[node_id].output
            if key is not None and key in branch_state:
                merged[key] = branch_state[key]
            if branch_state.visit_count(node_id):
                merged.visits[node_id] = branch_state.visit_count(node_id)
        for doc_id, passage in join.retrieved[i].items():
            req.retrieved.setdefault(doc_id, passage)
    return merged


def lower(run: NodeRun, node: Any, task_id: str, memory: MemoryStore) -> tuple[str, Any]:
    """A ready node run becomes ``(resource, task)``: the task of the resource its node kind
    declares (the table: docs/architecture.md, "Operators and the life of a request"), a
    ``Wavefront`` list (``generation``, ``retrieval``, ``operators``), ``cpu`` (``(fn, state,
    timeout_s)``) or ``inline`` (an ``OperatorResult`` ready now). Input the node cannot use
    lowers to a ``bad_request`` ``OperatorResult`` naming the field: nothing is sent."""
    try:
        return _lower(run.state, node, task_id, memory)
    except ValueError as exc:
        return ("inline", OperatorResult(task_id, error=str(exc), error_kind="bad_request"))


def _lower(state: Any, node: Any, task_id: str, memory: MemoryStore) -> tuple[str, Any]:
    kind = node.kind
    if kind == "generation":
        return ("generation", generation_task(task_id, node, state))
    if kind == "completion":
        prompt = state.get(node.prompt)
        prompt = tuple(prompt) if isinstance(prompt, list) else prompt
        if not isinstance(prompt, str) and not (
            isinstance(prompt, tuple)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            raise ValueError(f"prompt must be a string or a list of token ids, got {prompt!r:.60}")
        params = GenerationParams.from_any(node.params)
        return ("generation", GenerationTask(task_id, prompt, params, chat=False))
    if kind == "retrieval":
        query = node.query.render(state)
        fields = (node.topk, node.nprobe, node.mode, node.filter, node.collapse_sections)
        return ("retrieval", RetrievalTask(task_id, query, *fields))
    if kind == "embed":
        value = state.get(node.text)
        if isinstance(value, str):
            return ("operators", EmbedTask(task_id, (value,), single=True))
        if not (_is_list(value) and value and all(isinstance(v, str) for v in value)):
            raise ValueError(
                f"text: state[{node.text!r}] must be a string or a non-empty list of strings"
            )
        return ("operators", EmbedTask(task_id, tuple(value)))
    if kind == "rerank":
        docs = state.get(node.docs)
        docs = [docs] if isinstance(docs, Passage) else docs
        if not _is_list(docs) or not all(isinstance(p, Passage) for p in docs):
            raise ValueError(f"docs: state[{node.docs!r}] must be retrieved passages")
        if not docs:
            return ("inline", OperatorResult(task_id, []))
        task = RerankTask(task_id, node.query.render(state), tuple(docs), node.topk)
        return ("operators", task)
    if kind == "upsert":
        value = state.get(node.documents)
        items = list(value) if _is_list(value) else [value]
        for item in items:
            if not (isinstance(item, str) or (hasattr(item, "id") and hasattr(item, "text"))):
                raise ValueError(
                    f"documents: state[{node.documents!r}] must be a Document, a string or a "
                    f"list of them, got {type(item).__name__}"
                )
        if not items:
            return ("inline", OperatorResult(task_id, []))
        return ("operators", UpsertTask(task_id, tuple(items)))
    if kind == "function":
        return ("cpu", (node.fn, state.fork(), node.timeout_s))
    session = state.get(node.key)  # a memory node: done here
    if not isinstance(session, str) or not session:
        raise ValueError(f"key: state[{node.key!r}] must hold a non-empty session id string")
    text = node.text.render(state) if node.mode == "append" else None
    value = memory.read(session) if text is None else memory.append(session, text)
    return ("inline", OperatorResult(task_id, value))


def generation_task(task_id: str, node: Any, state: Any) -> GenerationTask:
    """The task of a ``GenerationNode`` reading ``state``."""
    params = GenerationParams.from_any(node)
    return GenerationTask(task_id, node.prompt.render(state), params, history=node.history(state))


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))
