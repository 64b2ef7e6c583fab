"""Bounded admission: at most ``limit`` generation requests in flight; the rest get 429."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ragserve.server.errors import APIError


class Admission:
    """A non-blocking counter of admitted requests (single event loop, so no lock).

    ``admit()`` is a context manager for handlers that finish inside it; streaming handlers
    call ``try_acquire()`` and ``release()`` themselves, releasing when the stream ends.
    """

    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.num_inflight = 0
        self.num_rejected = 0

    def try_acquire(self) -> None:
        """Take a slot or raise a 429 ``APIError`` with ``Retry-After``."""
        if self.num_inflight >= self.limit:
            self.num_rejected += 1
            raise APIError(
                429,
                f"server is at its admission limit of {self.limit} concurrent requests; "
                f"retry after {self.retry_after_s} s",
                code="too_many_requests",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.num_inflight += 1

    def release(self) -> None:
        assert self.num_inflight > 0, "release() without a matching try_acquire()"
        self.num_inflight -= 1

    @contextmanager
    def admit(self) -> Iterator[None]:
        self.try_acquire()
        try:
            yield
        finally:
            self.release()
