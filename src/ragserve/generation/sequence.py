"""One request's token state inside the engine, and the snapshot handed back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ragserve.generation.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ragserve.generation.kv_tree import PassageBlocks
    from ragserve.generation.segments import FusionPlan


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass
class RequestMetrics:
    """Times from ``time.monotonic()``; ``None`` until the event happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """One request after a step (cumulative; ``prompt_token_ids`` shared, read-only);
    ``finish_reason``: ``None``, ``"stop"``, ``"length"``, ``"abort"`` or ``"error"``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    error: str | None = None


class Sequence:
    """Token ids of one request (prompt + generated) and how many of them have KV cached::

    tokens     [ prompt ......................... | output ...... ]
    computed   [ KV in cache ........ )[ scheduled this step )
               0              num_computed_tokens       num_tokens
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # sampled by launched steps, not yet on the host
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # set with finish_reason "error"
        self.text = ""
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.num_preemptions = 0
        self.segment_ends: tuple[int, ...] | None = None  # documents (None: detected)
        self.fusion: FusionPlan | None = None  # cache fusion's plan (None: plain prefill)
        self.passage_blocks: list[PassageBlocks] | None = None  # held passages, span order

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,  # shared: never mutated by the engine
            token_ids=self.token_ids[self.num_prompt_tokens :],
            text=self.text,
            finished=self.status is SequenceStatus.FINISHED,
            finish_reason=self.finish_reason,
            metrics=replace(self.metrics),
            error=self.error,
        )
