"""``ReplicaRouter``: which LLM replica runs a generation task. A task goes to the replica its
affinity key (the prompt's first ``affinity_chars`` characters, or ``// 4`` token ids: RAG
prompts start with their passages, so they meet the same prefix cache) wins by rendezvous
hashing, unless that one is down or holds ``overload_slack`` more tasks than the least loaded
replica that is up (lowest index on ties), which then gets it."""

from __future__ import annotations

import hashlib
from typing import Any


class ReplicaRouter:
    """Mutated by ``route`` (a task starts) and ``finish`` (its final update or abort)."""

    def __init__(
        self, num_replicas: int, *, affinity_chars: int = 256, overload_slack: int = 4
    ) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if affinity_chars < 0:
            raise ValueError(f"affinity_chars must be >= 0, got {affinity_chars}")
        if overload_slack < 0:
            raise ValueError(f"overload_slack must be >= 0, got {overload_slack}")
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
        if available:
            self._down.discard(replica)
        else:
            self._down.add(replica)

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
