"""Format parsers into heading-path sections, and chunking into passages in embedder tokens."""

from ragserve.retrieval.ingest.chunk import ChunkConfig, Chunker, ChunkStats
from ragserve.retrieval.ingest.folder import (
    SUPPORTED_SUFFIXES,
    IngestError,
    IngestReport,
    ingest_folder,
    parse_file,
)
from ragserve.retrieval.ingest.sections import Block, ParsedDocument, Section

__all__ = [
    "SUPPORTED_SUFFIXES",
    "Block",
    "ChunkConfig",
    "ChunkStats",
    "Chunker",
    "IngestError",
    "IngestReport",
    "ParsedDocument",
    "Section",
    "ingest_folder",
    "parse_file",
]
