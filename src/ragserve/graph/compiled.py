"""``validate()``: a builder's nodes and edges to an immutable ``CompiledGraph``, or a
``GraphError`` naming the node (fan-out / join rules: docs/architecture.md "Graph")."""

from __future__ import annotations

from dataclasses import dataclass, field
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
    fanouts: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # -> FanOut
    inputs: tuple[str, ...] = ()  # state keys every request brings besides input

    @property
    def answer_nodes(self) -> tuple[NodeId, ...]:
        """Generation and completion nodes writing the answer key ``"output"``."""
        return tuple(
            n.node_id
            for n in self.nodes.values()
            if n.kind in ("generation", "completion") and n.output == "output"
        )

    def next_node(self, src: Any, state: State) -> Any:
        """``src``'s edge for this state: a node id, ``END``, or a fan-out's tuple."""
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


@dataclass(frozen=True)
class FanOut:
    """A fan-out's branches (each the chain of node ids it runs, in order) and its join."""

    src: Any
    branches: tuple[tuple[NodeId, ...], ...]
    join: NodeId


def validate(
    name: str | None, nodes: dict[NodeId, Node], edges: list[Edge], inputs: tuple[str, ...] = ()
) -> CompiledGraph:
    if not nodes:
        raise GraphError("graph has no nodes")
    out: dict[Any, Edge] = {}
    for edge in edges:
        if edge.src is not START and edge.src not in nodes:
            raise GraphError(f"edge from unknown node {edge.src!r}")
        for dst in edge.declared_targets():
            if dst is not END and dst not in nodes:
                raise GraphError(f"edge from {edge.src!r} to unknown node {dst!r}")
        if edge.src in out:
            raise GraphError(f"node {edge.src!r} has more than one outgoing edge")
        out[edge.src] = edge
    for src in (START, *nodes):
        if src not in out:
            raise GraphError(f"node {src!r} has no outgoing edge")
    anywhere = (*nodes, END)
    succ = {
        src: (anywhere if e.is_conditional and e.targets is None else e.declared_targets())
        for src, e in out.items()
    }
    _check_plain_loops(nodes, out)
    for node_id in nodes:
        if END not in _reach(node_id, succ):
            raise GraphError(f"node {node_id!r} has no path to END")
    reachable = _reach(START, succ)
    for node_id in nodes:
        if node_id not in reachable:
            raise GraphError(f"node {node_id!r} is unreachable from START")
    fanouts = {src: _fanout(src, e.dst, nodes, out) for src, e in out.items() if e.is_fanout}
    _check_entries(fanouts, out)
    _check_variables(nodes, succ, inputs)
    return CompiledGraph(
        name,
        MappingProxyType(dict(nodes)),
        MappingProxyType(out),
        MappingProxyType(fanouts),
        tuple(inputs),
    )


def _check_plain_loops(nodes: dict[NodeId, Node], out: dict[Any, Edge]) -> None:
    for start in nodes:
        seen: list[Any] = []
        cur = start
        while cur is not END and not out[cur].is_conditional and cur not in seen:
            seen.append(cur)
            cur = out[cur].dst[0] if out[cur].is_fanout else out[cur].dst
        if cur is not END and cur in seen:
            loop = seen[seen.index(cur) :]
            raise GraphError(
                f"node {cur!r} is in a loop with no conditional exit: "
                + " -> ".join(map(repr, [*loop, cur]))
            )


def _fanout(src: Any, targets: tuple, nodes: dict[NodeId, Node], out: dict[Any, Edge]) -> FanOut:
    chains = [_plain_chain(t, out) for t in targets]
    common = [n for n in chains[0] if all(n in c for c in chains[1:])]
    if not common:
        for chain in chains:  # NOTE: the nodes before a chain's last have plain edges
            if out[chain[-1]].is_conditional or out[chain[-1]].is_fanout:
                raise GraphError(
                    f"node {chain[-1]!r} in a branch of the fan-out at {src!r} has a conditional "
                    "or fan-out edge; branches are chains of plain edges"
                )
        raise GraphError(
            f"fan-out at {src!r}: branches {targets!r} never join (no node all of them reach "
            "through plain edges)"
        )
    join = common[0]
    branches = tuple(tuple(c[: c.index(join)]) for c in chains)
    for target, branch in zip(targets, branches, strict=True):
        if not branch:
            raise GraphError(f"fan-out at {src!r}: target {target!r} is the join itself")
    writers: dict[str, NodeId] = {}
    for branch in branches:
        keys = {nodes[n].output: n for n in branch if nodes[n].output is not None}
        for key, node_id in keys.items():
            if key in writers:
                raise GraphError(
                    f"fan-out at {src!r}: nodes {writers[key]!r} and {node_id!r} in different "
                    f"branches both write {key!r}; branches must write disjoint keys"
                )
        writers.update(keys)
    return FanOut(src, branches, join)


def _plain_chain(start: NodeId, out: dict[Any, Edge]) -> list[NodeId]:
    """``start`` and the nodes after it along plain edges (the last one may have any edge)."""
    chain = [start]
    while True:
        edge = out[chain[-1]]
        if edge.is_conditional or edge.is_fanout or edge.dst is END or edge.dst in chain:
            return chain
        chain.append(edge.dst)


def _check_entries(fanouts: dict[Any, FanOut], out: dict[Any, Edge]) -> None:
    """No edge enters a branch except the fan-out itself and the branch's own chain."""
    inside = {n: (f, chain) for f in fanouts.values() for chain in f.branches for n in chain}
    for src, edge in out.items():
        for dst in edge.declared_targets():
            if dst not in inside:
                continue
            fanout, chain = inside[dst]
            i = chain.index(dst)
            ok = src == fanout.src if i == 0 else src == chain[i - 1]
            if not ok:
                raise GraphError(
                    f"edge from {src!r} enters the branch of the fan-out at {fanout.src!r} "
                    f"at {dst!r}; a branch is entered only by its fan-out"
                )


def _check_variables(
    nodes: dict[NodeId, Node], succ: dict[Any, tuple[Any, ...]], inputs: tuple[str, ...]
) -> None:
    for node_id, node in nodes.items():
        before = [n for n in nodes if node_id in _reach(n, succ, strict=True)]
        available = {INPUT_KEY, *inputs} | {nodes[n].output for n in before}
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
