"""Every compile() error case names the offending node; valid graphs route as described."""

from __future__ import annotations

import re

import pytest

from ragserve.graph import END, START, GraphError, RAGraph, State


def _hyde() -> RAGraph:
    g = RAGraph()
    g.add_generation(0, prompt="Write a passage that answers: {input}", output="hypo")
    g.add_retrieval(1, query="hypo", topk=5, output="docs")
    g.add_generation(2, prompt="Answer {input} using {docs}.")
    return g.add_edge(START, 0).add_edge(0, 1).add_edge(1, 2).add_edge(2, END)


def test_valid_graph_compiles_and_routes() -> None:
    graph = _hyde().compile()
    state = State(input="q")
    assert graph.next_node(START, state) == 0
    assert [graph.next_node(n, state) for n in (0, 1, 2)] == [1, 2, END]
    assert graph.answer_nodes == (2,)
    assert graph.nodes[1].query.variables == {"hypo"}


def test_builder_is_fluent() -> None:
    g = RAGraph()
    assert g.add_generation("a", prompt="{input}") is g
    assert g.add_edge(START, "a") is g


def _raises(graph: RAGraph, pattern: str) -> None:
    with pytest.raises(GraphError, match=pattern):
        graph.compile()


def test_unknown_node_in_edge() -> None:
    _raises(_hyde().add_edge(7, 1), r"unknown node 7")
    g = RAGraph().add_generation(0, prompt="{input}").add_edge(START, 0).add_edge(0, 9)
    _raises(g, r"edge from 0 to unknown node 9")


def test_unknown_node_in_router_targets() -> None:
    g = RAGraph().add_generation(0, prompt="{input}").add_edge(START, 0)
    _raises(g.add_edge(0, lambda s: END, targets=(END, "x")), r"unknown node 'x'")


def test_duplicate_node_id() -> None:
    g = _hyde().add_generation(1, prompt="{input}")
    _raises(g, r"duplicate node id 1")


def test_no_path_to_end() -> None:
    g = RAGraph()
    g.add_generation(0, prompt="{input}", output="a")
    g.add_generation(1, prompt="{a}", output="b")
    g.add_edge(START, 0).add_edge(0, lambda s: 1, targets=(1,)).add_edge(1, 0)
    _raises(g, r"node 0 has no path to END")


def test_node_without_outgoing_edge() -> None:
    g = RAGraph().add_generation(0, prompt="{input}").add_edge(START, 0)
    _raises(g, r"node 0 has no outgoing edge")
    _raises(RAGraph().add_generation(0, prompt="x").add_edge(0, END), r"START has no outgoing")


def test_two_outgoing_edges() -> None:
    _raises(_hyde().add_edge(0, 2), r"node 0 has more than one outgoing edge")


def test_unreachable_node() -> None:
    g = _hyde().add_generation(9, prompt="{input}").add_edge(9, END)
    _raises(g, r"node 9 is unreachable from START")


def test_template_variable_never_produced() -> None:
    g = RAGraph()
    g.add_generation(0, prompt="Answer {input} with {facts}")
    _raises(g.add_edge(START, 0).add_edge(0, END), r"node 0 uses \{facts\}")


def test_template_variable_produced_only_later() -> None:
    g = RAGraph()
    g.add_generation(0, prompt="{input} {later}", output="a")
    g.add_generation(1, prompt="{a}", output="later")
    _raises(g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END), r"node 0 uses \{later\}")


def test_retrieval_query_key_never_produced() -> None:
    g = RAGraph().add_retrieval("r", query="hypo", topk=2, output="docs")
    _raises(g.add_edge(START, "r").add_edge("r", END), r"node 'r' uses \{hypo\}")


def test_variable_from_a_loop_is_accepted() -> None:
    g = RAGraph()
    g.add_generation(0, prompt="{input} {notes}", output="q")
    g.add_generation(1, prompt="{q}", output="notes", append=True)
    g.add_edge(START, 0).add_edge(0, 1)
    g.add_edge(1, lambda s: 0 if s.visit_count(1) < 2 else END, targets=(0, END))
    g.compile()


def test_loop_without_conditional_exit() -> None:
    g = RAGraph()
    g.add_generation(0, prompt="{input}", output="a")
    g.add_generation(1, prompt="{a}", output="b")
    g.add_generation(2, prompt="{b}")
    g.add_edge(START, 0).add_edge(0, 1).add_edge(1, 2).add_edge(2, 1)
    _raises(g, re.escape("node 1 is in a loop with no conditional exit: 1 -> 2 -> 1"))


def test_self_loop_without_exit() -> None:
    g = RAGraph().add_generation(0, prompt="{input}").add_edge(START, 0).add_edge(0, 0)
    _raises(g, r"node 0 is in a loop with no conditional exit")


def test_router_returning_unknown_or_undeclared_node_fails_at_run_time() -> None:
    g = RAGraph().add_generation(0, prompt="{input}").add_generation(1, prompt="{input}")
    g.add_edge(START, 0).add_edge(1, END)
    graph = g.add_edge(0, lambda s: s["next"], targets=(1, END)).compile()
    assert graph.next_node(0, State(next=1)) == 1
    with pytest.raises(GraphError, match="returned unknown node 5"):
        graph.next_node(0, State(next=5))
    with pytest.raises(GraphError, match="returned 0, not in"):
        graph.next_node(0, State(next=0))


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda g: g.add_generation(0, prompt="x", output="not a key"), "output must be"),
        (lambda g: g.add_generation(0, prompt="x", max_tokens=0), "max_tokens"),
        (lambda g: g.add_generation(0, prompt="x", top_p=0.0), "top_p"),
        (lambda g: g.add_retrieval(0, query="q q", topk=1, output="d"), "query must be"),
        (lambda g: g.add_retrieval(0, query="input", topk=0, output="d"), "topk"),
        (lambda g: g.add_retrieval(0, query="input", topk=1, output="d", nprobe=0), "nprobe"),
        (lambda g: g.add_generation(END, prompt="x"), "invalid node id"),
        (lambda g: g.add_edge(END, 0), "END has no outgoing"),
        (lambda g: g.add_edge(0, START), "points at START"),
    ],
)
def test_bad_arguments_fail_fast(call, pattern: str) -> None:
    with pytest.raises(GraphError, match=pattern):
        call(RAGraph())
