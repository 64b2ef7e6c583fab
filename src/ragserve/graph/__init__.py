"""RAGraph: RAG workflows as graphs of operator nodes with conditional edges and fan-out/join;
build with ``RAGraph`` (fluent ``add_*``), validate with ``compile()``. No torch or faiss."""

from ragserve.graph.builder import RAGraph
from ragserve.graph.compiled import CompiledGraph, FanOut
from ragserve.graph.nodes import (
    END,
    RESOURCES,
    START,
    CompletionNode,
    Edge,
    EmbedNode,
    FunctionNode,
    GenerationNode,
    GraphError,
    MemoryNode,
    Node,
    RerankNode,
    RetrievalNode,
    State,
    UpsertNode,
)
from ragserve.graph.template import Passage, Template

__all__ = [
    "END",
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
]
