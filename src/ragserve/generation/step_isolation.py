"""Step isolation: a step that raises is bisected down to the requests that raise alone, which
fail; the rest runs again (``execute`` changes no sequence; the sampler state is restored)::

    step [a b c d e f g h] raises          culprit: f
      [a b c d] ok     [e f g h] raises
                       [e f] raises  [g h] ok
                       [e] ok  [f] raises -> f fails alone
    rerun [a b c d e g h] -> tokens for the step
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from ragserve.generation.sampler import Sampler, SamplerState
from ragserve.generation.scheduler import SchedulerOutput
from ragserve.generation.sequence import Sequence

logger = logging.getLogger(__name__)

Execute = Callable[[SchedulerOutput], list[int]]


class IsolatedStep(NamedTuple):
    """The step that ran (without the culprits), its tokens, and each culprit's exception."""

    out: SchedulerOutput
    tokens: list[int]
    failed: list[tuple[Sequence, Exception]]


def execute_isolated(execute: Execute, out: SchedulerOutput, sampler: Sampler) -> IsolatedStep:
    """``execute(out)``; if it raises, the bisected culprits fail and the rest runs again."""
    state = random_state(out, sampler)

    def attempt(part: SchedulerOutput) -> list[int]:
        if state is not None:
            sampler.set_state(state)
        return execute(part)

    try:
        return IsolatedStep(out, execute(out), [])
    except Exception as exc:
        if len(out.seqs) == 1:
            return IsolatedStep(_without(out, out.seqs), [], [(out.seqs[0], exc)])
        logger.warning("a step of %d requests failed (%r); isolating", len(out.seqs), exc)
    failed: list[tuple[Sequence, Exception]] = []
    for half in _halves(out):
        _bisect(attempt, half, failed)
    rest = _without(out, [seq for seq, _ in failed])
    tokens = attempt(rest) if not rest.is_empty else []
    return IsolatedStep(rest, tokens, failed)


def random_state(out: SchedulerOutput, sampler: Sampler) -> SamplerState | None:
    """The sampler's state a rerun of ``out`` must start from (``None``: all greedy)."""
    samples = any(not s.params.is_greedy for s, f in zip(out.seqs, out.sample, strict=True) if f)
    return sampler.get_state() if samples else None


def _bisect(attempt: Execute, part: SchedulerOutput, failed: list) -> None:
    try:
        attempt(part)
        return
    except Exception as exc:
        error = exc
    if len(part.seqs) == 1:
        failed.append((part.seqs[0], error))
        return
    for half in _halves(part):  # NOTE: outside the except block: no chained tracebacks
        _bisect(attempt, half, failed)


def _halves(out: SchedulerOutput) -> list[SchedulerOutput]:
    first = set(map(id, out.seqs[: len(out.seqs) // 2]))
    return [out.keep(lambda s: id(s) in first), out.keep(lambda s: id(s) not in first)]


def _without(out: SchedulerOutput, seqs: list[Sequence]) -> SchedulerOutput:
    drop = set(map(id, seqs))
    return out.keep(lambda s: id(s) not in drop)
