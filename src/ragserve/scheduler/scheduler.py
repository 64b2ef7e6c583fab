"""The scheduler: every cycle, the wavefront of ready nodes across all active requests.

One thread calls ``step()`` in a loop (the runtime's scheduler thread, or a test). Other
threads only call ``add_request`` / ``abort``, which go through a thread-safe inbox.

    step():  admit new requests and aborts
             wavefront = ready nodes of every active request (rendered into tasks)
             wavefront = each transform's rewrite of it
             dispatch: generation tasks join the engine's batch; retrieval tasks as one batch
             apply the executor's updates: write outputs, follow edges, finish requests
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future

from ragserve.graph import END, START, GenerationNode, GraphError, Passage, RetrievalNode
from ragserve.scheduler.executor import BaseExecutor, Update
from ragserve.scheduler.messages import (
    GenerationParams,
    GenerationTask,
    GenerationUpdate,
    RetrievalTask,
    Wavefront,
)
from ragserve.scheduler.request import NodeTiming, RequestState
from ragserve.scheduler.transforms import BaseTransform

logger = logging.getLogger(__name__)

ABORT_MEMORY_S = 300.0  # how long an abort of a not-yet-added request id is remembered
MAX_REMEMBERED_ABORTS = 4096  # and how many such ids at most (oldest forgotten first)


class Scheduler:
    """Advances many graph requests at once over one executor.

    ``max_node_runs`` bounds the nodes one request may run (a guard against routers that
    never exit); past it the request fails with a clear error.

    ``abort(id)`` of an id not (yet) added is remembered (``abort_memory_s``, at most
    ``max_remembered_aborts`` ids): a request added later with that id finishes at once,
    aborted. So an abort that overtakes its request (a client gone while the request was
    still on its way in) is not lost. Request ids must therefore not be reused soon after
    they were aborted.
    """

    def __init__(
        self,
        executor: BaseExecutor,
        transforms: Sequence[BaseTransform] = (),
        *,
        max_node_runs: int = 256,
        poll_timeout: float = 0.05,
    ) -> None:
        self.executor = executor
        self.transforms = tuple(transforms)
        self.max_node_runs = max_node_runs
        self.poll_timeout = poll_timeout
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[str, RequestState] = {}
        self._by_task: dict[str, RequestState] = {}
        self.num_cycles = 0
        self.abort_memory_s = ABORT_MEMORY_S
        self.max_remembered_aborts = MAX_REMEMBERED_ABORTS
        self._early_aborts: OrderedDict[str, float] = OrderedDict()  # id -> when aborted
        self._pending_transforms: tuple | None = None  # (chain, future) until it can swap
        self._deferred: list[RequestState] = []  # adds that arrived behind a pending swap
        for transform in self.transforms:
            transform.bind(self)

    # -- called from any thread -------------------------------------------------------------
    def add_request(self, request: RequestState) -> None:
        self._inbox.put(("add", request))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def set_transforms(self, transforms: Sequence[BaseTransform]) -> Future:
        """Replace the transform chain between requests (e.g. a benchmark switching systems).

        Takes effect in the scheduler thread at the next cycle with no active request and no
        task in flight; the returned future resolves then. Requests added after this call
        wait until the switch is done; those added before finish under the old chain.
        """
        done: Future = Future()
        self._inbox.put(("transforms", (tuple(transforms), done)))
        return done

    # -- the control loop (scheduler thread only) -----------------------------------------
    def step(self) -> None:
        """One cycle: admit, collect the wavefront, transform, dispatch, apply updates."""
        self._admit()
        wavefront = self._collect_wavefront()
        for transform in self.transforms:
            wavefront = transform.apply(wavefront)
        self._dispatch(wavefront)
        timeout = 0.0 if self._has_ready() else self.poll_timeout
        updates = self.executor.poll(timeout if self._by_task else 0.0)
        for transform in self.transforms:
            updates = transform.on_updates(updates)
        for update in updates:
            self._apply(update)
        self.num_cycles += 1

    def has_unfinished(self) -> bool:
        return bool(self._active or self._deferred) or not self._inbox.empty()

    @property
    def num_active(self) -> int:
        return len(self._active)

    # -- read-only lookups for transforms (scheduler thread only) ----------------------------
    def request_of_task(self, task_id: str) -> RequestState | None:
        """The active request a dispatched task belongs to, if any."""
        return self._by_task.get(task_id)

    def get_request(self, request_id: str) -> RequestState | None:
        """The active request with this id, if any."""
        return self._active.get(request_id)

    # -- pieces of the cycle ------------------------------------------------------------------
    def _admit(self) -> None:
        idle = not self._active and not self._by_task
        while True:
            if self._pending_transforms is not None and not self._active and not self._by_task:
                self._swap_transforms()
                deferred, self._deferred = self._deferred, []
                for item in deferred:
                    self._admit_one("add", item)
            try:
                kind, item = (
                    self._inbox.get(timeout=self.poll_timeout)
                    if idle
                    else (self._inbox.get_nowait())
                )
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
            item.error = f"duplicate request id {item.request_id!r}"
            item.error_kind = "bad_request"
            item.on_done(item.response())
        elif kind == "add" and self._take_early_abort(item.request_id):
            item.error, item.error_kind = "aborted", "aborted"
            item.on_done(item.response())
        elif kind == "add":
            self._active[item.request_id] = item
            self._advance(item, START)
        elif item in self._active:
            self._finish(self._active[item], "aborted", "aborted")
        elif any(r.request_id == item for r in self._deferred):
            for req in [r for r in self._deferred if r.request_id == item]:
                self._deferred.remove(req)
                req.error, req.error_kind = "aborted", "aborted"
                req.on_done(req.response())
        else:
            self._remember_abort(item)

    def _swap_transforms(self) -> None:
        transforms, done = self._pending_transforms
        self._pending_transforms = None
        try:
            for transform in transforms:
                transform.bind(self)
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

    def _has_ready(self) -> bool:
        return any(not r.is_dispatched for r in self._active.values())

    def _collect_wavefront(self) -> Wavefront:
        wavefront = Wavefront()
        now = time.monotonic()
        for req in self._active.values():
            if req.is_dispatched:
                continue
            node = req.graph.nodes[req.node_id]
            req.task_id = f"{req.request_id}/{req.node_id}/{req.num_node_runs}"
            self._by_task[req.task_id] = req
            req.timings[-1].dispatched_at = now
            if req.raw_params is not None:
                task = GenerationTask(req.task_id, req.raw_prompt, req.raw_params, chat=False)
                wavefront.generation.append(task)
            elif isinstance(node, GenerationNode):
                params = GenerationParams.for_node(node)
                prompt = node.prompt.render(req.state)
                history = node.history(req.state)
                task = GenerationTask(req.task_id, prompt, params, history=history)
                wavefront.generation.append(task)
            else:
                query = node.query.render(req.state)
                task = RetrievalTask(
                    req.task_id, query, node.topk, node.nprobe, node.mode, node.filter
                )
                wavefront.retrieval.append(task)
        return wavefront

    def _dispatch(self, wavefront: Wavefront) -> None:
        if wavefront.generation:
            self.executor.submit_generation(wavefront.generation)
        if wavefront.retrieval:
            self.executor.submit_retrieval(wavefront.retrieval)

    def _apply(self, update: Update) -> None:
        req = self._by_task.get(update.task_id)
        if req is None or req.task_id != update.task_id:
            return  # a task of an aborted or failed request
        timing = req.timings[-1]
        now = time.monotonic()
        if update.error is not None:
            del self._by_task[update.task_id]
            kind = getattr(update, "error_kind", None) or "internal"
            self._finish(req, f"node {req.node_id!r} failed: {update.error}", kind)
            return
        node = req.graph.nodes[req.node_id]
        if isinstance(update, GenerationUpdate):
            if update.new_token_ids and timing.first_token_at is None:
                timing.first_token_at = now
            timing.num_tokens += len(update.new_token_ids)
            if update.prompt_token_ids:
                timing.num_prompt_tokens = len(update.prompt_token_ids)
            req.partial_text += update.text_delta
            if req.on_update is not None:
                req.on_update(update)
            if timing.is_answer and req.on_delta is not None and update.text_delta:
                req.on_delta(update.text_delta)
            if not update.finished:
                return
            timing.finish_reason = update.finish_reason
            text = req.partial_text if update.final_text is None else update.final_text
            _write(req, node, text)
            req.partial_text = ""
        else:
            for passage in update.passages:
                req.retrieved.setdefault(passage.doc_id, passage)
            _write(req, node, list(update.passages))
        timing.finished_at = now
        del self._by_task[update.task_id]
        req.task_id = None
        req.state.visits[req.node_id] = req.state.visit_count(req.node_id) + 1
        self._advance(req, req.node_id)

    def _advance(self, req: RequestState, src) -> None:
        """Follow ``src``'s edge: mark the next node ready, or finish at ``END``."""
        try:
            nxt = req.graph.next_node(src, req.state)
        except Exception as exc:  # a user router raised
            msg = str(exc) if isinstance(exc, GraphError) else f"router after {src!r}: {exc!r}"
            self._finish(req, msg)
            return
        if nxt is END:
            self._finish(req, None)
            return
        if req.num_node_runs >= self.max_node_runs:
            self._finish(req, f"request ran {self.max_node_runs} nodes without reaching END")
            return
        req.num_node_runs += 1
        req.node_id = nxt
        node = req.graph.nodes[nxt]
        is_answer = isinstance(node, GenerationNode) and node.output == "output"
        req.timings.append(NodeTiming(nxt, node.kind, time.monotonic(), is_answer=is_answer))

    def _finish(self, req: RequestState, error: str | None, kind: str = "internal") -> None:
        """End ``req``; a failure (``error`` set) is of ``kind``, an ``ErrorKind``."""
        if req.task_id is not None:
            self._by_task.pop(req.task_id, None)
            if isinstance(req.graph.nodes[req.node_id], GenerationNode):
                self.executor.abort([req.task_id])
            req.task_id = None
        req.error = error
        req.error_kind = None if error is None else kind  # type: ignore[assignment]
        del self._active[req.request_id]
        if error is not None:
            logger.debug("request %s failed: %s", req.request_id, error)
        try:
            req.on_done(req.response())
        except Exception:
            logger.exception("on_done callback of request %s raised", req.request_id)


def _write(req: RequestState, node: GenerationNode | RetrievalNode, value) -> None:
    if not node.append or node.output not in req.state:
        req.state[node.output] = value
    elif isinstance(value, str):
        req.state[node.output] = f"{req.state[node.output]}\n{value}"
    else:
        seen = {p.doc_id for p in req.state[node.output]}
        req.state[node.output] = list(req.state[node.output]) + [
            p for p in value if isinstance(p, Passage) and p.doc_id not in seen
        ]
