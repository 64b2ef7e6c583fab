"""Test-only fault injection: ``$RAGSERVE_FAULT_INJECT`` holds comma-separated ``stage:marker``
items; ``check_fault(stage, seqs)`` raises ``InjectedFault`` for a sequence with ``marker`` among
its stop strings. Stages: ``forward`` and ``sample`` (``ModelRunner.launch_model``), ``append``
(``LLMEngine`` appending a token). Unset, it is one dictionary lookup."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

FAULT_ENV = "RAGSERVE_FAULT_INJECT"
STAGES = ("forward", "sample", "append")


class InjectedFault(RuntimeError):
    """Raised by ``check_fault`` for a sequence chosen by ``$RAGSERVE_FAULT_INJECT``."""


def check_fault(stage: str, seqs: Iterable[Any]) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    markers = [m for s, _, m in (item.partition(":") for item in spec.split(",")) if s == stage]
    for seq in seqs:
        if any(m and m in seq.params.stop for m in markers):
            raise InjectedFault(f"injected {stage} fault for request {seq.request_id!r}")
