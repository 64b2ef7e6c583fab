"""Which generation nodes see the conversation (``state["history"]``) before their prompt."""

from __future__ import annotations

import dataclasses

from ragserve.graph import END, START, RAGraph, State
from ragserve.workflows import get_workflow

TURNS = (("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."))


def test_answer_nodes_by_default_and_explicit_switches() -> None:
    g = RAGraph("h")
    g.add_generation(0, prompt="{input}", output="query")  # not an answer: no history
    g.add_generation(1, prompt="{query}", output="note", with_history=True)
    g.add_generation(2, prompt="{note}")  # the answer: history by default
    compiled = g.add_edge(START, 0).add_edge(0, 1).add_edge(1, 2).add_edge(2, END).compile()
    state = State(input="q", history=TURNS)
    assert [compiled.nodes[n].history(state) for n in (0, 1, 2)] == [(), TURNS, TURNS]
    assert dataclasses.replace(compiled.nodes[2], with_history=False).history(state) == ()
    assert compiled.nodes[2].history(State(input="q")) == ()  # single turn: nothing added


def test_builtin_query_writers_follow_the_conversation() -> None:
    state = State(input="q", history=TURNS)
    seen = {
        name: sorted(
            n.node_id
            for n in get_workflow(name).nodes.values()
            if n.kind == "generation" and n.history(state)
        )
        for name in ("oneshot", "hyde", "multistep", "irg", "recomp")
    }
    assert seen == {
        "oneshot": [1],
        "hyde": [0, 2],
        "multistep": [0, 3],
        "irg": [1, 3],
        "recomp": [2],
    }
