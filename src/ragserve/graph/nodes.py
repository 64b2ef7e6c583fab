"""Graph vocabulary: ``START``/``END``, node and edge dataclasses, request ``State``."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ragserve.graph.checks import check_retrieval, check_sampling
from ragserve.graph.template import Passage, Template


class GraphError(ValueError):
    """A malformed graph (raised by ``compile()``) or a bad routing decision at run time."""


@dataclass(frozen=True)
class Terminal:
    """The two pseudo-nodes: ``START`` (entry) and ``END`` (exit)."""

    name: str

    def __repr__(self) -> str:
        return self.name


START = Terminal("START")
END = Terminal("END")

NodeId = Hashable  # user node ids: ints or strings
Router = Callable[["State"], Any]


class State(dict):
    """A request's state: ``input``, then every node's output under its ``output`` key.

    ``visits[node_id]`` counts how many times each node has finished, so conditional edges can
    bound loops (``lambda s: 1 if s.visits[2] < 3 else END``). Never mutated in place by the
    scheduler once routers or transforms may hold it: ``write`` returns a new state.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.visits: dict[NodeId, int] = {}

    def visit_count(self, node_id: NodeId) -> int:
        return self.visits.get(node_id, 0)

    def fork(self) -> State:
        """A shallow copy (values shared, ``visits`` copied)."""
        state = State(self)
        state.visits = dict(self.visits)
        return state

    def write(self, node: Any, value: Any) -> State:
        """The state after ``node`` finished returning ``value`` (a new ``State``; this one is
        unchanged): ``value`` under ``node.output`` (nothing for a node without one) and the
        node's visit counted. The one rule every writer uses (the scheduler, speculation):

        - ``append=False`` (or the key is absent): the value replaces what the key held;
        - ``append=True`` with text: newline-joined to the old text;
        - ``append=True`` with passages: added after the old ones, duplicates by id dropped.
        """
        state = self.fork()
        key = getattr(node, "output", None)
        if key is not None:
            state[key] = _merged(
                state.get(key), value, getattr(node, "append", False), key in state
            )
        state.visits[node.node_id] = state.visit_count(node.node_id) + 1
        return state


def _merged(old: Any, value: Any, append: bool, present: bool) -> Any:
    if not append or not present:
        return value
    if isinstance(value, str):
        return f"{old}\n{value}"
    seen = {p.doc_id for p in old}
    return list(old) + [p for p in value if isinstance(p, Passage) and p.doc_id not in seen]


@dataclass(frozen=True)
class GenerationNode:
    """Render ``prompt`` from the state, generate, write the text to ``state[output]``.

    With ``append`` the text is added (newline-separated) to what ``output`` already holds.
    ``with_history``: whether the chat turns before the question (``state["history"]``: a
    system message and earlier turns, ``Server.submit(history=...)``) precede the rendered
    prompt in the chat template; ``None`` means only for answer nodes (``output="output"``).
    """

    node_id: NodeId
    prompt: Template
    output: str = "output"
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    append: bool = False
    top_p: float = 1.0
    seed: int | None = None
    with_history: bool | None = None
    fusion_ratio: float | None = None  # cache fusion of the prompt's passages; None: off
    ignore_eos: bool = False  # generate exactly max_tokens unless a stop string ends it

    kind = "generation"
    resource = "engine"

    def __post_init__(self) -> None:
        check_sampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )

    @property
    def inputs(self) -> frozenset[str]:
        return self.prompt.variables

    def history(self, state: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
        """The ``(role, content)`` turns to put before this node's prompt (empty: none)."""
        use = self.output == "output" if self.with_history is None else self.with_history
        return tuple(state.get("history", ())) if use else ()


@dataclass(frozen=True)
class RetrievalNode:
    """Render ``query`` from the state, retrieve ``topk`` passages into ``state[output]``.

    ``nprobe=None`` uses the index's default. With ``append`` new passages are added to those
    already in ``output`` (duplicates by id dropped). ``mode`` ("dense", "bm25", "hybrid",
    "ensemble"; None: the index's default), ``filter`` (metadata key -> value | list |
    range) and ``collapse_sections`` (at most one passage per section; None: the index's
    default) are those of ``VectorIndex.search_text``.
    """

    node_id: NodeId
    query: Template
    topk: int
    output: str = "docs"
    nprobe: int | None = None
    append: bool = False
    mode: str | None = None
    filter: dict[str, Any] | None = None  # noqa: A003 - the retrieval API's name
    collapse_sections: bool | None = None

    kind = "retrieval"
    resource = "retrieval"

    def __post_init__(self) -> None:
        check_retrieval(topk=self.topk, nprobe=self.nprobe)

    @property
    def inputs(self) -> frozenset[str]:
        return self.query.variables


RESOURCES = ("engine", "retrieval", "cpu", "scheduler")
"""Where a node kind runs, so the scheduler batches one kind across requests: ``engine`` (the
LLM engine's running batch: generation, completion), ``retrieval`` (the retrieval worker, one
batch per cycle: retrieval, embed, rerank, upsert), ``cpu`` (the server's bounded thread pool:
function), ``scheduler`` (inline in the scheduler thread, microseconds: memory)."""


@dataclass(frozen=True)
class Edge:
    """``src`` → ``dst``: a node id / ``END``, a router called on the state returning one, or
    a tuple of node ids (a fan-out: every one runs, as parallel branches of the request).

    ``targets`` lists a router's possible destinations; when given, ``compile()`` checks paths
    with it and the scheduler rejects any other return value. Without it a router is assumed
    able to reach every node and ``END``.
    """

    src: Any
    dst: Any
    targets: tuple[Any, ...] | None = field(default=None)

    @property
    def is_conditional(self) -> bool:
        return callable(self.dst) and not isinstance(self.dst, Terminal)

    @property
    def is_fanout(self) -> bool:
        return isinstance(self.dst, tuple)

    def possible_targets(self, all_nodes: tuple[Any, ...]) -> tuple[Any, ...]:
        if self.is_fanout:
            return self.dst
        if not self.is_conditional:
            return (self.dst,)
        if self.targets is not None:
            return self.targets
        return (*all_nodes, END)
