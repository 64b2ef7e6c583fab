"""The operator node kinds beside generation and retrieval (OpRAG's operators, issue 16).

Each is a frozen dataclass with ``kind`` (its name), ``resource`` (where it runs, one of
``nodes.RESOURCES``), ``output`` (the state key it writes, or ``None``), ``inputs`` (the state
keys it reads, checked by ``compile()``) and ``append`` (always ``False``: ``State.write``
replaces the key).

| kind       | resource    | reads                         | writes                              |
| ---------- | ----------- | ----------------------------- | ----------------------------------- |
| function   | cpu         | the whole state (a snapshot)  | ``fn(state)``                       |
| upsert     | retrieval   | ``documents``                 | the upserted ids (``None``: nothing) |
| embed      | retrieval   | ``text`` (str or list of str) | float32 ``[dim]`` or ``[n, dim]``   |
| rerank     | retrieval   | ``query``, ``docs`` (passages) | the best ``topk`` passages, rescored |
| memory     | scheduler   | ``key`` (the session id)      | read: the entries; append: the text |
| completion | engine      | ``prompt`` (str or token ids) | the completion text                 |
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ragserve.graph.checks import check_int, check_sampling
from ragserve.graph.nodes import GenerationNode, GraphError, NodeId, RetrievalNode
from ragserve.graph.template import Template

MEMORY_MODES = ("read", "append")
DEFAULT_MEMORY_TEXT = "{input}\n{output}"  # what an append-mode memory node stores by default


@dataclass(frozen=True)
class FunctionNode:
    """``fn(state) -> value`` on a snapshot of the request's state, in the server's bounded
    CPU thread pool; the value goes to ``state[output]``. ``timeout_s`` (``None``: the
    server's ``OperatorConfig.function_timeout_s``) bounds the wait: past it, or when ``fn``
    raises, the request fails with a message naming the node (other requests go on)."""

    node_id: NodeId
    fn: Callable[[Any], Any]
    output: str
    timeout_s: float | None = None

    kind = "function"
    resource = "cpu"
    append = False
    inputs: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        check_callable(self.node_id, self.fn)
        if self.timeout_s is not None and not (
            isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf
        ):
            raise GraphError(f"node {self.node_id!r}: timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class UpsertNode:
    """Write ``state[documents]`` (a ``Document``, a string, or a list of them; strings get
    generated ids) into the index through the retrieval worker, durable (the index's WAL,
    fsynced) before the node completes; later retrieval nodes of the same request see them.
    ``output`` (optional) gets the list of upserted ids."""

    node_id: NodeId
    documents: str
    output: str | None = None

    kind = "upsert"
    resource = "retrieval"
    append = False

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset({self.documents})


@dataclass(frozen=True)
class EmbedNode:
    """Embed ``state[text]`` (a string: ``[dim]``; a list of strings: ``[n, dim]``, float32,
    normalised) with the index's embedder, document side, in the retrieval worker; all embed
    nodes ready in one cycle are embedded as one batch."""

    node_id: NodeId
    text: str
    output: str

    kind = "embed"
    resource = "retrieval"
    append = False

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset({self.text})


@dataclass(frozen=True)
class RerankNode:
    """Re-score the passages ``state[docs]`` against ``query`` (a state key or a ``{name}``
    template) with the retrieval worker's reranker and keep the best ``topk``, best first,
    each passage's ``score`` now the reranker's (``OperatorConfig.reranker``). By default
    (``"embedding"``) the scorer is the embedder's cosine similarity of query (query side) and
    passage (document side)."""

    node_id: NodeId
    query: Template
    docs: str
    topk: int
    output: str

    kind = "rerank"
    resource = "retrieval"
    append = False

    def __post_init__(self) -> None:
        check_int("topk", self.topk)

    @property
    def inputs(self) -> frozenset[str]:
        return self.query.variables | {self.docs}


@dataclass(frozen=True)
class MemoryNode:
    """Per-session memory. ``key`` names the state field holding the session id (a non-empty
    string; declare it with ``RAGraph(inputs=(key,))`` and pass it with ``Server.run(...,
    inputs={key: ...})``, or let an earlier node write it). ``read``: ``output`` gets the
    session's entries, oldest first (a list of strings; ``[]`` for a new session). ``append``:
    ``text`` (a template, default ``"{input}\\n{output}"``) is rendered and stored; ``output``
    (optional) gets the stored text. The store is the server's ``MemoryStore``: bounded in
    entries and bytes per session and in sessions, oldest dropped first, thread-safe."""

    node_id: NodeId
    key: str
    mode: str = "read"
    output: str | None = None
    text: Template | None = None

    kind = "memory"
    resource = "scheduler"
    append = False

    @property
    def inputs(self) -> frozenset[str]:
        extra = self.text.variables if self.text is not None else frozenset()
        return frozenset({self.key}) | extra


@dataclass(frozen=True)
class CompletionNode:
    """A plain LLM completion: ``state[prompt]`` (text or a tuple of token ids) as is, no chat
    template, with ``params`` (a ``SamplingParams``-like object: ``max_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``,
    ``ignore_eos``). ``Server.complete`` runs a one-node graph of it; the request's
    ``on_update`` sees every raw update."""

    node_id: NodeId
    params: Any
    prompt: str = "input"
    output: str = "output"

    kind = "completion"
    resource = "engine"
    append = False

    def __post_init__(self) -> None:
        check_sampling(
            max_tokens=self.params.max_tokens,
            temperature=self.params.temperature,
            top_p=self.params.top_p,
            top_k=getattr(self.params, "top_k", None),
            seed=getattr(self.params, "seed", None),
        )

    @property
    def inputs(self) -> frozenset[str]:
        return frozenset({self.prompt})


Node = (
    GenerationNode
    | RetrievalNode
    | FunctionNode
    | UpsertNode
    | EmbedNode
    | RerankNode
    | MemoryNode
    | CompletionNode
)
NODE_KINDS = (
    GenerationNode,
    RetrievalNode,
    FunctionNode,
    UpsertNode,
    EmbedNode,
    RerankNode,
    MemoryNode,
    CompletionNode,
)


def check_callable(node_id: NodeId, fn: Any) -> None:
    """``fn`` can be called as ``fn(state)``: callable, not a coroutine function, and its
    signature binds exactly one positional argument."""
    if not callable(fn):
        raise GraphError(f"node {node_id!r}: fn must be callable, got {type(fn).__name__}")
    call = type(fn).__call__ if not inspect.isroutine(fn) else fn
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call):
        raise GraphError(f"node {node_id!r}: fn must be a plain function, not async")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: trust it
    try:
        signature.bind(None)
    except TypeError:
        raise GraphError(
            f"node {node_id!r}: fn must take one positional argument (the state), "
            f"its signature is {signature}"
        ) from None
