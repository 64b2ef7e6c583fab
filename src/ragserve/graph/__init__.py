"""RAGraph: RAG workflows as graphs of generation and retrieval nodes.

Build with ``RAGraph`` (fluent ``add_*``), validate with ``compile()``. Imports neither torch
nor faiss.
"""

from ragserve.graph.builder import RAGraph
from ragserve.graph.compiled import INPUT_KEY, CompiledGraph
from ragserve.graph.nodes import (
    END,
    START,
    Edge,
    GenerationNode,
    GraphError,
    Node,
    RetrievalNode,
    State,
)
from ragserve.graph.template import Passage, Template, render_value

__all__ = [
    "END",
    "INPUT_KEY",
    "START",
    "CompiledGraph",
    "Edge",
    "GenerationNode",
    "GraphError",
    "Node",
    "Passage",
    "RAGraph",
    "RetrievalNode",
    "State",
    "Template",
    "render_value",
]
