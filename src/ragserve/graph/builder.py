"""``RAGraph``: the fluent builder users describe a RAG workflow with."""

from __future__ import annotations

from typing import Any

from ragserve.graph.compiled import CompiledGraph, validate
from ragserve.graph.nodes import (
    END,
    START,
    CompletionNode,
    Edge,
    EmbedNode,
    FunctionNode,
    GenerationNode,
    GraphError,
    MemoryNode,
    Node,
    NodeId,
    RerankNode,
    RetrievalNode,
    Terminal,
    UpsertNode,
)
from ragserve.graph.template import NAME, Template

DEFAULT_MEMORY_TEXT = "{input}\n{output}"  # what an append-mode memory node stores by default


class RAGraph:
    """Builder for a workflow graph; every ``add_*`` returns ``self`` and raises
    ``GraphError`` naming the node for a bad argument; ``compile()`` validates the graph.

    >>> g = RAGraph().add_retrieval(0, query="input", topk=3, output="docs")
    >>> g = g.add_generation(1, prompt="Answer {input} using:\\n{docs}")
    >>> graph = g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END).compile()
    """

    def __init__(
        self, name: str | None = None, *, inputs: tuple[str, ...] | list[str] = ()
    ) -> None:
        """``inputs``: state keys besides ``input`` (and ``history``) that every request
        brings (``Server.run(..., inputs={...})``), e.g. a memory node's session id."""
        for key in inputs:
            if not isinstance(key, str) or not NAME.match(key) or key in ("input", "history"):
                raise GraphError(f"inputs: {key!r} must be a state key name other than input")
        self.name = name
        self.inputs = tuple(dict.fromkeys(inputs))
        self._nodes: dict[NodeId, Node] = {}
        self._edges: list[Edge] = []
        self._duplicates: list[NodeId] = []

    def add_generation(
        self, node_id: NodeId, prompt: str, output: str | None = None, **options: Any
    ) -> RAGraph:
        """A generation node; ``output=None`` writes the answer key ``"output"``. ``options``:
        ``GenerationNode``'s fields (``max_tokens``, ``stop``, ``temperature``, ``append``,
        ``top_p``, ``seed``, ``with_history``, ``fusion_ratio``, ``ignore_eos``)."""
        options["stop"] = tuple(options.get("stop", ()))
        output = "output" if output is None else output
        return self._add(GenerationNode, node_id, Template.parse(prompt), output, **options)

    def add_retrieval(
        self, node_id: NodeId, query: str, topk: int, output: str, **options: Any
    ) -> RAGraph:
        """A retrieval node; ``query`` names a state key (or is a ``{name}`` template).
        ``options``: ``RetrievalNode``'s fields (``nprobe``, ``append``, ``mode``, ``filter``,
        ``collapse_sections``)."""
        if options.get("filter") == {}:
            options["filter"] = None
        query_template = _query_template(node_id, query)
        return self._add(RetrievalNode, node_id, query_template, topk, output, **options)

    def add_function(
        self, node_id: NodeId, fn: Any, *, output: str, timeout_s: float | None = None
    ) -> RAGraph:
        """``fn(state) -> value`` into ``state[output]`` in the server's CPU pool."""
        return self._add(FunctionNode, node_id, fn, output, timeout_s)

    def add_upsert(self, node_id: NodeId, *, documents: str, output: str | None = None) -> RAGraph:
        """Write ``state[documents]`` into the index; ``output`` gets the ids."""
        return self._add(UpsertNode, node_id, documents, output)

    def add_embed(self, node_id: NodeId, *, text: str, output: str) -> RAGraph:
        """Embed ``state[text]`` (str or list of str) with the index's embedder."""
        return self._add(EmbedNode, node_id, text, output)

    def add_rerank(
        self, node_id: NodeId, *, query: str, docs: str, topk: int, output: str
    ) -> RAGraph:
        """Rerank the passages ``state[docs]`` for ``query`` (a state key or a template)."""
        query_template = _query_template(node_id, query)
        return self._add(RerankNode, node_id, query_template, docs, topk, output)

    def add_memory(
        self,
        node_id: NodeId,
        *,
        key: str,
        mode: str = "read",
        output: str | None = None,
        text: str | None = None,
    ) -> RAGraph:
        """Per-session memory keyed by ``state[key]``: ``read`` into ``output``, or
        ``append`` ``text`` (a state key or template; default ``"{input}\\n{output}"``)."""
        if mode == "append":
            text = _query_template(node_id, DEFAULT_MEMORY_TEXT if text is None else text)
        return self._add(MemoryNode, node_id, key, mode, output, text)

    def add_completion(
        self, node_id: NodeId, *, params: Any, prompt: str = "input", output: str = "output"
    ) -> RAGraph:
        """A plain completion of ``state[prompt]`` with ``params`` (``SamplingParams``-like)."""
        return self._add(CompletionNode, node_id, params, prompt, output)

    def add_edge(self, src: Any, dst: Any, *, targets: tuple | list | None = None) -> RAGraph:
        """``src`` → ``dst``: a node id, ``END``, a router ``state -> node id | END``, or a
        tuple of node ids (fan-out: parallel branches, joined by the first node they all
        reach)."""
        if src is END:
            raise GraphError("END has no outgoing edges")
        if dst is START:
            raise GraphError(f"edge from {src!r} points at START")
        if targets is not None and not callable(dst):
            raise GraphError(f"edge from {src!r}: targets= is only for conditional edges")
        if isinstance(dst, (tuple, list)):
            dst = _fanout_targets(src, dst)
        self._edges.append(Edge(src, dst, None if targets is None else tuple(targets)))
        return self

    def compile(self) -> CompiledGraph:
        """Validate and freeze; raises ``GraphError`` naming the offending node."""
        if self._duplicates:
            raise GraphError(f"duplicate node id {self._duplicates[0]!r}")
        return validate(self.name, dict(self._nodes), list(self._edges), self.inputs)

    def _add(self, kind: type, node_id: NodeId, *args: Any, **kwargs: Any) -> RAGraph:
        if isinstance(node_id, Terminal) or not _hashable(node_id):
            raise GraphError(f"invalid node id {node_id!r}")
        try:
            node = kind(node_id, *args, **kwargs)
        except ValueError as exc:
            raise GraphError(f"node {node_id!r}: {exc}") from None
        if node_id in self._nodes:
            self._duplicates.append(node_id)
        else:
            self._nodes[node_id] = node
        return self


def _query_template(node_id: NodeId, source: str) -> Template:
    """A state key name as ``{name}``, or a template as is."""
    if not isinstance(source, str) or ("{" not in source and not NAME.match(source)):
        raise GraphError(f"node {node_id!r}: query must be a state key name, got {source!r}")
    return Template.parse(source if "{" in source else "{" + source + "}")


def _fanout_targets(src: Any, dst: tuple | list) -> tuple:
    targets = tuple(dst)
    if len(targets) < 2:
        raise GraphError(f"fan-out from {src!r} needs at least two targets, got {targets!r}")
    for t in targets:
        if isinstance(t, Terminal) or callable(t) or not _hashable(t):
            raise GraphError(f"fan-out from {src!r}: targets must be node ids, got {t!r}")
    if len(set(targets)) != len(targets):
        raise GraphError(f"fan-out from {src!r} names a target twice: {targets!r}")
    return targets


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
