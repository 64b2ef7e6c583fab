"""The five built-in workflows HedraRAG evaluates: one-shot, HyDE, Multistep, IRG, RECOMP.
Loops run a fixed number of rounds (deterministic benchmarks); prompts are short enough for a
small instruct model (SmolLM2-135M-Instruct) to follow."""

from __future__ import annotations

from collections.abc import Callable

from ragserve.graph import CompiledGraph
from ragserve.workflows.builtin import hyde, irg, multistep, oneshot, recomp

BUILTIN_WORKFLOWS: dict[str, Callable[..., CompiledGraph]] = {
    builder.__name__: builder for builder in (oneshot, hyde, multistep, irg, recomp)
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
