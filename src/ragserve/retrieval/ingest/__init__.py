"""Format parsers into heading-path sections, and chunking into passages in embedder tokens."""

from ragserve.retrieval.ingest.chunk import ChunkConfig, Chunker
from ragserve.retrieval.ingest.folder import IngestError, IngestReport, ingest_folder, parse_file
from ragserve.retrieval.ingest.sections import Block, ParsedDocument, Section

__all__ = [
    "Block",
    "ChunkConfig",
    "Chunker",
    "IngestError",
    "IngestReport",
    "ParsedDocument",
    "Section",
    "ingest_folder",
    "parse_file",
]
