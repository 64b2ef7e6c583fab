"""`VectorIndex`'s text side: what an embedded passage reads (`passage_text`), the search
defaults recorded at build, section collapsing's check and the BM25 side index."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ragserve.retrieval.types import Document

if TYPE_CHECKING:
    from ragserve.retrieval.bm25 import BM25Index


class PassageMixin:
    """Needs `VectorIndex`'s `metadata`, `_store`, `_write_mutex`, `_bm25` and `_sectioned`."""

    @property
    def default_mode(self) -> str:
        """`search_text(mode=None)`'s mode: recorded at build, else "dense"."""
        return str(self.metadata.get("default_mode", "dense"))

    @property
    def passage_header(self) -> str:
        """What embedded passages start with (`passage_text`): recorded at build, else "path"."""
        return str(self.metadata.get("passage_header", "path"))

    def embed_text(self, doc: Document) -> str:
        """The text this index embeds for `doc` (its `passage_header`)."""
        return passage_text(doc, self.passage_header)

    @property
    def collapse_sections(self) -> bool:
        """Whether `search_text(collapse_sections=None)` collapses: recorded at build, else True."""
        return bool(self.metadata.get("collapse_sections", True))

    @property
    def has_sections(self) -> bool:
        """Whether some passage may share a section (`collapse.has_section`); an index without
        one collapses nothing. Stays True after such passages are deleted (a no-op then)."""
        if self._sectioned is None:
            from ragserve.retrieval.collapse import SECTIONED_SQL

            self._sectioned = self._store.any_where(SECTIONED_SQL)
        return self._sectioned

    def collapses(self, collapse_sections: bool | None) -> bool:
        """Whether a search asking `collapse_sections` (None: the index's) collapses: asked and
        `has_sections`."""
        if collapse_sections is None:
            collapse_sections = self.collapse_sections
        elif not isinstance(collapse_sections, bool):
            raise ValueError(f"collapse_sections must be a bool or None, got {collapse_sections!r}")
        return collapse_sections and self.has_sections

    def bm25(self) -> BM25Index:
        """The BM25 side index; built from the stored passages on first use."""
        from ragserve.retrieval.bm25 import BM25Index, live_texts

        with self._write_mutex:
            if self._bm25 is None:
                pairs = live_texts(self._store, self._store.row_ids_where("1"))
                self._bm25 = BM25Index.from_texts([r for r, _ in pairs], [t for _, t in pairs])
            return self._bm25


PASSAGE_HEADERS = ("path", "none")


def check_header(header: str) -> str:
    if header not in PASSAGE_HEADERS:
        raise ValueError(
            f"passage_header must be one of {', '.join(PASSAGE_HEADERS)}, got {header!r}"
        )
    return header


def passage_text(doc: Document, header: str = "path") -> str:
    """What the embedder sees of a passage: header "path": `"<title>: <text>"` (the title is
    the heading path), "none": the text alone. The LLM always sees `doc.text`."""
    if header == "path" and doc.title and not doc.text.startswith(doc.title):
        return f"{doc.title}: {doc.text}"
    return doc.text
