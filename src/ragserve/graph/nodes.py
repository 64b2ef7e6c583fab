"""Graph vocabulary: ``START``/``END``, node and edge dataclasses, request ``State``."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from ragserve.graph.template import Template


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
    bound loops (``lambda s: 1 if s.visits[2] < 3 else END``). The scheduler mutates it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.visits: dict[NodeId, int] = {}

    def visit_count(self, node_id: NodeId) -> int:
        return self.visits.get(node_id, 0)


@dataclass(frozen=True)
class GenerationNode:
    """Render ``prompt`` from the state, generate, write the text to ``state[output]``.

    With ``append`` the text is added (newline-separated) to what ``output`` already holds.
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
    fusion_ratio: float | None = None  # cache fusion of the prompt's passages; None: off

    kind = "generation"

    @property
    def inputs(self) -> frozenset[str]:
        return self.prompt.variables


@dataclass(frozen=True)
class RetrievalNode:
    """Render ``query`` from the state, retrieve ``topk`` passages into ``state[output]``.

    ``nprobe=None`` uses the index's default. With ``append`` new passages are added to those
    already in ``output`` (duplicates by id dropped).
    """

    node_id: NodeId
    query: Template
    topk: int
    output: str = "docs"
    nprobe: int | None = None
    append: bool = False

    kind = "retrieval"

    @property
    def inputs(self) -> frozenset[str]:
        return self.query.variables


Node = GenerationNode | RetrievalNode


@dataclass(frozen=True)
class Edge:
    """``src`` → ``dst``: a node id / ``END``, or a router called on the state returning one.

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

    def possible_targets(self, all_nodes: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.is_conditional:
            return (self.dst,)
        if self.targets is not None:
            return self.targets
        return (*all_nodes, END)
