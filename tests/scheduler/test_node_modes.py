"""A retrieval node's `mode`, `filter` and `collapse_sections` reach its `RetrievalTask`;
speculation leaves nodes with a mode or filter alone (it reuses dense probe plans only)."""

from __future__ import annotations

import pytest
from sched_fakes import FakeExecutor

from ragserve.graph import END, START, GraphError, RAGraph, State
from ragserve.scheduler import RequestState, Scheduler


def _graph(**retrieval):
    g = RAGraph().add_retrieval(0, query="input", topk=3, output="docs", **retrieval)
    return (
        g.add_generation(1, prompt="{docs}|{input}")
        .add_edge(START, 0)
        .add_edge(0, 1)
        .add_edge(1, END)
    )


def test_mode_and_filter_reach_the_task() -> None:
    ex = FakeExecutor()
    sched = Scheduler(ex)
    flt = {"source": ["a.md", "b.md"], "year": {"gte": 2020}}
    graph = _graph(mode="hybrid", filter=flt, collapse_sections=False).compile()
    sched.add_request(RequestState("r", graph, State(input="q"), on_done=None))
    for _ in range(50):
        sched.step()
        if not sched.has_unfinished():
            break
    (task,) = ex.retrieval_calls[0]
    assert (task.mode, task.filter, task.topk) == ("hybrid", flt, 3)
    assert task.collapse_sections is False


def test_defaults_are_none() -> None:
    node = _graph().compile().nodes[0]
    assert node.mode is None and node.filter is None and node.collapse_sections is None


@pytest.mark.parametrize(
    "kwargs, mentions",
    [
        ({"mode": "sparse"}, "mode"),
        ({"filter": ["source"]}, "filter"),
        ({"collapse_sections": "no"}, "collapse_sections"),
        ({"collapse_sections": 1}, "collapse_sections"),
    ],
)
def test_bad_mode_or_filter(kwargs, mentions) -> None:
    with pytest.raises(GraphError, match=mentions):
        RAGraph().add_retrieval(0, query="input", topk=3, output="docs", **kwargs)
