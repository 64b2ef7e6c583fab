"""Built-in workflows: structure, bounded rounds, and prompts that render from the state.

End-to-end runs on a tiny model live in tests/runtime/test_workflows_e2e.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from ragserve.graph import END, START, Passage, State
from ragserve.workflows import BUILTIN_WORKFLOWS, get_workflow


def _walk(graph, question: str = "What is the capital of France?") -> tuple[list, State]:
    """Follow the graph with fake node outputs, the way the scheduler advances a request."""
    state = State(input=question)
    order = []
    node_id = graph.next_node(START, state)
    while node_id is not END:
        node = graph.nodes[node_id]
        order.append((node.kind, node_id))
        if node.kind == "retrieval":
            assert node.query.render(state).strip()
            state[node.output] = [Passage(f"d{len(order)}", "text", "Title")]
        else:
            prompt = node.prompt.render(state)
            assert "{" not in prompt.replace("{input}", "")
            state[node.output] = f"gen{len(order)}"
        state.visits[node_id] = state.visit_count(node_id) + 1
        node_id = graph.next_node(node_id, state)
        assert len(order) < 100
    return order, state


@pytest.mark.parametrize("name", sorted(BUILTIN_WORKFLOWS))
def test_workflow_reaches_end_with_an_answer(name: str) -> None:
    graph = get_workflow(name)
    order, state = _walk(graph)
    assert order[-1][0] == "generation"
    assert graph.answer_nodes == (order[-1][1],)
    assert state["output"] == f"gen{len(order)}"
    assert any(kind == "retrieval" for kind, _ in order)


@pytest.mark.parametrize("rounds", [1, 2, 3, 5])
def test_multistep_rounds_are_exact(rounds: int) -> None:
    order, _ = _walk(get_workflow("multistep", rounds=rounds))
    kinds = Counter(kind for kind, _ in order)
    assert kinds == {"retrieval": rounds, "generation": 2 * rounds + 1}


@pytest.mark.parametrize("rounds", [1, 2, 3, 5])
def test_irg_rounds_are_exact(rounds: int) -> None:
    order, _ = _walk(get_workflow("irg", rounds=rounds))
    kinds = Counter(kind for kind, _ in order)
    assert kinds == {"retrieval": rounds, "generation": rounds}
    assert order[-1] == ("generation", 3)


def test_irg_later_queries_include_the_draft() -> None:
    graph = get_workflow("irg", rounds=2)
    state = State(input="Q?", draft="D!")
    assert graph.nodes[2].query.render(state) == "Q?\nD!"


def test_topk_and_nprobe_reach_the_nodes() -> None:
    graph = get_workflow("oneshot", topk=7, nprobe=3)
    assert (graph.nodes[0].topk, graph.nodes[0].nprobe) == (7, 3)


def test_unknown_workflow_and_bad_rounds() -> None:
    with pytest.raises(KeyError, match="unknown workflow 'nope'; choose one of oneshot"):
        get_workflow("nope")
    with pytest.raises(ValueError, match="rounds"):
        get_workflow("irg", rounds=0)


@pytest.mark.parametrize("name", ["oneshot", "hyde", "multistep", "irg", "recomp"])
def test_passage_prompts_are_prefix_stable(name):
    """Issue 12: fixed instructions, then the passages (own paragraphs), then the question."""
    from ragserve.graph.nodes import GenerationNode
    from ragserve.graph.template import Passage
    from ragserve.workflows import get_workflow

    graph = get_workflow(name)
    prompts = [n.prompt for n in graph.nodes.values() if isinstance(n, GenerationNode)]
    with_docs = [t for t in prompts if "docs" in t.variables]
    assert with_docs
    docs = [Passage("a", "Alpha text.", "A"), Passage("b", "Beta text.", "B")]
    for template in with_docs:
        head, _, tail = template.source.partition("{docs}")
        assert head and "{" not in head and head.endswith("\n\n")
        assert tail.startswith("\n\n")
        one = template.render({"docs": docs, "input": "q1", "subquestion": "s1"})
        two = template.render({"docs": docs, "input": "other", "subquestion": "s2"})
        shared = head + "[1] A\nAlpha text.\n\n[2] B\nBeta text.\n\n"
        assert one.startswith(shared) and two.startswith(shared)
