"""The graphs ``bench/served_capacity.py`` registers with ``ragserve serve --workflow``.

Each function takes no argument (``--workflow NAME=served_workflows:NAME``) and reads the
bench preset from ``$SERVED_PRESET`` (``rag_setup.PRESETS``):

- ``oneshot`` ... ``recomp``: the five built-in workflows with the preset's output lengths, top-k
  and rounds (``rag_bench.workflow_graphs``), every generation node asking for exactly its
  ``max_tokens`` (random weights: ``ignore_eos``, no stop strings). They replace the built-ins
  of the same name, so ``model`` = the workflow's name, as a user sends it.
- ``llm_*``: the LLM-alone roofline of each: the same generation nodes, prompts, history and
  output lengths, with the passages already in the prompts and no retrieval node.
- ``fused_*``: the five with cache fusion on their passage-holding prompts
  (``fusion_ratio=FUSION_RATIO``), which no built-in workflow sets (fusion is off as shipped).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parent))

FUSION_RATIO = 0.15  # the recompute ratio README's fusion figures use
NAMES = ("oneshot", "hyde", "multistep", "irg", "recomp")


def _preset():
    from rag_setup import PRESETS

    return PRESETS[os.environ.get("SERVED_PRESET", "h200")]


def _fixed(graph):
    from rag_bench import fixed_length

    return fixed_length(graph)


def _workflow(name: str):
    from rag_bench import workflow_graphs

    return workflow_graphs(_preset())[name]


def _llm_alone(name: str):
    """The LLM-alone graph of workflow ``name`` (``rag_bench``'s three, HyDE's and RECOMP's)."""
    import rag_bench
    from ragserve.graph import END, START, RAGraph

    p = _preset()
    if name in ("oneshot", "irg", "multistep"):
        graphs = rag_bench.workflow_graphs(p)
        return graphs["llm" if name == "oneshot" else f"llm-{name}"]
    docs = rag_bench._passages(p)
    t = p.max_tokens
    g = RAGraph(f"llm-alone-{name}")
    if name == "hyde":  # workflows.builtin.hyde without its retrieval node
        from ragserve.workflows.builtin import ANSWER

        hypo = "Write a short encyclopedia passage that answers this question: {input}"
        g.add_generation(0, prompt=hypo, output="hypo", max_tokens=t, with_history=True)
        g.add_generation(2, prompt=ANSWER.replace("{docs}", docs), max_tokens=t)
        g.add_edge(START, 0).add_edge(0, 2).add_edge(2, END)
    else:  # recomp: workflows.builtin.recomp without its retrieval node
        summary = (
            "Summarize the facts in the passages that help answer the question.\n\n{docs}"
            "\n\nQuestion: {input}"
        ).replace("{docs}", docs)
        answer = "Facts: {summary}\n\nUsing the facts, answer in one short sentence: {input}"
        g.add_generation(1, prompt=summary, output="summary", max_tokens=t)
        g.add_generation(2, prompt=answer, max_tokens=t)
        g.add_edge(START, 1).add_edge(1, 2).add_edge(2, END)
    return _fixed(g)


def _fused(name: str):
    """Workflow ``name`` with ``fusion_ratio`` on each generation node whose prompt holds the
    retrieved passages (``{docs}``)."""
    graph = _workflow(name)
    nodes = {
        nid: dataclasses.replace(node, fusion_ratio=FUSION_RATIO)
        if getattr(node, "kind", None) == "generation" and "docs" in node.inputs
        else node
        for nid, node in graph.nodes.items()
    }
    return dataclasses.replace(graph, nodes=MappingProxyType(nodes))


def oneshot():
    return _workflow("oneshot")


def hyde():
    return _workflow("hyde")


def multistep():
    return _workflow("multistep")


def irg():
    return _workflow("irg")


def recomp():
    return _workflow("recomp")


def llm_oneshot():
    return _llm_alone("oneshot")


def llm_hyde():
    return _llm_alone("hyde")


def llm_multistep():
    return _llm_alone("multistep")


def llm_irg():
    return _llm_alone("irg")


def llm_recomp():
    return _llm_alone("recomp")


def fused_oneshot():
    return _fused("oneshot")


def fused_hyde():
    return _fused("hyde")


def fused_multistep():
    return _fused("multistep")


def fused_irg():
    return _fused("irg")


def fused_recomp():
    return _fused("recomp")


def workflow_flags() -> list[str]:
    """``--workflow`` flags registering every graph above under its function's name
    (``llm_oneshot`` is served as model ``llm-oneshot``, ``fused_irg`` as ``fused-irg``)."""
    flags = []
    for prefix in ("", "llm_", "fused_"):
        for name in NAMES:
            fn = prefix + name
            flags += ["--workflow", f"{fn.replace('_', '-')}=served_workflows:{fn}"]
    return flags
