"""``Server``: the public entry point. A scheduler thread runs ``Scheduler.step()`` in a loop;
``run`` / ``submit`` / ``stream`` / ``complete`` hand requests to it and wait for them."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ragserve.graph import CompiledGraph, RAGraph, State
from ragserve.graph.template import NAME
from ragserve.retrieval.limits import check_document
from ragserve.runtime.config import ServerConfig
from ragserve.runtime.errors import WorkerError
from ragserve.runtime.worker_start import check_main_guard, start_fork_server
from ragserve.scheduler import GenerationParams, RequestState, Response, Scheduler
from ragserve.scheduler.cosched import CoScheduleConfig, make_transforms
from ragserve.scheduler.request import RequestError
from ragserve.workflows import BUILTIN_WORKFLOWS, get_workflow

logger = logging.getLogger(__name__)


class Server:
    """Serve RAG workflows: ``model`` (HF folder or built-in name, or an ``LLMEngine`` in
    process mode), ``index`` (a saved ``VectorIndex`` folder, ``"factbook"``, or a
    ``VectorIndex`` in process mode), ``embedder`` (default: the index's). Workers start in the
    constructor and stop in ``close()``. Thread-safe; docs/architecture.md "Server"."""

    def __init__(
        self,
        model: Any,
        index: Any,
        embedder: Any = None,
        *,
        config: ServerConfig | None = None,
    ) -> None:
        self.config = config or ServerConfig()
        if not self.config.in_process:
            check_main_guard()
        self.executor = _make_executor(model, index, embedder, self.config)
        self.cosched = self.config.cosched.resolve(False)
        self.scheduler = Scheduler(
            self.executor,
            make_transforms(self.cosched),
            max_node_runs=self.config.max_node_runs,
            poll_timeout=self.config.poll_timeout,
            operators=self.config.operators,
            busy_poll_timeout=self.config.busy_poll_timeout,
            enable_update_coalescing=self.config.enable_update_coalescing,
        )
        self._cosched_names: tuple[str, ...] = self.cosched.enabled
        self.workflows: dict[str, CompiledGraph] = {n: get_workflow(n) for n in BUILTIN_WORKFLOWS}
        self._slots = threading.BoundedSemaphore(self.config.max_active_requests)
        self._call_slots = threading.BoundedSemaphore(self.config.max_num_calls)
        self._closed = threading.Event()
        self._last_cycle = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="ragserve-scheduler", daemon=True)
        self._thread.start()
        if self.config.cosched.auto and self.config.gpu_tier is not None:
            # NOTE: after the loop starts: the worker's reply is read by the loop
            self.set_cosched(self.config.cosched, self.config.call_timeout_s)
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    # -- requests ---------------------------------------------------------------------------
    def run(
        self,
        question: str,
        graph: Any = "oneshot",
        *,
        request_id: str | None = None,
        history: Sequence[tuple[str, str]] = (),
        inputs: Mapping[str, Any] | None = None,
    ) -> Response:
        """Run one request to completion (blocking). ``history``: ``(role, content)`` chat
        turns before the question; ``inputs``: more initial state (every key the graph
        declares must be given)."""
        done = threading.Event()
        box: list[Response] = []
        on_done = lambda r: (box.append(r), done.set())
        self._add(question, graph, request_id, on_done, history=history, inputs=inputs)
        while not done.wait(0.5):
            if self._closed.is_set():
                raise WorkerError("the Server closed before the request finished", "aborted")
        return box[0]

    async def submit(
        self,
        question: str,
        graph: Any = "oneshot",
        *,
        request_id: str | None = None,
        history: Sequence[tuple[str, str]] = (),
        inputs: Mapping[str, Any] | None = None,
    ) -> Response:
        """``run`` awaitable; cancelling the awaiting task aborts the request."""
        rid = request_id or uuid.uuid4().hex
        add = {"history": history, "inputs": inputs}
        async with contextlib.aclosing(self._events(question, graph, rid, None, add)) as it:
            return [response async for response in it][-1]  # no listener: only the Response

    async def stream(
        self,
        question: str,
        graph: Any = "oneshot",
        *,
        request_id: str | None = None,
        on_response: Callable[[Response], Any] | None = None,
        history: Sequence[tuple[str, str]] = (),
        inputs: Mapping[str, Any] | None = None,
    ) -> AsyncIterator[str]:
        """Yield text deltas of the answer; ``on_response`` gets the final ``Response`` once,
        after the last delta (failed requests too, which then raise ``RequestError``). Closing
        the iterator early aborts the request."""
        rid = request_id or uuid.uuid4().hex
        add = {"history": history, "inputs": inputs}
        async with contextlib.aclosing(self._events(question, graph, rid, "on_delta", add)) as it:
            async for item in it:
                if isinstance(item, Response):
                    if on_response is not None:
                        on_response(item)
                    if item.error is not None:
                        raise RequestError(item)
                    return
                yield item

    async def complete(
        self, prompt: str | list[int], params: Any, *, request_id: str | None = None
    ) -> AsyncIterator[Any]:
        """Plain LLM completion: yields cumulative ``RequestOutput``s; a failed request raises
        ``RequestError``."""
        from ragserve.generation import RequestMetrics

        metrics = RequestMetrics(arrival_time=time.monotonic())
        rid = request_id or uuid.uuid4().hex
        raw = tuple(prompt) if isinstance(prompt, list) else prompt
        graph = completion_graph(GenerationParams.from_any(params))
        prompt_ids: tuple[int, ...] = ()
        token_ids: list[int] = []
        text = ""
        async with contextlib.aclosing(self._events(raw, graph, rid, "on_update", {})) as it:
            async for item in it:
                if isinstance(item, Response):
                    if item.error is not None:
                        raise RequestError(item)
                    return
                prompt_ids = item.prompt_token_ids or prompt_ids
                token_ids.extend(item.new_token_ids)
                text = item.final_text if item.final_text is not None else text + item.text_delta
                yield _request_output(rid, prompt_ids, token_ids, text, item, metrics)

    async def _events(
        self, question: Any, graph: Any, rid: str, listener: str | None, add: dict[str, Any]
    ) -> AsyncIterator[Any]:
        """The request's ``listener`` events, then its ``Response``; aborted if the iteration
        stops before."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        put = lambda item: _post(loop, events.put_nowait, item)
        listeners = {} if listener is None else {listener: put}
        finished = False
        try:
            try:  # inside the ``finally``: a close while registering still aborts
                await asyncio.to_thread(self._add, question, graph, rid, put, **listeners, **add)
            except Exception:
                finished = True  # rejected (unknown workflow, closed): never added
                raise
            while not finished:
                item = await events.get()
                finished = isinstance(item, Response)
                yield item
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request (one not yet added is remembered and finishes at once, aborted)."""
        self.scheduler.abort(request_id)

    def set_cosched(self, cosched: CoScheduleConfig, timeout: float | None = None) -> None:
        """Swap to ``cosched``'s transforms once the requests in flight finish; ``auto`` is
        resolved (``CoScheduleConfig.resolve``) against the retrieval worker's GPU tier as it
        is now. ``self.cosched`` is the config that runs."""
        resolved = cosched.resolve(cosched.auto and self._tier_holds_index())
        self.scheduler.set_transforms(make_transforms(resolved)).result(timeout)
        self.cosched, self._cosched_names = resolved, resolved.enabled

    def _tier_holds_index(self) -> bool:
        try:
            stats = self.executor.call_retrieval("gpu_tier_stats").result(
                self.config.call_timeout_s
            )
        except Exception as e:  # noqa: BLE001 - e.g. index shards on Ray: count as no tier
            logger.info("co-scheduling auto: no GPU tier report (%s)", e)
            return False
        holds = bool(stats and stats.get("holds_index"))
        if holds:
            logger.info("co-scheduling auto: the GPU tier holds the whole index; transforms off")
        return holds

    def set_transforms(self, transforms: Sequence[Any], timeout: float | None = None) -> None:
        """Swap the transform chain once the requests in flight have finished."""
        self.scheduler.set_transforms(transforms).result(timeout)
        self._cosched_names = ("custom",) if transforms else ()

    # -- documents --------------------------------------------------------------------------
    def add_documents(self, docs: Sequence[Any]) -> Any:
        """Upsert documents (checked against ``config.document_limits``); returns once they are
        persisted. ``WorkerError`` when the retrieval worker dies, does not answer within
        ``call_timeout_s``, or too many calls are in flight."""
        docs = list(docs)
        for i, doc in enumerate(docs):
            check_document(doc, self.config.document_limits, f"documents[{i}].")
        return self._call("add_documents", docs)

    def delete_documents(self, doc_ids: Sequence[str]) -> Any:
        """Delete documents by id; errors as ``add_documents``."""
        return self._call("delete_documents", list(doc_ids))

    def _call(self, name: str, *args: Any) -> Any:
        if self._closed.is_set():
            raise WorkerError("the Server is closed", "worker_died")
        if not self._call_slots.acquire(blocking=False):
            raise WorkerError(
                f"{self.config.max_num_calls} document calls are already in flight", "overloaded"
            )
        try:
            future = self.executor.call_retrieval(name, *args)
            try:
                return future.result(timeout=self.config.call_timeout_s)
            except concurrent.futures.TimeoutError:
                raise WorkerError(
                    f"the retrieval worker did not answer {name} within "
                    f"{self.config.call_timeout_s:g} s",
                    "timeout",
                ) from None
        finally:
            self._call_slots.release()

    def embed(self, texts: Sequence[str]) -> Any:
        """``Embeddings(vectors, num_tokens, model)`` of ``texts`` (document side), computed in
        the retrieval worker; errors as ``add_documents``."""
        texts = list(texts)
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ValueError("texts must be a non-empty list of non-empty strings")
        return self._call("embed", texts)

    # -- lifecycle --------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Scheduler, engine and worker counters; ``cosched``: the optimizations that run."""
        engine = self.executor.engine_stats()
        busy_s, num_node_runs = self.scheduler.busy_s, self.scheduler.num_node_runs
        out: dict[str, Any] = {
            "num_active_requests": self.scheduler.num_active,
            "num_cycles": self.scheduler.num_cycles,
            "num_node_runs": num_node_runs,
            "scheduler_busy_s": busy_s,
            "scheduler_s_per_node": busy_s / num_node_runs if num_node_runs else None,
            "num_running": engine.get("running", 0),
            "num_waiting": engine.get("waiting", 0),
            "num_blocks_used": engine.get("kv_blocks_used", 0),
            "num_blocks_total": engine.get("kv_blocks_total", 0),
            "cosched": list(self._cosched_names),
            "engine": engine,
        }
        if hasattr(self.executor, "stats"):
            out["workers"] = self.executor.stats()
        return out

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "unhealthy", "problems": [...], "cosched": [...]}``: unhealthy
        while closed, the scheduler loop stalls (``health_stall_s``) or a worker is down."""
        problems = []
        if self._closed.is_set():
            problems.append("the Server is closed")
        if not self._thread.is_alive():
            problems.append("the scheduler loop is not running")
        elif (stall := time.monotonic() - self._last_cycle) > self.config.health_stall_s:
            problems.append(f"the scheduler loop has made no progress for {stall:.0f} s")
        check = getattr(self.executor, "health", None)
        if check is not None:
            problems.extend(check())
        return {
            "status": "unhealthy" if problems else "ok",
            "problems": problems,
            "cosched": list(self._cosched_names),
        }

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.executor.wake()
        self._thread.join(timeout=10)
        self.scheduler.close()
        self.executor.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _add(
        self,
        question: Any,
        graph: Any,
        request_id: str | None,
        on_done: Any,
        *,
        on_delta: Any = None,
        on_update: Any = None,
        history: Sequence[tuple[str, str]] = (),
        inputs: Mapping[str, Any] | None = None,
    ) -> None:
        if self._closed.is_set():
            raise RuntimeError("Server is closed")
        compiled = self._resolve(graph)
        state = State(input=question)
        if history:
            state["history"] = chat_history(history)
        state.update(request_inputs(compiled, inputs))
        # NOTE: admission bound; blocks the caller (bounded), never the scheduler
        if not self._slots.acquire(timeout=self.config.call_timeout_s):
            raise WorkerError(
                f"no request slot freed within {self.config.call_timeout_s:g} s", "overloaded"
            )

        def done(response: Response) -> None:
            self._slots.release()
            on_done(response)

        req = RequestState(
            request_id or uuid.uuid4().hex,
            compiled,
            state,
            on_done=done,
            on_delta=on_delta,
            on_update=on_update,
        )
        self.scheduler.add_request(req)

    def _resolve(self, graph: Any) -> CompiledGraph:
        if isinstance(graph, str):
            if graph not in self.workflows:
                raise KeyError(
                    f"unknown workflow {graph!r}; choose one of {', '.join(self.workflows)}"
                )
            return self.workflows[graph]
        if isinstance(graph, RAGraph):
            return graph.compile()
        if isinstance(graph, CompiledGraph):
            return graph
        raise TypeError(f"graph must be a workflow name, RAGraph or CompiledGraph, not {graph!r}")

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._last_cycle = time.monotonic()
            try:
                self.scheduler.step()
            except Exception:
                logger.exception("scheduler step failed")


CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_history(turns: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    out = []
    for i, turn in enumerate(turns):
        if not (isinstance(turn, (tuple, list)) and len(turn) == 2):
            raise ValueError(f"history[{i}] must be a (role, content) pair, got {turn!r}")
        role, content = turn
        if role not in CHAT_ROLES or not isinstance(content, str):
            raise ValueError(
                f"history[{i}] must have a role in {', '.join(CHAT_ROLES)} and str content"
            )
        out.append((role, content))
    return tuple(out)


def _post(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """``fn(*args)`` on ``loop``; dropped if the loop has closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def request_inputs(graph: CompiledGraph, inputs: Mapping[str, Any] | None) -> dict[str, Any]:
    given = dict(inputs or {})
    for key in given:
        if not isinstance(key, str) or not NAME.match(key) or key in ("input", "history"):
            raise ValueError(f"inputs: {key!r} must be a state key name other than input/history")
    missing = [k for k in graph.inputs if k not in given]
    if missing:
        raise ValueError(f"inputs: the graph needs {missing[0]!r}")
    return given


def completion_graph(params: GenerationParams) -> CompiledGraph:
    from ragserve.graph import END, START

    g = RAGraph("completion").add_completion(0, params=params)
    return g.add_edge(START, 0).add_edge(0, END).compile()


def _request_output(rid: str, prompt_ids, token_ids, text, update, metrics) -> Any:
    from ragserve.generation import RequestOutput

    now = time.monotonic()
    if token_ids and metrics.first_token_time is None:
        metrics.first_token_time = now
    if update.finished:
        metrics.finish_time = now
    return RequestOutput(
        request_id=rid,
        prompt_token_ids=list(prompt_ids),
        token_ids=list(token_ids),
        text=text,
        finished=update.finished,
        finish_reason=update.finish_reason,
        metrics=dataclasses.replace(metrics),
    )


def _make_executor(model: Any, index: Any, embedder: Any, config: ServerConfig) -> Any:
    from ragserve.runtime.executors import LocalExecutor, ProcessExecutor
    from ragserve.runtime.memory_plan import plan_gpu_memory
    from ragserve.runtime.workers import WorkerSpec, build_runner

    if not config.in_process and config.backend != "ray":
        _check_paths(model, index, embedder, "worker processes")
        start_fork_server(config.worker_start_method)  # it imports while the rest resolves
    if isinstance(index, str) and index == "factbook" and not Path(index).is_dir():
        from ragserve.retrieval import builtin_index

        index = builtin_index("factbook")
    if config.backend == "ray":
        from ragserve.runtime.ray_backend import RayExecutor

        _check_paths(model, index, embedder, "Ray actors")
        return RayExecutor(
            str(model), str(index), None if embedder is None else str(embedder), config
        )
    config, plan = plan_gpu_memory(config, model, index)
    tier = None if plan.tier_bytes is None else config.gpu_tier.tier_spec(plan.tier_bytes)
    # NOTE: in process, the model and the index may be live objects; the builders take both
    level = logging.getLogger("ragserve").getEffectiveLevel()
    gen = WorkerSpec("generation", model, index, embedder, tier, config, level)
    ret = dataclasses.replace(gen, kind="retrieval")
    if config.in_process:
        return LocalExecutor(build_runner(gen), build_runner(ret))
    return ProcessExecutor(gen, ret, config)


def _check_paths(model: Any, index: Any, embedder: Any, where: str) -> None:
    for name, value in (("model", model), ("index", index), ("embedder", embedder)):
        if value is not None and not isinstance(value, (str, Path)):
            raise TypeError(
                f"{name} must be a name or a path for {where}, got "
                f"{type(value).__name__}; pass ServerConfig(in_process=True) for live objects"
            )
