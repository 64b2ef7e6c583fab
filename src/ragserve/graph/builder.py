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
    NodeId,
    RetrievalNode,
    Terminal,
)
from ragserve.graph.operators import (
    DEFAULT_MEMORY_TEXT,
    MEMORY_MODES,
    CompletionNode,
    EmbedNode,
    FunctionNode,
    MemoryNode,
    Node,
    RerankNode,
    UpsertNode,
)
from ragserve.graph.template import NAME, Template


class RAGraph:
    """Builder for a workflow graph; every ``add_*`` returns ``self``; ``compile()`` validates.

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
        ignore_eos: bool = False,
    ) -> RAGraph:
        """A generation node; ``output=None`` writes the answer key ``"output"``.

        ``temperature``, ``top_p`` and ``seed`` are the node's sampling (temperature 0: greedy).
        ``with_history`` puts the conversation (``state["history"]``) before the prompt
        (``None``: answer nodes only); set it on nodes that write queries from the question.
        ``fusion_ratio`` turns on cache fusion for the prompt's paragraphs between the first
        and the last (the passages): the share of their tokens recomputed (None: off).
        ``ignore_eos`` keeps generating past the end-of-sequence token (vLLM's sampling flag;
        benchmarks use it for fixed output lengths).
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
            ignore_eos=ignore_eos,
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
        collapse_sections: bool | None = None,
    ) -> RAGraph:
        """A retrieval node; ``query`` names a state key (or is a ``{name}`` template).
        ``mode`` / ``filter`` / ``collapse_sections``: see ``RetrievalNode``."""
        _check_key(node_id, "output", output)
        query_template = _query_template(node_id, query)
        if topk < 1:
            raise GraphError(f"node {node_id!r}: topk must be >= 1, got {topk}")
        if nprobe is not None and nprobe < 1:
            raise GraphError(f"node {node_id!r}: nprobe must be >= 1 or None, got {nprobe}")
        if mode not in (None, "dense", "bm25", "hybrid", "ensemble"):
            raise GraphError(
                f"node {node_id!r}: mode must be dense, bm25, hybrid, ensemble or None"
            )
        if filter is not None and not isinstance(filter, dict):
            raise GraphError(f"node {node_id!r}: filter must be a dict of metadata conditions")
        if collapse_sections is not None and not isinstance(collapse_sections, bool):
            raise GraphError(f"node {node_id!r}: collapse_sections must be a bool or None")
        node = RetrievalNode(
            node_id,
            query_template,
            topk,
            output,
            nprobe,
            append,
            mode,
            filter or None,
            collapse_sections,
        )
        return self._add(node)

    def add_function(
        self, node_id: NodeId, fn: Any, *, output: str, timeout_s: float | None = None
    ) -> RAGraph:
        """A Python step: ``fn(state) -> value`` into ``state[output]``, run in the server's
        bounded CPU thread pool (``timeout_s``; ``None``: the server's default)."""
        _check_key(node_id, "output", output)
        return self._add(FunctionNode(node_id, fn, output, timeout_s))

    def add_upsert(self, node_id: NodeId, *, documents: str, output: str | None = None) -> RAGraph:
        """Write ``state[documents]`` (``Document``, str, or a list) into the index, durable
        before the node completes; ``output`` gets the ids."""
        _check_key(node_id, "documents", documents)
        if output is not None:
            _check_key(node_id, "output", output)
        return self._add(UpsertNode(node_id, documents, output))

    def add_embed(self, node_id: NodeId, *, text: str, output: str) -> RAGraph:
        """Embed ``state[text]`` (str or list of str) with the index's embedder."""
        _check_key(node_id, "text", text)
        _check_key(node_id, "output", output)
        return self._add(EmbedNode(node_id, text, output))

    def add_rerank(
        self, node_id: NodeId, *, query: str, docs: str, topk: int, output: str
    ) -> RAGraph:
        """Rerank the passages ``state[docs]`` for ``query`` (a state key or a ``{name}``
        template) and keep the best ``topk``."""
        _check_key(node_id, "docs", docs)
        _check_key(node_id, "output", output)
        try:
            node = RerankNode(node_id, _query_template(node_id, query), docs, topk, output)
        except ValueError as exc:
            raise GraphError(f"node {node_id!r}: {exc}") from None
        return self._add(node)

    def add_memory(
        self,
        node_id: NodeId,
        *,
        key: str,
        mode: str = "read",
        output: str | None = None,
        text: str | None = None,
    ) -> RAGraph:
        """Per-session memory: ``key`` names the state field holding the session id. ``read``
        writes the session's entries to ``output`` (required); ``append`` stores ``text`` (a
        state key or template; default ``"{input}\n{output}"``)."""
        _check_key(node_id, "key", key)
        if mode not in MEMORY_MODES:
            raise GraphError(f"node {node_id!r}: mode must be 'read' or 'append', got {mode!r}")
        if output is not None:
            _check_key(node_id, "output", output)
        if mode == "read" and output is None:
            raise GraphError(f"node {node_id!r}: a read memory node needs output=")
        if mode == "read" and text is not None:
            raise GraphError(f"node {node_id!r}: text= is only for append memory nodes")
        template = None
        if mode == "append":
            template = _query_template(node_id, DEFAULT_MEMORY_TEXT if text is None else text)
        return self._add(MemoryNode(node_id, key, mode, output, template))

    def add_completion(
        self, node_id: NodeId, *, params: Any, prompt: str = "input", output: str = "output"
    ) -> RAGraph:
        """A plain completion of ``state[prompt]`` (text or token ids; no chat template) with
        ``params`` (a ``SamplingParams``-like object)."""
        _check_key(node_id, "prompt", prompt)
        _check_key(node_id, "output", output)
        try:
            node = CompletionNode(node_id, params, prompt, output)
        except (ValueError, AttributeError) as exc:
            raise GraphError(f"node {node_id!r}: params: {exc}") from None
        return self._add(node)

    def add_edge(self, src: Any, dst: Any, *, targets: tuple | list | None = None) -> RAGraph:
        """``src`` → ``dst``: a node id, ``END``, a router ``state -> node id | END``, or a
        tuple of node ids (fan-out: parallel branches, joined by the first node they all
        reach; see ``compile()``)."""
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

    def _add(self, node: Node) -> RAGraph:
        if isinstance(node.node_id, Terminal) or not _hashable(node.node_id):
            raise GraphError(f"invalid node id {node.node_id!r}")
        if node.node_id in self._nodes:
            self._duplicates.append(node.node_id)
        else:
            self._nodes[node.node_id] = node
        return self


def _query_template(node_id: NodeId, source: str) -> Template:
    """A state key name as ``{name}``, or a template as is."""
    if not isinstance(source, str):
        raise GraphError(f"node {node_id!r}: expected a state key or template, got {source!r}")
    if "{" not in source:
        _check_key(node_id, "query", source)
        source = "{" + source + "}"
    return Template.parse(source)


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


def _check_key(node_id: NodeId, what: str, key: str) -> None:
    if not isinstance(key, str) or not NAME.match(key):
        raise GraphError(f"node {node_id!r}: {what} must be a state key name, got {key!r}")


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
