"""Operator node kinds, fan-out/join and ``State.write``: builder and ``compile()`` checks."""

from __future__ import annotations

import pytest

from ragserve.graph import END, RESOURCES, START, GraphError, Passage, RAGraph, State


def _agentic() -> RAGraph:
    g = RAGraph("agent", inputs=("session",))
    g.add_memory("recall", key="session", output="memory")
    g.add_function("plan", lambda s: f"notes on {s['input']}", output="notes")
    g.add_upsert("save", documents="notes", output="saved_ids")
    g.add_retrieval("search", query="input", topk=3, output="docs")
    g.add_rerank("rerank", query="input", docs="docs", topk=2, output="best")
    g.add_embed("embed", text="input", output="vector")
    g.add_generation("answer", prompt="{memory}\n{best}\n{input}")
    g.add_memory("remember", key="session", mode="append")
    g.add_edge(START, "recall").add_edge("recall", "plan").add_edge("plan", "save")
    g.add_edge("save", ("search", "embed")).add_edge("search", "rerank")
    g.add_edge("rerank", "answer").add_edge("embed", "answer")
    return g.add_edge("answer", "remember").add_edge("remember", END)


def test_every_operator_kind_compiles_with_its_resource() -> None:
    graph = _agentic().compile()
    kinds = {n: node.kind for n, node in graph.nodes.items()}
    assert kinds == {
        "recall": "memory",
        "plan": "function",
        "save": "upsert",
        "search": "retrieval",
        "rerank": "rerank",
        "embed": "embed",
        "answer": "generation",
        "remember": "memory",
    }
    assert {node.resource for node in graph.nodes.values()} == set(RESOURCES)
    fanout = graph.fanouts["save"]
    assert fanout.branches == (("search", "rerank"), ("embed",)) and fanout.join == "answer"
    assert graph.next_node("save", State(input="q")) == ("search", "embed")
    assert graph.inputs == ("session",) and graph.answer_nodes == ("answer",)


def _raises(graph: RAGraph, pattern: str) -> None:
    with pytest.raises(GraphError, match=pattern):
        graph.compile()


def test_memory_key_must_be_an_input_or_produced() -> None:
    g = RAGraph().add_memory(0, key="session", output="m").add_generation(1, prompt="{m}")
    _raises(g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END), r"node 0 uses \{session\}")


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda g: g.add_function(0, 42, output="x"), r"node 0: fn must be callable"),
        (lambda g: g.add_function(0, lambda: 1, output="x"), r"one positional argument"),
        (lambda g: g.add_function(0, lambda a, b: 1, output="x"), r"one positional argument"),
        (lambda g: g.add_function(0, _async_fn, output="x"), r"not async"),
        (lambda g: g.add_function(0, len, output="x", timeout_s=0), r"timeout_s must be > 0"),
        (lambda g: g.add_function(0, len, output="not a key"), r"output must be a state key"),
        (lambda g: g.add_memory(0, key="s", mode="write", output="m"), r"mode must be 'read'"),
        (lambda g: g.add_memory(0, key="s"), r"a read memory node needs output="),
        (lambda g: g.add_memory(0, key="s", output="m", text="{x}"), r"only for append"),
        (lambda g: g.add_rerank(0, query="q", docs="d", topk=0, output="o"), r"topk must be >= 1"),
        (lambda g: g.add_upsert(0, documents="a b"), r"documents must be a state key"),
        (lambda g: g.add_embed(0, text="t", output=""), r"output must be a state key"),
        (lambda g: g.add_completion(0, params=object()), r"node 0: params"),
        (lambda g: g.add_edge(0, (1,)), r"at least two targets"),
        (lambda g: g.add_edge(0, (1, 1)), r"names a target twice"),
        (lambda g: g.add_edge(0, (1, END)), r"targets must be node ids"),
    ],
)
def test_builder_rejects_bad_operators_in_one_line(build, pattern: str) -> None:
    with pytest.raises(GraphError, match=pattern) as info:
        build(RAGraph())
    assert "\n" not in str(info.value)


async def _async_fn(state):
    return state


def test_callable_objects_and_builtins_are_accepted() -> None:
    class Step:
        def __call__(self, state):
            return state["input"]

    RAGraph().add_function(0, Step(), output="a").add_function(1, len, output="b")


def _fanout(**kw) -> RAGraph:
    g = RAGraph()
    g.add_retrieval(1, query="input", topk=2, output=kw.get("out1", "docs_a"))
    g.add_retrieval(2, query="input", topk=2, output=kw.get("out2", "docs_b"))
    g.add_generation(3, prompt="{input}")
    return g.add_edge(START, (1, 2))


def test_fanout_without_join_is_rejected() -> None:
    g = _fanout().add_edge(1, 3).add_edge(2, END).add_edge(3, END)
    _raises(g, r"fan-out at START: branches \(1, 2\) never join")


def test_fanout_branches_must_write_disjoint_keys() -> None:
    g = _fanout(out2="docs_a").add_edge(1, 3).add_edge(2, 3).add_edge(3, END)
    _raises(g, r"nodes 1 and 2 in different branches both write 'docs_a'")


def test_fanout_branch_cannot_route_or_be_entered_from_outside() -> None:
    g = _fanout().add_edge(1, lambda s: 3, targets=(3,)).add_edge(2, 3).add_edge(3, END)
    _raises(g, r"node 1 in a branch of the fan-out at START has a conditional")
    g = _fanout()
    g.add_generation(4, prompt="{input}", output="x")
    g.add_edge(1, 4).add_edge(4, 3).add_edge(2, 3).add_edge(3, lambda s: END, targets=(END, 4))
    _raises(g, r"edge from 3 enters the branch of the fan-out at START at 4")


def test_fanout_target_that_is_the_join_is_rejected() -> None:
    g = _fanout().add_edge(1, 2).add_edge(2, 3).add_edge(3, END)
    _raises(g, r"target 2 is the join itself")


def test_state_write_is_the_one_write_rule() -> None:
    class Node:
        def __init__(self, output, append):
            self.node_id, self.output, self.append = "n", output, append

    p1, p2, p3 = (Passage(f"d{i}", f"t{i}") for i in range(3))
    state = State(input="q", docs=[p1, p2], text="a")
    new = state.write(Node("docs", True), [p2, p3])
    assert [p.doc_id for p in new["docs"]] == ["d0", "d1", "d2"]
    assert state["docs"] == [p1, p2] and state.visit_count("n") == 0  # unchanged
    assert new.visit_count("n") == 1
    assert state.write(Node("text", True), "b")["text"] == "a\nb"
    assert state.write(Node("text", False), "b")["text"] == "b"
    assert state.write(Node(None, False), "ignored") == state


def test_a_list_of_strings_renders_one_per_line() -> None:
    from ragserve.graph import Template

    assert Template.parse("{memory}|").render({"memory": ["a", "b"]}) == "a\nb|"


@pytest.mark.parametrize(
    ("add", "field"),
    [
        (lambda g: g.add_embed(0, text="nope", output="v"), "nope"),
        (lambda g: g.add_rerank(0, query="input", docs="nope", topk=1, output="v"), "nope"),
        (lambda g: g.add_rerank(0, query="{nope} x", docs="input", topk=1, output="v"), "nope"),
        (lambda g: g.add_upsert(0, documents="nope"), "nope"),
        (lambda g: g.add_memory(0, key="input", mode="append", text="{nope}"), "nope"),
        (lambda g: g.add_completion(0, params=_Params(), prompt="nope"), "nope"),
    ],
)
def test_operator_inputs_nothing_produces_are_rejected(add, field: str) -> None:
    g = add(RAGraph()).add_edge(START, 0).add_edge(0, END)
    _raises(g, rf"node 0 uses \{{{field}\}}, which neither the input nor any node")


class _Params:
    max_tokens, temperature, top_p = 4, 0.0, 1.0
