"""Per-request bookkeeping: state, position in the graph, node timings, and the ``Response``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ragserve.graph import CompiledGraph, FanOut, Passage, State
from ragserve.scheduler.messages import GenerationUpdate

ErrorKind = Literal["bad_request", "worker_died", "internal", "aborted", "overloaded"]
"""Why a request failed (docs/reliability.md): ``bad_request`` (input the engine rejects, a
duplicate id), ``worker_died``, ``aborted``, ``overloaded`` (a full queue: HTTP 429) or
``internal`` (anything else)."""


@dataclass
class NodeTiming:
    """When one node run became ready, was dispatched, gave its first token, finished."""

    node_id: Any
    kind: str
    ready_at: float
    dispatched_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    num_tokens: int = 0
    is_answer: bool = False
    num_prompt_tokens: int = 0  # generation: the prompt's tokens (chat template applied)
    finish_reason: str | None = None  # generation: the engine's ("stop", "length", ...)

    @property
    def duration(self) -> float | None:
        if self.finished_at is None:
            return None
        return self.finished_at - self.ready_at


@dataclass(frozen=True)
class Response:
    """One request's answer, final state, retrieved passages and timings; on failure
    ``error`` and ``error_kind`` say why (``output`` may be partial)."""

    request_id: str
    output: str
    state: dict
    doc_ids: tuple[str, ...]
    titles: tuple[str | None, ...]
    timings: dict  # node id -> seconds from ready to finished, summed over its runs
    error: str | None = None
    node_timings: tuple[NodeTiming, ...] = ()  # every node run, in order
    arrival_time: float = 0.0
    finish_time: float = 0.0
    error_kind: ErrorKind | None = None

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to the first token of the answer."""
        for t in self.node_timings:
            if t.is_answer and t.first_token_at is not None:
                return t.first_token_at - self.arrival_time
        return None


@dataclass
class NodeRun:
    """One run of one node: ready (``task_id`` None) or dispatched. ``state`` is what it
    reads (inside a fan-out, branch ``branch``'s own copy)."""

    node_id: Any
    state: State
    timing: NodeTiming
    task_id: str | None = None
    partial_text: str = ""  # a running generation's text so far
    branch: int | None = None
    seq: int = 0  # the request's run count when this run started (part of its task id)


@dataclass
class OpenJoin:
    """A running fan-out: what each finished branch left behind."""

    fanout: FanOut
    states: list[State | None]
    retrieved: list[dict[str, Passage]]


@dataclass
class RequestState:
    """A request inside the scheduler (mutated by its thread only): ``runs`` ready or in
    flight, one per branch inside a fan-out (``join``). ``on_update`` sees every raw update
    of its completion nodes."""

    request_id: str
    graph: CompiledGraph
    state: State
    on_done: Callable[[Response], None]
    on_delta: Callable[[str], None] | None = None
    on_update: Callable[[GenerationUpdate], None] | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    runs: list[NodeRun] = field(default_factory=list)
    join: OpenJoin | None = None
    timings: list[NodeTiming] = field(default_factory=list)
    retrieved: dict[str, Passage] = field(default_factory=dict)
    num_node_runs: int = 0
    error: str | None = None
    error_kind: ErrorKind | None = None

    def response(self) -> Response:
        summed: dict = {}  # node id -> seconds, over its runs
        for t in self.timings:
            if t.duration is not None:
                summed[t.node_id] = summed.get(t.node_id, 0.0) + t.duration
        return Response(
            request_id=self.request_id,
            output=str(self.state.get("output", "")),
            state=dict(self.state),
            doc_ids=tuple(self.retrieved),
            titles=tuple(p.title for p in self.retrieved.values()),
            timings=summed,
            error=self.error,
            node_timings=tuple(self.timings),
            arrival_time=self.arrival_time,
            finish_time=time.monotonic(),
            error_kind=self.error_kind,
        )


class RequestError(RuntimeError):
    """A failed request (``Server.stream`` / ``complete``), with its ``Response``."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.error)
        self.response = response
        self.kind: ErrorKind = response.error_kind or "internal"
