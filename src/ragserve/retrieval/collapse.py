"""Section collapsing: at most one passage per section in a ranked result
(docs/architecture.md, "Section collapsing")::

    ranked:    A#3  A#4  B#0  A#5  C#1  D#0  B#1  E#2 ...
    collapsed: A#3  B#0  C#1  D#0  E#2                    (topk = 5)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from ragserve.retrieval.types import Document, ScoredDocument

FETCH_FACTOR = 4  # a query short of sections is searched again this many times deeper
SECTIONED_SQL = (  # a stored passage (`docs.metadata`) that `section_key` groups with others
    "(json_type(metadata, '$.source') IS NOT NULL"
    " AND json_type(metadata, '$.section') IS NOT NULL)"
    " OR json_type(metadata, '$.source_id') IS NOT NULL"
)


def section_key(doc: Document) -> Hashable:
    """The group a passage collapses with: `(metadata["source"], metadata["section"])` for an
    ingested file, `metadata["source_id"]` for a chunked record, else the passage itself."""
    meta = doc.metadata
    if "source" in meta and "section" in meta:
        return ("section", str(meta["source"]), str(meta["section"]))
    if "source_id" in meta:
        return ("record", str(meta["source_id"]))
    return ("passage", doc.id)


def has_section(doc: Document) -> bool:
    """Whether `doc` can share its section with another passage (`section_key`)."""
    return section_key(doc)[0] != "passage"


def collapse_hits(hits: Sequence[ScoredDocument], topk: int) -> list[ScoredDocument]:
    """The first hit of each section, in rank order, cut to `topk`."""
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    first: dict[Hashable, ScoredDocument] = {}
    for hit in hits:
        first.setdefault(section_key(hit.document), hit)
    return list(first.values())[:topk]
