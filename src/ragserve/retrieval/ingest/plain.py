"""Plain text and PDF → sections: one section titled by the document, blocks at blank lines."""

from __future__ import annotations

import re
from pathlib import Path

from ragserve.retrieval.ingest.sections import ParsedDocument, SectionBuilder

_BLANK = re.compile(r"\n\s*\n")


def parse_text(text: str, doc_title: str | None = None) -> ParsedDocument:
    """Paragraphs (blank-line separated) under the document's title."""
    builder = SectionBuilder(doc_title)
    for para in _BLANK.split(text):
        builder.add(para)
    return ParsedDocument(builder.build())


def parse_pdf(path: Path, doc_title: str | None = None) -> ParsedDocument:
    """Every page's paragraphs (pypdf) under the PDF's own title if any; `ValueError` for an
    encrypted or text-less PDF."""
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    if reader.is_encrypted:
        raise ValueError("encrypted PDF")
    title = (reader.metadata.title if reader.metadata else None) or doc_title
    builder = SectionBuilder(str(title) if title else None)
    for page in reader.pages:
        for para in _BLANK.split(page.extract_text() or ""):
            builder.add(para)
    doc = ParsedDocument(builder.build(), {"num_pages": len(reader.pages)})
    if not doc.sections:
        raise ValueError("no extractable text (a scanned PDF?)")
    return doc
