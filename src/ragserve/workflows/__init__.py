"""The five built-in workflows HedraRAG evaluates: one-shot, HyDE, Multistep, IRG, RECOMP.

Each builder returns a compiled graph. Loops run a fixed, configurable number of rounds so that
benchmark runs are deterministic and comparable. Prompts are short and direct so that a small
instruct model (SmolLM2-135M-Instruct) follows them.
"""

from __future__ import annotations

from collections.abc import Callable

from ragserve.graph import CompiledGraph
from ragserve.workflows.builtin import hyde, irg, multistep, oneshot, recomp

BUILTIN_WORKFLOWS: dict[str, Callable[..., CompiledGraph]] = {
    "oneshot": oneshot,
    "hyde": hyde,
    "multistep": multistep,
    "irg": irg,
    "recomp": recomp,
}


def get_workflow(name: str, **kwargs) -> CompiledGraph:
    """The built-in workflow ``name`` built with ``kwargs``; ``KeyError`` lists the choices."""
    try:
        builder = BUILTIN_WORKFLOWS[name]
    except KeyError:
        raise KeyError(
            f"unknown workflow {name!r}; choose one of {', '.join(BUILTIN_WORKFLOWS)}"
        ) from None
    return builder(**kwargs)


__all__ = ["BUILTIN_WORKFLOWS", "get_workflow", "hyde", "irg", "multistep", "oneshot", "recomp"]
