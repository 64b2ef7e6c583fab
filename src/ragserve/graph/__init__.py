"""RAGraph: RAG workflows as graphs of operator nodes (generation, retrieval, embed, rerank,
upsert, memory, function, completion), with conditional edges and fan-out/join.

Build with ``RAGraph`` (fluent ``add_*``), validate with ``compile()``. Imports neither torch
nor faiss.
"""

from ragserve.graph.builder import RAGraph
from ragserve.graph.compiled import INPUT_KEY, CompiledGraph, FanOut
from ragserve.graph.nodes import (
    END,
    RESOURCES,
    START,
    Edge,
    GenerationNode,
    GraphError,
    RetrievalNode,
    State,
)
from ragserve.graph.operators import (
    CompletionNode,
    EmbedNode,
    FunctionNode,
    MemoryNode,
    Node,
    RerankNode,
    UpsertNode,
)
from ragserve.graph.template import Passage, Template, render_value

__all__ = [
    "END",
    "INPUT_KEY",
    "RESOURCES",
    "START",
    "CompiledGraph",
    "CompletionNode",
    "Edge",
    "EmbedNode",
    "FanOut",
    "FunctionNode",
    "GenerationNode",
    "GraphError",
    "MemoryNode",
    "Node",
    "RerankNode",
    "UpsertNode",
    "Passage",
    "RAGraph",
    "RetrievalNode",
    "State",
    "Template",
    "render_value",
]
