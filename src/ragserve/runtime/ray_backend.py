"""``RayExecutor``: the scheduler's tasks on Ray actors (``ServerConfig(backend="ray")``): LLM
replicas, one retrieval coordinator fanning out to index shards, GPUs from one placement group
(``plan_gpus``). One long-poll call per actor, waited on with ``ray.wait``; a dead replica
fails its in-flight tasks, a dead coordinator's retrievals are resent once. Layout and faults:
docs/architecture.md "Scale-out on Ray", docs/scale_out.md."""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from collections import Counter, defaultdict
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ragserve.runtime.config import ServerConfig, at_least
from ragserve.runtime.errors import failed_results
from ragserve.scheduler import (
    BaseExecutor,
    GenerationTask,
    RetrievalTask,
    Update,
)

if TYPE_CHECKING:
    from ragserve.retrieval.index_tier import TierSpec

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3  # per actor; past it the actor stays dead and its tasks fail at once
POLL_S = 0.5  # an actor's long-poll: it answers at once with results, else after this
REPOLL_S = 0.2  # pause before polling an actor whose last poll failed
RETRIEVAL = "retrieval"
TIER_GPU_SHARE = 0.25  # Ray's GPU accounting for a tier holder beside an LLM replica


@dataclass(frozen=True)
class GpuPlan:
    """``num_bundles`` one-GPU bundles (0: no placement group); each replica's and each tier
    holder's GPU share (0: on CPU). Replica ``i`` and holder ``j`` sit in bundles ``i``, ``j``."""

    num_bundles: int
    replica_gpus: float
    tier_gpus: float


def plan_gpus(
    num_replicas: int, num_holders: int, replicas_on_gpu: bool, tier_on_gpu: bool, gpus: float
) -> GpuPlan:
    """``ValueError`` naming the field when they do not fit in ``gpus``."""
    need = max(num_replicas if replicas_on_gpu else 0, num_holders if tier_on_gpu else 0)
    if need > gpus:
        what = f"{num_holders} GPU index tier holders" if tier_on_gpu else "LLM replicas"
        raise ValueError(
            f"gpu_tier.device: {what} and {num_replicas} LLM replicas need {need} GPUs; "
            f"the cluster has {gpus:g}"
        )
    replica = 0.0
    if replicas_on_gpu:
        replica = 1.0 - TIER_GPU_SHARE if tier_on_gpu else 1.0
    return GpuPlan(need, replica, TIER_GPU_SHARE if tier_on_gpu else 0.0)


def start_ray(config: ServerConfig) -> bool:
    """Join ``config.ray_address`` or start a local cluster; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    env = {"env_vars": {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}}
    local = config.ray_address is None
    cluster = {"num_cpus": config.ray_num_cpus or os.cpu_count() or 1, "include_dashboard": False}
    where = cluster if local else {"address": config.ray_address}
    ray.init(runtime_env=env, log_to_driver=False, **where)
    return local


def shard_root(index: str | Path, num_shards: int, partition: str) -> Path:
    """A sibling folder of ``index`` holding its shards (split on first use)."""
    index = Path(index).absolute()
    root = index.parent / f"{index.name}.shards-{num_shards}-{partition}"
    if not root.exists():
        from ragserve.retrieval.shard_split import split_index

        split_index(index, root, num_shards, partition)
        logger.info("split %s into %d shards (%s) at %s", index, num_shards, partition, root)
    return root


class ReplicaRouter:
    """Which LLM replica runs a generation task. A task goes to the replica its affinity key
    (the prompt's first ``affinity_chars`` characters, or ``// 4`` token ids: RAG prompts start
    with their passages, so they meet the same prefix cache) wins by rendezvous hashing, unless
    that one is down or holds ``overload_slack`` more tasks than the least loaded replica that
    is up (lowest index on ties), which then gets it. Mutated by ``route`` (a task starts) and
    ``finish`` (its final update or abort)."""

    def __init__(
        self, num_replicas: int, *, affinity_chars: int = 256, overload_slack: int = 4
    ) -> None:
        at_least(1, num_replicas=num_replicas)
        at_least(0, affinity_chars=affinity_chars, overload_slack=overload_slack)
        self.num_replicas = num_replicas
        self.affinity_chars = affinity_chars
        self.overload_slack = overload_slack
        self.loads = [0] * num_replicas
        self._replica_of: dict[str, int] = {}
        self._down: set[int] = set()
        self.num_affinity = 0  # tasks sent to their affinity replica
        self.num_spilled = 0  # tasks sent elsewhere because it was overloaded

    def route(self, task_id: str, prompt: str | tuple[int, ...] | list[int]) -> int:
        """The replica for a new task (``task_id`` must not be in flight)."""
        if task_id in self._replica_of:
            raise ValueError(f"task {task_id!r} is already routed")
        preferred = self.preferred(prompt)
        up = [i for i in range(self.num_replicas) if i not in self._down] or [preferred]
        least = min(up, key=lambda i: (self.loads[i], i))
        if preferred not in up or self.loads[preferred] - self.loads[least] > self.overload_slack:
            choice = least
            self.num_spilled += 1
        else:
            choice = preferred
            self.num_affinity += 1
        self.loads[choice] += 1
        self._replica_of[task_id] = choice
        return choice

    def preferred(self, prompt: str | tuple[int, ...] | list[int]) -> int:
        """The affinity replica of ``prompt`` (load ignored)."""
        if isinstance(prompt, str):
            key = prompt[: self.affinity_chars].encode()
        else:
            key = repr(list(prompt[: self.affinity_chars // 4])).encode()
        return max(range(self.num_replicas), key=lambda i: _weight(key, i))

    def set_available(self, replica: int, available: bool) -> None:
        """A replica that is down (restarting) gets no new tasks while another is up."""
        (self._down.discard if available else self._down.add)(replica)

    def replica_of(self, task_id: str) -> int | None:
        return self._replica_of.get(task_id)

    def finish(self, task_id: str) -> int | None:
        """Forget a task; returns its replica (``None`` if unknown)."""
        replica = self._replica_of.pop(task_id, None)
        if replica is not None:
            self.loads[replica] -= 1
        return replica

    def tasks_on(self, replica: int) -> list[str]:
        return [t for t, r in self._replica_of.items() if r == replica]

    def stats(self) -> dict[str, Any]:
        return {"affinity": self.num_affinity, "spilled": self.num_spilled}


def _weight(key: bytes, replica: int) -> int:
    digest = hashlib.blake2b(key, digest_size=8, salt=replica.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little")


class RayExecutor(BaseExecutor):
    """LLM replicas, the retrieval coordinator and index shards as Ray actors (module doc)."""

    def __init__(self, model: str, index: str, embedder: str | None, config: ServerConfig):
        import ray

        self._init_state(config)
        self._owns_ray = start_ray(config)
        self._ray = ray
        try:
            self._plan_placement()
            self.shards = self._start_shards(index)
            self.actors = {RETRIEVAL: self._start_coordinator(index, embedder)}
            self.actors.update((f"llm_{i}", a) for i, a in enumerate(self._start_replicas(model)))
            pending = [a.ping.remote() for a in self.actors.values()]
            pending += [s.stats.remote() for s in self.shards]
            ray.get(pending, timeout=config.worker_start_timeout)
        except BaseException:
            self.close()
            raise
        self._polls.update({self._poll(name): name for name in self.actors})

    def _init_state(self, config: ServerConfig) -> None:
        self.config = config
        self.router = ReplicaRouter(config.num_llm_replicas)
        self._retrievals: dict[str, tuple[RetrievalTask, int]] = {}  # task -> (task, attempts)
        self._errors: list[Update] = []
        self._restarts: dict[str, int] = {}
        self._down: dict[str, float] = {}  # actors whose last poll failed -> since when
        self._repoll_at: dict[str, float] = {}  # down actors: when to poll them again
        self._held: list[RetrievalTask] = []  # retrievals waiting for the coordinator
        self._actor_stats: dict[str, dict[str, Any]] = {}
        self._pg = None
        self._gpu_plan = GpuPlan(0, 0.0, 0.0)
        self._shard_root: Path | None = None
        self._shard_names: list[str] = []
        self._prefix = f"ragserve-{uuid.uuid4().hex[:12]}"
        self._owns_ray = False
        self.actors: dict[str, Any] = {}
        self.shards: list = []
        self._polls: dict[Any, str] = {}  # in-flight long-poll ref -> actor name

    # -- start ------------------------------------------------------------------------------
    def _tier_spec(self, num_holders: int) -> TierSpec | None:
        from ragserve.retrieval.sharded import shard_tier_budget

        tier = self.config.gpu_tier
        if tier is None or tier.budget_bytes is None:
            return None
        return tier.tier_spec(shard_tier_budget(tier.budget_bytes, num_holders))

    def _plan_placement(self) -> None:
        from ray.util.placement_group import placement_group

        n = self.config.num_llm_replicas
        device = dict(self.config.engine_kwargs).get("device", "auto")
        gpus = self._ray.cluster_resources().get("GPU", 0)
        if device not in ("cpu", "auto") and gpus < n:
            raise ValueError(f"{n} LLM replicas on {device!r} need {n} GPUs; cluster has {gpus}")
        replicas_on_gpu = device != "cpu" and gpus >= n
        tier = self.config.gpu_tier
        tier_on_gpu = tier is not None and tier.device != "cpu"
        plan = plan_gpus(n, self.config.num_index_shards, replicas_on_gpu, tier_on_gpu, gpus)
        self._gpu_plan = plan
        if plan.num_bundles:
            # NOTE: one GPU per bundle, reserved together (PACK: on as few nodes as possible).
            self._pg = placement_group([{"GPU": 1, "CPU": 1}] * plan.num_bundles, strategy="PACK")
            self._ray.get(self._pg.ready(), timeout=self.config.worker_start_timeout)

    def _actor(self, cls: type, bundle: int, gpus: float, **options: Any) -> Any:
        """``cls`` as a restartable Ray actor class; with ``gpus``, that share of a GPU in
        placement group bundle ``bundle``."""
        if gpus:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            strategy = PlacementGroupSchedulingStrategy(self._pg, bundle)
            options.update(num_gpus=gpus, scheduling_strategy=strategy)
        options.update(max_restarts=MAX_RESTARTS, max_concurrency=4)
        return self._ray.remote(cls).options(**options)

    def _start_shards(self, index: str) -> list:
        from ragserve.retrieval.sharded import ShardServer

        m = self.config.num_index_shards
        if m == 1:
            return []
        self._shard_root = shard_root(index, m, self.config.shard_partition)
        self._shard_names = [f"{self._prefix}-shard-{i}" for i in range(m)]
        tier, gpus = self._tier_spec(m), self._gpu_plan.tier_gpus
        return [
            self._actor(ShardServer, i, gpus, num_cpus=0, name=name).remote(
                str(self._shard_root / f"shard-{i}"), tier
            )
            for i, name in enumerate(self._shard_names)
        ]

    def _start_coordinator(self, index: str, embedder: str | None) -> Any:
        from ragserve.runtime.ray_actors import RetrievalCoordinator

        single = self._shard_root is None  # it opens the index itself (and holds the tier)
        gpus = self._gpu_plan.tier_gpus if single else 0.0
        root = None if single else str(self._shard_root)
        # NOTE: shards are passed by name, not handle: handles would make the constructor's
        # arguments objects in the store, which a restart after they are freed cannot read.
        names = self._shard_names or None
        tier = self._tier_spec(1) if single else None
        reranker = self.config.operators.reranker
        return self._actor(RetrievalCoordinator, 0, gpus, num_cpus=0).remote(
            index, embedder, self.config.default_nprobe, root, names, tier, reranker=reranker
        )

    def _start_replicas(self, model: str) -> list:
        from ragserve.runtime.ray_actors import LLMReplica

        share = self._gpu_plan.replica_gpus  # NOTE: on CPU no Ray CPU reservation either
        return [
            self._actor(LLMReplica, i, share, num_cpus=int(share > 0)).remote(
                model, self.config.engine_kwargs
            )
            for i in range(self.config.num_llm_replicas)
        ]

    # -- BaseExecutor -----------------------------------------------------------------------
    def submit_generation(self, tasks: list[GenerationTask]) -> None:
        groups: dict[int, list[GenerationTask]] = defaultdict(list)
        for t in tasks:
            groups[self.router.route(t.task_id, t.prompt)].append(t)
        for replica, group in groups.items():
            self.actors[f"llm_{replica}"].submit.remote(group)

    def submit_retrieval(self, tasks: list[RetrievalTask]) -> None:
        for t in tasks:
            self._retrievals[t.task_id] = (t, 1)
        if self._is_given_up(RETRIEVAL):
            self._errors.extend(self._on_death(RETRIEVAL, RuntimeError("gone")))
        elif RETRIEVAL in self._down:
            self._held.extend(tasks)  # sent once the restarted coordinator answers a poll
        else:
            self.actors[RETRIEVAL].submit.remote(list(tasks))

    def abort(self, task_ids: list[str]) -> None:
        groups: dict[int | None, list[str]] = defaultdict(list)
        for tid in task_ids:
            groups[self.router.finish(tid)].append(tid)
        groups.pop(None, None)
        for replica, ids in groups.items():
            self.actors[f"llm_{replica}"].abort.remote(ids)

    def poll(self, timeout: float) -> list[Update]:
        updates: list[Update] = list(self._errors)
        self._errors.clear()
        now = time.monotonic()
        for name, due in list(self._repoll_at.items()):
            if due <= now:  # NOTE: a dead actor is re-polled after a pause, not in a hot loop
                del self._repoll_at[name]
                self._polls[self._poll(name)] = name
        refs = list(self._polls)
        wait_s = 0.0 if updates else timeout
        if not refs:
            time.sleep(min(wait_s, REPOLL_S))
            return updates
        ready, _ = self._ray.wait(refs, num_returns=1, timeout=wait_s)
        if ready:
            ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0.0)
        for ref in ready:
            name = self._polls.pop(ref)
            updates.extend(self._collect(name, ref))
            if name in self._down:
                self._repoll_at[name] = time.monotonic() + REPOLL_S
            else:
                self._polls[self._poll(name)] = name
        return updates

    def _poll(self, name: str) -> Any:
        return self.actors[name].poll.remote(POLL_S)

    def _collect(self, name: str, ref: Any) -> list[Update]:
        from ray.exceptions import RayActorError

        try:
            items, stats = self._ray.get(ref)
        except RayActorError as exc:
            return self._on_death(name, exc)
        self._actor_stats[name] = stats
        if name in self._down:
            self._on_back(name)
        for u in items:
            if not getattr(u, "finished", True):
                continue
            if name == RETRIEVAL:
                self._retrievals.pop(u.task_id, None)
            else:
                self.router.finish(u.task_id)
        return items

    def _is_given_up(self, name: str) -> bool:
        """Down for longer than a start may take: its restarts are exhausted or failing."""
        since = self._down.get(name)
        return since is not None and time.monotonic() - since > self.config.worker_start_timeout

    def _on_back(self, name: str) -> None:
        """A restarted actor answered: route to it again, send the retrievals held for it."""
        self._down.pop(name, None)
        logger.info("%s actor is back", name)
        if name != RETRIEVAL:
            self.router.set_available(int(name.removeprefix("llm_")), True)
        elif self._held:
            held, self._held = self._held, []
            self.actors[RETRIEVAL].submit.remote(held)

    def _on_death(self, name: str, exc: Exception) -> list[Update]:
        """A poll failed: the actor died (or is still restarting: then nothing is lost)."""
        if name not in self._down:
            self._down[name] = time.monotonic()
            self._restarts[name] = self._restarts.get(name, 0) + 1
            logger.warning("%s actor died (%s); Ray restarts it", name, type(exc).__name__)
        reason = f"{name} actor died ({type(exc).__name__}); Ray restarts it"
        if name != RETRIEVAL:
            replica = int(name.removeprefix("llm_"))
            self.router.set_available(replica, False)
            lost = self.router.tasks_on(replica)
            for tid in lost:
                self.router.finish(tid)
            if lost:  # a submit that raced the death may have reached the restarted instance
                self.actors[name].abort.remote(lost)
            return failed_results(True, lost, reason, "worker_died")
        held = {t.task_id for t in self._held}
        given_up = self._is_given_up(name)
        if given_up:
            held = set()
            self._held.clear()
            reason = (
                f"{name} actor did not come back within {self.config.worker_start_timeout:.0f} s"
            )
        failed = []
        for t, attempts in list(self._retrievals.values()):
            if t.task_id in held:
                continue
            if attempts < 2 and not given_up:  # idempotent: one retry each
                self._retrievals[t.task_id] = (t, 2)
                self._held.append(t)
            else:
                del self._retrievals[t.task_id]
                failed.append(t.task_id)
        return failed_results(False, failed, reason, "worker_died")

    # -- documents, stats, close ------------------------------------------------------------
    def call_retrieval(self, name: str, *args: Any) -> Future:
        return self.actors[RETRIEVAL].call.remote(name, args).future()

    def engine_stats(self) -> dict[str, Any]:
        total: Counter = Counter()
        for name, stats in self._actor_stats.items():
            if name != RETRIEVAL:
                total.update({k: v for k, v in stats.items() if isinstance(v, (int, float))})
        total.pop("tasks", None)
        return dict(total)

    def stats(self) -> dict[str, Any]:
        loads = {f"llm_{i}": n for i, n in enumerate(self.router.loads)}
        out: dict[str, Any] = {
            name: {
                **self._actor_stats.get(name, {}),
                "restarts": self._restarts.get(name, 0),
                "alive": name not in self._down,
                "in_flight": loads.get(name, len(self._retrievals)),
            }
            for name in self.actors
        }
        out["router"] = self.router.stats()
        out.update(self._shard_stats())
        return out

    def _shard_stats(self) -> dict[str, Any]:
        from ray.exceptions import GetTimeoutError, RayActorError

        out: dict[str, Any] = {}
        refs = [s.stats.remote() for s in self.shards]
        for i, ref in enumerate(refs):
            try:
                out[f"shard_{i}"] = {**self._ray.get(ref, timeout=1.0), "alive": True}
            except (GetTimeoutError, RayActorError):
                out[f"shard_{i}"] = {"alive": False}
        return out

    def close(self) -> None:
        actors = [*self.actors.values(), *self.shards]
        for actor in actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                logger.debug("kill failed", exc_info=True)
        self.actors, self.shards = {}, []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
            self._pg = None
        if self._owns_ray:
            self._ray.shutdown()
            self._owns_ray = False
