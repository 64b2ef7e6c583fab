"""Test-only fault injection: the one documented place where an engine step can be made to
raise for chosen requests, in process or inside a worker process.

``$RAGSERVE_FAULT_INJECT`` holds ``stage:marker`` items separated by commas, e.g.
``"forward:<poison>,append:<bad>"``. ``check_fault(stage, seqs)`` raises ``InjectedFault`` when a
sequence in ``seqs`` has ``marker`` among its stop strings (a field every API passes through
unchanged). Unset (production), ``check_fault`` is one dictionary lookup. Stages, in step order:

- ``forward``: ``ModelRunner.launch_model`` (``execute_model``) before its batch's forward;
- ``sample``: ``ModelRunner.launch_model`` between the logits and the sampler;
- ``append``: ``LLMEngine`` appending a sampled token (detokenizer, stop strings).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

FAULT_ENV = "RAGSERVE_FAULT_INJECT"
STAGES = ("forward", "sample", "append")


class InjectedFault(RuntimeError):
    """Raised by ``check_fault`` for a sequence chosen by ``$RAGSERVE_FAULT_INJECT``."""


def check_fault(stage: str, seqs: Iterable[Any]) -> None:
    """Raise ``InjectedFault`` if ``$RAGSERVE_FAULT_INJECT`` names ``stage`` with a marker
    among the stop strings of one of ``seqs``; otherwise do nothing."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    markers = [m for s, _, m in (item.partition(":") for item in spec.split(",")) if s == stage]
    for seq in seqs:
        if any(m and m in seq.params.stop for m in markers):
            raise InjectedFault(f"injected {stage} fault for request {seq.request_id!r}")
