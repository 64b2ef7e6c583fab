"""Step isolation: a step whose forward pass or sampling raises fails only the requests that
make it raise; the step is run again without them.

The model runner's ``execute_model`` writes the scheduled tokens' KV into slots the scheduler
allocated and returns the sampled tokens; it changes no sequence. Running it again for part
of the step is therefore safe: the same slots get the same keys and values. So when the whole
step raises, the step's sequences are bisected (each half run alone, a half that raises split
again) down to the single sequences that raise on their own, the culprits; then the step runs
once more without them, the batch it would have been without the poison requests. The
sampler's random state is restored before every attempt, so seeded and unseeded sampling
draw exactly what they would have drawn.

```
step [a b c d e f g h] raises          culprit: f
  [a b c d] ok     [e f g h] raises
                   [e f] raises  [g h] ok
                   [e] ok  [f] raises -> f fails alone
rerun [a b c d e g h] -> tokens for the step
```

Cost: nothing while steps succeed (a sampler snapshot only when the step samples randomly);
on a failure about ``2 log2(n)`` extra forward passes per culprit. A failure that no single
sequence reproduces (e.g. out of memory for the whole batch) is not isolated: the rerun
raises it to the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from ragserve.generation.sampler import Sampler
from ragserve.generation.scheduler import SchedulerOutput
from ragserve.generation.sequence import Sequence

logger = logging.getLogger(__name__)

Execute = Callable[[SchedulerOutput], list[int]]


class IsolatedStep(NamedTuple):
    """``out``: the step that ran (without the culprits); ``tokens``: its sampled tokens;
    ``failed``: each culprit with the exception it raised alone."""

    out: SchedulerOutput
    tokens: list[int]
    failed: list[tuple[Sequence, Exception]]


def execute_isolated(execute: Execute, out: SchedulerOutput, sampler: Sampler) -> IsolatedStep:
    """``execute(out)``; if it raises, the culprits found by bisection fail alone and the rest
    of the step is run again without them (see the module docstring)."""
    samples = any(not s.params.is_greedy for s, f in zip(out.seqs, out.sample, strict=True) if f)
    state = sampler.get_state() if samples else None

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


def _bisect(attempt: Execute, part: SchedulerOutput, failed: list) -> None:
    """Append to ``failed`` the sequences of ``part`` that raise when run alone."""
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
    mid = len(out.seqs) // 2
    return [_slice(out, 0, mid), _slice(out, mid, len(out.seqs))]


def _slice(out: SchedulerOutput, start: int, stop: int) -> SchedulerOutput:
    return SchedulerOutput(
        out.seqs[start:stop], out.num_scheduled_tokens[start:stop], out.sample[start:stop]
    )


def _without(out: SchedulerOutput, seqs: list[Sequence]) -> SchedulerOutput:
    drop = {id(s) for s in seqs}
    keep = [i for i, s in enumerate(out.seqs) if id(s) not in drop]
    return SchedulerOutput(
        [out.seqs[i] for i in keep],
        [out.num_scheduled_tokens[i] for i in keep],
        [out.sample[i] for i in keep],
    )
