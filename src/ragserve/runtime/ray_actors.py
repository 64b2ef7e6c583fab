"""The Ray backend's actors: LLM replicas, the retrieval coordinator, and the shard client.

Each actor owns one runner and drives it from its own thread, as a worker process does
(``workers.py``); Ray method calls only enqueue work or wait for results::

    driver ── submit(tasks) / abort(ids) ──> inbox ──> loop thread: runner.add / step / run
    driver <── poll(timeout): (updates, stats) ── outbox <──┘

Actors are created with ``max_concurrency > 1`` so a waiting ``poll`` never blocks
``submit``. The classes are plain Python: the backend wraps them with ``ray.remote`` (so this
module imports Ray lazily and the classes can be tested in process).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import numpy as np

from ragserve.retrieval.sharded import BaseShard
from ragserve.runtime.runners import GenerationRunner
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.runtime.wire import check_call, drain
from ragserve.scheduler import RetrievalResult

if TYPE_CHECKING:
    from ragserve.retrieval.index_tier import TierSpec

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # the loop's inbox wait while its runner has nothing to do
RESTART_WAIT_S = 120.0  # how long a shard call's retry waits for the actor's restart


class _ActorLoop:
    """Inbox, outbox and the thread that serves them; subclasses define ``_handle`` and
    ``_work``. ``poll`` returns everything produced since the last ``poll``."""

    def __init__(self) -> None:
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: list[Any] = []
        self._ready = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=type(self).__name__, daemon=True)
        self._thread.start()

    def ping(self) -> bool:
        return True

    def poll(self, timeout: float) -> tuple[list[Any], dict[str, Any]]:
        with self._ready:
            if not self._outbox:
                self._ready.wait(timeout)
            out, self._outbox = self._outbox, []
        return out, self.stats()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5.0)

    def _emit(self, items: list[Any]) -> None:
        if items:
            with self._ready:
                self._outbox.extend(items)
                self._ready.notify_all()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                # NOTE: waits up to ``IDLE_WAIT_S`` for a message while the runner is idle
                self._work(drain(self._inbox, None if self._busy() else IDLE_WAIT_S))
            except Exception:
                logger.exception("%s loop failed", type(self).__name__)

    def _busy(self) -> bool:
        raise NotImplementedError

    def _work(self, msgs: list[Any]) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError


class LLMReplica(_ActorLoop):
    """One full ``LLMEngine`` (one GPU, or CPU in tests) behind a ``GenerationRunner``."""

    def __init__(self, model: str, engine_kwargs: tuple[tuple[str, Any], ...] = ()) -> None:
        self.runner = GenerationRunner.build(model, engine_kwargs)
        self._engine_stats: dict[str, Any] = self.runner.engine.stats()
        self.num_tasks = 0
        super().__init__()

    def submit(self, tasks: list) -> None:
        self._inbox.put(("gen", tasks))

    def abort(self, task_ids: list[str]) -> None:
        self._inbox.put(("abort", task_ids))

    def _busy(self) -> bool:
        return self.runner.has_work()

    def _work(self, msgs: list[Any]) -> None:
        out: list[Any] = []
        for kind, payload in msgs:
            if kind == "gen":
                self.num_tasks += len(payload)
                out.extend(self.runner.add(payload))
            else:
                self.runner.abort(payload)
        if self.runner.has_work():
            out.extend(self.runner.step())
        self._engine_stats = self.runner.engine.stats()
        self._emit(out)

    def stats(self) -> dict[str, Any]:
        return {**self._engine_stats, "tasks": self.num_tasks}


class ShardedRetrievalRunner(StagedRetrievalRunner):
    """``StagedRetrievalRunner`` over a ``ShardedIndex`` (the cluster of a row id is asked of
    the shards instead of read from one Faiss index)."""

    def _clusters_of(self, ids: np.ndarray) -> np.ndarray:
        return self.index.clusters_of(ids)


class RetrievalCoordinator(_ActorLoop):
    """The embedder and the retrieval runner: one index folder, or a ``ShardedIndex`` whose
    shards are Ray actors (named ``shard_names``) laid out under ``shard_root``. ``tier``
    places the GPU tier of the one index folder (the shards hold their own); ``reranker``: the
    rerank nodes' (``OperatorConfig.reranker``, built here)."""

    def __init__(
        self,
        index: str,
        embedder: str | None,
        default_nprobe: int | None,
        shard_root: str | None = None,
        shard_names: list[str] | None = None,
        tier: TierSpec | None = None,
        reranker: str = "embedding",
    ) -> None:
        vindex: Any = index  # a folder: ``build`` loads it and places its tier (on restarts too)
        runner_cls: type = StagedRetrievalRunner
        if shard_root is not None:
            import ray

            from ragserve.retrieval.shard_split import read_layout
            from ragserve.retrieval.sharded import ShardedIndex, read_quantizer

            shards = [RayShard(ray.get_actor(n)) for n in shard_names or []]
            vindex = ShardedIndex(shards, read_layout(shard_root), read_quantizer(shard_root))
            runner_cls = ShardedRetrievalRunner
        self.runner = runner_cls.build(
            vindex, embedder, default_nprobe, tier=tier, reranker=reranker
        )
        if shard_root is not None:
            vindex._embedder = self.runner.embedder
        self._own_index = shard_root is None  # its tier is reported here (shards: their own)
        self.num_tasks = 0
        self.num_batches = 0
        super().__init__()

    def submit(self, tasks: list) -> None:
        self._inbox.put(("ret", tasks))

    def call(self, name: str, args: tuple) -> Any:
        """``RetrievalRunner.<name>(*args)`` (upserts), run between two searches."""
        fut: Future = Future()
        self._inbox.put(("call", (fut, name, args)))
        return fut.result()

    def _busy(self) -> bool:
        return self.runner.has_pending()

    def _work(self, msgs: list[Any]) -> None:
        tasks = []
        for kind, payload in msgs:
            if kind == "ret":
                tasks.extend(payload)
                continue
            fut, name, args = payload
            try:
                fut.set_result(check_call(name)(self.runner, *args))
            except Exception as exc:
                fut.set_exception(exc)
        if not tasks and not self.runner.has_pending():
            return
        self.num_tasks += len(tasks)
        self.num_batches += 1
        try:
            results = self.runner.run(tasks)
        except Exception as exc:
            logger.exception("retrieval batch failed")
            err = f"{type(exc).__name__}: {exc}"
            kind = "worker_died" if isinstance(exc, ShardDiedError) else None
            results = [RetrievalResult(t.task_id, (), err, error_kind=kind) for t in tasks]
        self._emit(results)

    def stats(self) -> dict[str, Any]:
        out = {
            "tasks": self.num_tasks,
            "batches": self.num_batches,
            "pending": int(self.runner.has_pending()),
        }
        tier = self.runner.index.gpu_tier if self._own_index else None
        if tier is not None:
            out["tier_clusters"] = len(tier.clusters)
            out["tier_bytes"] = int(tier.num_bytes)
        return out


class ShardDiedError(RuntimeError):
    """A shard actor died during a call (and, for idempotent calls, again on the retry)."""


class RayShard(BaseShard):
    """A ``BaseShard`` whose ``ShardServer`` is a Ray actor (one shard folder each). Large
    arrays (queries, top-k ids and scores) travel through Ray's object store. A call that finds
    its actor dead is retried once when it is idempotent (searches and reads): Ray restarts the
    actor from its folder (``max_restarts``), and the retry waits until it answers. Writes are
    not retried: their caller gets the error and the shard holds whatever it acknowledged."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.num_retries = 0

    def submit(self, method: str, *args: Any, idempotent: bool = True) -> Any:
        import ray
        from ray.exceptions import RayActorError

        ref = getattr(self.handle, method).remote(*args)

        def wait() -> Any:
            try:
                return ray.get(ref)
            except RayActorError as exc:
                if not idempotent:
                    raise ShardDiedError(f"index shard died during {method}: {exc}") from None
                logger.warning("index shard died during %s; retrying once", method)
            self.num_retries += 1
            self._wait_restarted()
            try:
                return ray.get(getattr(self.handle, method).remote(*args))
            except RayActorError as exc:
                raise ShardDiedError(f"index shard died during {method} twice: {exc}") from None

        return wait

    def _wait_restarted(self) -> None:
        """Block until the actor answers again (Ray restarts it), at most ``RESTART_WAIT_S``."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        deadline = time.monotonic() + RESTART_WAIT_S
        while time.monotonic() < deadline:
            try:
                ray.get(self.handle.stats.remote(), timeout=max(0.1, deadline - time.monotonic()))
                return
            except (RayActorError, GetTimeoutError):
                time.sleep(0.1)
