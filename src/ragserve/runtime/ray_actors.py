"""The Ray backend's actors (plain classes the backend wraps with ``ray.remote``): LLM
replicas, the retrieval coordinator, and the shard client. Each actor runs a worker loop
(``workers.serve_*``) on its own thread; Ray method calls only enqueue messages or take what
the loop produced (``poll``), so the actors need ``max_concurrency > 1``."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from ragserve.retrieval.sharded import BaseShard
from ragserve.runtime.errors import ShardDiedError
from ragserve.runtime.runners import GenerationRunner
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.runtime.wire import AbortGenerationMsg, CallMsg, SubmitMsg, drain
from ragserve.runtime.workers import serve_generation, serve_retrieval

if TYPE_CHECKING:
    from ragserve.retrieval.index_tier import TierSpec

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # the loop's inbox wait while its runner has nothing to do
RESTART_WAIT_S = 120.0  # how long a shard call's retry waits for the actor's restart


class _Actor:
    """A runner, its loop's thread, and the loop's outbox: ``poll`` returns everything
    produced since the last ``poll``, with the actor's ``stats()``."""

    def __init__(self, runner: Any, loop: Any) -> None:
        self.runner = runner
        self.num_tasks = 0
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: list[Any] = []
        self._ready = threading.Condition()
        self._replies: dict[int, Future] = {}
        self._tokens = itertools.count()
        self._thread = threading.Thread(
            target=self._run, args=(loop,), name=type(self).__name__, daemon=True
        )
        self._thread.start()

    def ping(self) -> bool:
        return True

    def submit(self, tasks: list) -> None:
        self.num_tasks += len(tasks)
        self._inbox.put(SubmitMsg(tuple(tasks)))

    def poll(self, timeout: float) -> tuple[list[Any], dict[str, Any]]:
        with self._ready:
            if not self._outbox:
                self._ready.wait(timeout)
            out, self._outbox = self._outbox, []
        return out, self.stats()

    def _run(self, loop: Any) -> None:
        while True:  # NOTE: a loop that raised is entered again: the actor keeps serving
            try:
                return loop(self.runner, self._drain, self)
            except Exception:
                logger.exception("%s loop failed", type(self).__name__)

    def _drain(self, block: bool) -> list[Any]:
        return drain(self._inbox, IDLE_WAIT_S if block else None)

    def _emit(self, items: list[Any]) -> None:
        if items:
            with self._ready:
                self._outbox.extend(items)
                self._ready.notify_all()

    def reply(self, msg: CallMsg, value: Any, exc: Exception | None) -> None:
        fut = self._replies.pop(msg.token)
        fut.set_result(value) if exc is None else fut.set_exception(exc)

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError


class LLMReplica(_Actor):
    """One full ``LLMEngine`` (one GPU, or CPU in tests) behind a ``GenerationRunner``."""

    def __init__(self, model: str, engine_kwargs: tuple[tuple[str, Any], ...] = ()) -> None:
        runner = GenerationRunner.build(model, engine_kwargs)
        self._engine_stats: dict[str, Any] = runner.engine.stats()
        super().__init__(runner, serve_generation)

    def abort(self, task_ids: list[str]) -> None:
        self._inbox.put(AbortGenerationMsg(tuple(task_ids)))

    def send_generation(self, updates: list, stats: dict[str, Any] | None) -> None:
        self._engine_stats = stats or self._engine_stats
        self._emit(updates)

    def send_stats(self, stats: dict[str, Any]) -> None:
        self._engine_stats = stats

    def stats(self) -> dict[str, Any]:
        return {**self._engine_stats, "tasks": self.num_tasks}


class RetrievalCoordinator(_Actor):
    """The embedder and the retrieval runner over one index folder (``tier``: its GPU tier), or
    a ``ShardedIndex`` of the Ray actors ``shard_names`` laid out under ``shard_root``."""

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
        if shard_root is not None:
            import ray

            from ragserve.retrieval.shard_split import read_layout
            from ragserve.retrieval.sharded import ShardedIndex, read_quantizer

            shards = [RayShard(ray.get_actor(n)) for n in shard_names or []]
            vindex = ShardedIndex(shards, read_layout(shard_root), read_quantizer(shard_root))
        runner = StagedRetrievalRunner.build(
            vindex, embedder, default_nprobe, tier=tier, reranker=reranker
        )
        if shard_root is not None:
            vindex._embedder = runner.embedder
        self._own_index = shard_root is None  # its tier is reported here (shards: their own)
        self.num_batches = 0
        super().__init__(runner, serve_retrieval)

    def call(self, name: str, args: tuple) -> Any:
        """``StagedRetrievalRunner.<name>(*args)`` (upserts), run between two searches."""
        fut: Future = Future()
        token = next(self._tokens)
        self._replies[token] = fut
        self._inbox.put(CallMsg(token, name, args))
        return fut.result()

    def send_retrieval(self, results: list) -> None:
        self.num_batches += 1
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


class RayShard(BaseShard):
    """A ``BaseShard`` whose ``ShardServer`` is a Ray actor. An idempotent call (searches,
    reads) that finds the actor dead is retried once, after Ray restarted it from its folder;
    a write is not: its caller gets the error and the shard holds what it acknowledged."""

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
