"""``RAGraph``: the fluent builder users describe a RAG workflow with."""

from __future__ import annotations

from typing import Any

from ragserve.graph.compiled import CompiledGraph, validate
from ragserve.graph.nodes import (
    END,
    START,
    Edge,
    GenerationNode,
    GraphError,
    Node,
    NodeId,
    RetrievalNode,
    Terminal,
)
from ragserve.graph.template import NAME, Template


class RAGraph:
    """Builder for a workflow graph; every ``add_*`` returns ``self``; ``compile()`` validates.

    >>> g = RAGraph().add_retrieval(0, query="input", topk=3, output="docs")
    >>> g = g.add_generation(1, prompt="Answer {input} using:\\n{docs}")
    >>> graph = g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END).compile()
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self._nodes: dict[NodeId, Node] = {}
        self._edges: list[Edge] = []
        self._duplicates: list[NodeId] = []

    def add_generation(
        self,
        node_id: NodeId,
        prompt: str,
        output: str | None = None,
        *,
        max_tokens: int = 128,
        stop: tuple[str, ...] | list[str] = (),
        temperature: float = 0.0,
        append: bool = False,
        top_p: float = 1.0,
        seed: int | None = None,
        with_history: bool | None = None,
        fusion_ratio: float | None = None,
    ) -> RAGraph:
        """A generation node; ``output=None`` writes the answer key ``"output"``.

        ``temperature``, ``top_p`` and ``seed`` are the node's sampling (temperature 0: greedy).
        ``with_history`` puts the conversation (``state["history"]``) before the prompt
        (``None``: answer nodes only); set it on nodes that write queries from the question.
        ``fusion_ratio`` turns on cache fusion for the prompt's paragraphs between the first
        and the last (the passages): the share of their tokens recomputed (None: off).
        """
        output = "output" if output is None else output
        _check_key(node_id, "output", output)
        if max_tokens < 1:
            raise GraphError(f"node {node_id!r}: max_tokens must be >= 1, got {max_tokens}")
        if temperature < 0:
            raise GraphError(f"node {node_id!r}: temperature must be >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise GraphError(f"node {node_id!r}: top_p must be in (0, 1], got {top_p}")
        if fusion_ratio is not None and not 0.0 <= fusion_ratio <= 1.0:
            raise GraphError(
                f"node {node_id!r}: fusion_ratio must be in [0, 1], got {fusion_ratio}"
            )
        node = GenerationNode(
            node_id,
            Template.parse(prompt),
            output,
            max_tokens,
            tuple(stop),
            temperature,
            append,
            top_p=top_p,
            seed=seed,
            with_history=with_history,
            fusion_ratio=fusion_ratio,
        )
        return self._add(node)

    def add_retrieval(
        self,
        node_id: NodeId,
        query: str,
        topk: int,
        output: str,
        *,
        nprobe: int | None = None,
        append: bool = False,
        mode: str | None = None,
        filter: dict[str, Any] | None = None,  # noqa: A002 - the retrieval API's name
    ) -> RAGraph:
        """A retrieval node; ``query`` names a state key (or is a ``{name}`` template).
        ``mode`` / ``filter``: see ``RetrievalNode``."""
        _check_key(node_id, "output", output)
        if "{" not in query:
            _check_key(node_id, "query", query)
            query = "{" + query + "}"
        if topk < 1:
            raise GraphError(f"node {node_id!r}: topk must be >= 1, got {topk}")
        if nprobe is not None and nprobe < 1:
            raise GraphError(f"node {node_id!r}: nprobe must be >= 1 or None, got {nprobe}")
        if mode not in (None, "dense", "bm25", "hybrid"):
            raise GraphError(f"node {node_id!r}: mode must be dense, bm25, hybrid or None")
        if filter is not None and not isinstance(filter, dict):
            raise GraphError(f"node {node_id!r}: filter must be a dict of metadata conditions")
        node = RetrievalNode(
            node_id, Template.parse(query), topk, output, nprobe, append, mode, filter or None
        )
        return self._add(node)

    def add_edge(self, src: Any, dst: Any, *, targets: tuple | list | None = None) -> RAGraph:
        """``src`` → ``dst`` (a node id, ``END``, or a router ``state -> node id | END``)."""
        if src is END:
            raise GraphError("END has no outgoing edges")
        if dst is START:
            raise GraphError(f"edge from {src!r} points at START")
        if targets is not None and not callable(dst):
            raise GraphError(f"edge from {src!r}: targets= is only for conditional edges")
        self._edges.append(Edge(src, dst, None if targets is None else tuple(targets)))
        return self

    def compile(self) -> CompiledGraph:
        """Validate and freeze; raises ``GraphError`` naming the offending node."""
        if self._duplicates:
            raise GraphError(f"duplicate node id {self._duplicates[0]!r}")
        return validate(self.name, dict(self._nodes), list(self._edges))

    def _add(self, node: Node) -> RAGraph:
        if isinstance(node.node_id, Terminal) or not _hashable(node.node_id):
            raise GraphError(f"invalid node id {node.node_id!r}")
        if node.node_id in self._nodes:
            self._duplicates.append(node.node_id)
        else:
            self._nodes[node.node_id] = node
        return self


def _check_key(node_id: NodeId, what: str, key: str) -> None:
    if not isinstance(key, str) or not NAME.match(key):
        raise GraphError(f"node {node_id!r}: {what} must be a state key name, got {key!r}")


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
