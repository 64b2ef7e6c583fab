"""The graph's vocabulary: ``START``/``END``, the node kinds, ``Edge`` and the request ``State``.

Each node kind is a frozen dataclass with ``kind``, ``resource`` (one of ``RESOURCES``),
``output`` (the state key it writes, or ``None``), ``inputs`` (the keys it reads, checked by
``compile()``) and ``append``; it checks its fields when built (``ValueError`` naming the
field). What each kind reads and writes: README, "Building workflows from operators".
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ragserve.graph.checks import check_int, check_sampling_of
from ragserve.graph.template import NAME, Passage, Template


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
RESOURCES = ("engine", "retrieval", "cpu", "scheduler")
"""Where a node kind runs: the engine's batch, the retrieval worker's batch, the server's CPU
pool, or inline in the scheduler thread."""
MEMORY_MODES = ("read", "append")
RETRIEVAL_MODES = (None, "dense", "bm25", "hybrid", "ensemble")


class State(dict):
    """A request's state: ``input``, then every node's output under its ``output`` key.

    ``visits[node_id]`` counts the node's finished runs, so routers can bound loops. Never
    mutated once routers or transforms may hold it: ``write`` returns a new state.
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
        """The state after ``node`` returned ``value``, its visit counted (the one write rule).
        With ``node.append`` and the key present, text is newline-joined to the old text and
        passages are added after the old ones (duplicates by id dropped); else ``value``
        replaces the key."""
        state = self.fork()
        key = getattr(node, "output", None)
        if key is not None:
            old = state.get(key)
            if getattr(node, "append", False) and key in state:
                if isinstance(value, str):
                    value = f"{old}\n{value}"
                else:
                    seen = {p.doc_id for p in old}
                    fresh = [p for p in value if isinstance(p, Passage) and p.doc_id not in seen]
                    value = list(old) + fresh
            state[key] = value
        state.visits[node.node_id] = state.visit_count(node.node_id) + 1
        return state


class Node:
    """The base of every node kind: ``append`` off unless a field says so, checked keys."""

    append = False
    keys: tuple[str, ...] = ("output",)  # fields naming state keys (required)
    optional_keys: tuple[str, ...] = ()  # fields naming state keys or None
    reads: tuple[str, ...] = ()  # fields whose keys or template variables it reads

    def __post_init__(self) -> None:
        for name in (*self.keys, *self.optional_keys):
            value = getattr(self, name)
            if value is None and name in self.optional_keys:
                continue
            if not isinstance(value, str) or not NAME.match(value):
                raise ValueError(f"{name} must be a state key name, got {value!r}")
        self.check()

    def check(self) -> None:
        """The kind's own field checks."""

    @property
    def inputs(self) -> frozenset[str]:
        out: set[str] = set()
        for name in self.reads:
            value = getattr(self, name)
            if isinstance(value, Template):
                out |= value.variables
            elif value is not None:
                out.add(value)
        return frozenset(out)


@dataclass(frozen=True)
class GenerationNode(Node):
    """Render ``prompt``, generate, write the text to ``state[output]``. ``with_history``:
    whether ``state["history"]`` precedes the prompt (``None``: only for answer nodes, those
    writing ``"output"``); ``fusion_ratio``: cache fusion of the prompt's passages (None: off)."""

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
    fusion_ratio: float | None = None
    ignore_eos: bool = False  # generate exactly max_tokens unless a stop string ends it

    kind = "generation"
    resource = "engine"
    reads = ("prompt",)

    def check(self) -> None:
        check_sampling_of(self)
        if self.fusion_ratio is not None and not 0.0 <= self.fusion_ratio <= 1.0:
            raise ValueError(f"fusion_ratio must be in [0, 1], got {self.fusion_ratio}")

    def history(self, state: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
        """The ``(role, content)`` turns to put before this node's prompt (empty: none)."""
        use = self.output == "output" if self.with_history is None else self.with_history
        return tuple(state.get("history", ())) if use else ()


@dataclass(frozen=True)
class RetrievalNode(Node):
    """Render ``query``, retrieve ``topk`` passages into ``state[output]``. ``nprobe``,
    ``mode``, ``filter`` and ``collapse_sections`` are ``VectorIndex.search_text``'s (None:
    the index's defaults)."""

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
    reads = ("query",)

    def check(self) -> None:
        check_int("topk", self.topk)
        if self.nprobe is not None:
            check_int("nprobe", self.nprobe)
        if self.mode not in RETRIEVAL_MODES:
            raise ValueError("mode must be dense, bm25, hybrid, ensemble or None")
        if self.filter is not None and not isinstance(self.filter, dict):
            raise ValueError("filter must be a dict of metadata conditions")
        if self.collapse_sections is not None and not isinstance(self.collapse_sections, bool):
            raise ValueError("collapse_sections must be a bool or None")


@dataclass(frozen=True)
class FunctionNode(Node):
    """``fn(state) -> value`` on a snapshot of the state, in the server's CPU pool, bounded
    by ``timeout_s`` (``None``: ``OperatorConfig.function_timeout_s``)."""

    node_id: NodeId
    fn: Callable[[Any], Any]
    output: str
    timeout_s: float | None = None

    kind = "function"
    resource = "cpu"

    def check(self) -> None:
        check_callable(self.fn)
        if self.timeout_s is not None and not (
            isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s < math.inf
        ):
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class UpsertNode(Node):
    """Write ``state[documents]`` (``Document``s or strings) into the index, durable before
    the node completes; ``output`` (optional) gets the upserted ids."""

    node_id: NodeId
    documents: str
    output: str | None = None

    kind = "upsert"
    resource = "retrieval"
    reads = ("documents",)
    keys = ("documents",)
    optional_keys = ("output",)


@dataclass(frozen=True)
class EmbedNode(Node):
    """Embed ``state[text]`` (str: ``[dim]``; list of str: ``[n, dim]``), document side."""

    node_id: NodeId
    text: str
    output: str

    kind = "embed"
    resource = "retrieval"
    reads = ("text",)
    keys = ("text", "output")


@dataclass(frozen=True)
class RerankNode(Node):
    """Re-score the passages ``state[docs]`` against ``query`` with the reranker
    (``OperatorConfig.reranker``) and keep the best ``topk``, best first."""

    node_id: NodeId
    query: Template
    docs: str
    topk: int
    output: str

    kind = "rerank"
    resource = "retrieval"
    reads = ("query", "docs")
    keys = ("docs", "output")

    def check(self) -> None:
        check_int("topk", self.topk)


@dataclass(frozen=True)
class MemoryNode(Node):
    """Per-session memory (the server's ``MemoryStore``); ``state[key]`` is the session id.
    ``read``: ``output`` gets the entries, oldest first. ``append``: ``text`` is rendered and
    stored; ``output`` (optional) gets the stored text."""

    node_id: NodeId
    key: str
    mode: str = "read"
    output: str | None = None
    text: Template | None = None

    kind = "memory"
    resource = "scheduler"
    reads = ("key", "text")
    keys = ("key",)
    optional_keys = ("output",)

    def check(self) -> None:
        if self.mode not in MEMORY_MODES:
            raise ValueError(f"mode must be 'read' or 'append', got {self.mode!r}")
        if self.mode == "read" and self.output is None:
            raise ValueError("a read memory node needs output=")
        if self.mode == "read" and self.text is not None:
            raise ValueError("text= is only for append memory nodes")


@dataclass(frozen=True)
class CompletionNode(Node):
    """A plain completion of ``state[prompt]`` (text or token ids, no chat template) with
    ``params`` (a ``SamplingParams``-like object)."""

    node_id: NodeId
    params: Any
    prompt: str = "input"
    output: str = "output"

    kind = "completion"
    resource = "engine"
    reads = ("prompt",)
    keys = ("prompt", "output")

    def check(self) -> None:
        try:
            check_sampling_of(self.params)
        except ValueError as exc:
            raise ValueError(f"params: {exc}") from None


def check_callable(fn: Any) -> None:
    """``fn`` can be called as ``fn(state)``: callable, not async, one positional argument."""
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    call = type(fn).__call__ if not inspect.isroutine(fn) else fn
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call):
        raise ValueError("fn must be a plain function, not async")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: trust it
    try:
        signature.bind(None)
    except TypeError:
        raise ValueError(
            f"fn must take one positional argument (the state), its signature is {signature}"
        ) from None


@dataclass(frozen=True)
class Edge:
    """``src`` → ``dst``: a node id / ``END``, a router ``state -> node id | END``, or a tuple
    of node ids (a fan-out). ``targets``: a router's possible destinations (``None``: any
    node and ``END``), checked by ``compile()`` and at run time."""

    src: Any
    dst: Any
    targets: tuple[Any, ...] | None = field(default=None)

    @property
    def is_conditional(self) -> bool:
        return callable(self.dst) and not isinstance(self.dst, Terminal)

    @property
    def is_fanout(self) -> bool:
        return isinstance(self.dst, tuple)

    def declared_targets(self) -> tuple[Any, ...]:
        """The destinations named in the edge (a router's ``targets``, or none)."""
        if self.is_conditional:
            return self.targets or ()
        return self.dst if self.is_fanout else (self.dst,)
