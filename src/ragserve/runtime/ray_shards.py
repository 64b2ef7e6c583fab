"""``RayShard``: a ``BaseShard`` whose ``ShardServer`` is a Ray actor (one shard folder each).

Large arrays (queries, top-k ids and scores) travel through Ray's object store. A call that
finds its actor dead is retried once when it is idempotent (searches and reads): Ray restarts
the actor from its folder (``max_restarts``), and the retry waits until it answers. Writes are not
retried: their caller gets the error and the shard holds whatever it acknowledged.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ragserve.retrieval.sharded import BaseShard

logger = logging.getLogger(__name__)

RESTART_WAIT_S = 120.0  # how long a retry waits for a dead shard's restart (index load)


class ShardDiedError(RuntimeError):
    """A shard actor died during a call (and, for idempotent calls, again on the retry)."""


class RayShard(BaseShard):
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
