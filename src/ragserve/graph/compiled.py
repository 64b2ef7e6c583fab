"""``validate()`` turns a builder's nodes and edges into an immutable ``CompiledGraph``.

Checks, in order, each raising ``GraphError`` naming the node: unknown endpoints, a node with
no or several outgoing edges, a loop of plain edges (no conditional exit), a node that cannot
reach ``END``, a node unreachable from ``START``, and a template variable that neither the
input nor any node that can run before it produces.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ragserve.graph.nodes import END, START, Edge, GraphError, Node, NodeId, State

INPUT_KEY = "input"


@dataclass(frozen=True)
class CompiledGraph:
    """A validated workflow; share it freely between requests (it holds no request state)."""

    name: str | None
    nodes: MappingProxyType  # node id -> Node
    edges: MappingProxyType  # src (node id or START) -> Edge

    @property
    def answer_nodes(self) -> tuple[NodeId, ...]:
        """Generation nodes writing the answer key ``"output"`` (what ``stream`` yields)."""
        return tuple(
            n.node_id
            for n in self.nodes.values()
            if n.kind == "generation" and n.output == "output"
        )

    def next_node(self, src: Any, state: State) -> Any:
        """Follow ``src``'s edge for this state: a node id or ``END``."""
        edge: Edge = self.edges[src]
        if not edge.is_conditional:
            return edge.dst
        dst = edge.dst(state)
        allowed = edge.targets
        if dst is not END and dst not in self.nodes:
            raise GraphError(f"conditional edge from {src!r} returned unknown node {dst!r}")
        if allowed is not None and dst not in allowed:
            raise GraphError(f"conditional edge from {src!r} returned {dst!r}, not in {allowed}")
        return dst


def validate(name: str | None, nodes: dict[NodeId, Node], edges: list[Edge]) -> CompiledGraph:
    if not nodes:
        raise GraphError("graph has no nodes")
    out: dict[Any, Edge] = {}
    for edge in edges:
        if edge.src is not START and edge.src not in nodes:
            raise GraphError(f"edge from unknown node {edge.src!r}")
        for dst in _declared_targets(edge):
            if dst is not END and dst not in nodes:
                raise GraphError(f"edge from {edge.src!r} to unknown node {dst!r}")
        if edge.src in out:
            raise GraphError(f"node {edge.src!r} has more than one outgoing edge")
        out[edge.src] = edge
    for src in (START, *nodes):
        if src not in out:
            raise GraphError(f"node {src!r} has no outgoing edge")
    ids = tuple(nodes)
    succ = {src: tuple(e.possible_targets(ids)) for src, e in out.items()}
    _check_plain_loops(nodes, out)
    _check_reaches_end(ids, succ)
    reachable = _reach(START, succ)
    for node_id in ids:
        if node_id not in reachable:
            raise GraphError(f"node {node_id!r} is unreachable from START")
    _check_variables(nodes, succ)
    return CompiledGraph(name, MappingProxyType(dict(nodes)), MappingProxyType(out))


def _declared_targets(edge: Edge) -> Iterable[Any]:
    if edge.is_conditional:
        return edge.targets or ()
    return (edge.dst,)


def _check_plain_loops(nodes: dict[NodeId, Node], out: dict[Any, Edge]) -> None:
    for start in nodes:
        seen: list[Any] = []
        cur = start
        while cur is not END and not out[cur].is_conditional and cur not in seen:
            seen.append(cur)
            cur = out[cur].dst
        if cur is not END and cur in seen:
            loop = seen[seen.index(cur) :]
            raise GraphError(
                f"node {cur!r} is in a loop with no conditional exit: "
                + " -> ".join(map(repr, [*loop, cur]))
            )


def _check_reaches_end(ids: tuple[NodeId, ...], succ: dict[Any, tuple[Any, ...]]) -> None:
    for node_id in ids:
        if END not in _reach(node_id, succ):
            raise GraphError(f"node {node_id!r} has no path to END")


def _check_variables(nodes: dict[NodeId, Node], succ: dict[Any, tuple[Any, ...]]) -> None:
    for node_id, node in nodes.items():
        before = [n for n in nodes if node_id in _reach(n, succ, strict=True)]
        available = {INPUT_KEY} | {nodes[n].output for n in before}
        missing = sorted(node.inputs - available)
        if missing:
            raise GraphError(
                f"node {node_id!r} uses {{{missing[0]}}}, which neither the input nor any "
                "node that runs before it produces"
            )


def _reach(src: Any, succ: dict[Any, tuple[Any, ...]], *, strict: bool = False) -> set[Any]:
    """Nodes reachable from ``src`` (``src`` itself only via a cycle when ``strict``)."""
    seen: set[Any] = set()
    stack = list(succ.get(src, ())) if strict else [src]
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        stack.extend(succ.get(cur, ()))
    return seen
