"""A folder of documents → `ParsedDocument`s by file type (plain text and PDF parsed here: one
section under the document's title, blocks at blank lines); unusable files are listed."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ragserve.retrieval.ingest.html import parse_html
from ragserve.retrieval.ingest.markdown import parse_markdown
from ragserve.retrieval.ingest.rst import parse_rst
from ragserve.retrieval.ingest.sections import PARAGRAPH_BREAK, ParsedDocument, SectionBuilder

logger = logging.getLogger(__name__)


def parse_text(text: str, doc_title: str | None = None) -> ParsedDocument:
    return ParsedDocument(_paragraphs([text], doc_title))


def parse_pdf(path: Path, doc_title: str | None = None) -> ParsedDocument:
    """Every page's paragraphs (pypdf) under the PDF's own title if any; `ValueError` for an
    encrypted or text-less PDF."""
    from pypdf import PdfReader

    reader = PdfReader(str(path))
    if reader.is_encrypted:
        raise ValueError("encrypted PDF")
    title = (reader.metadata.title if reader.metadata else None) or doc_title
    pages = [page.extract_text() or "" for page in reader.pages]
    sections = _paragraphs(pages, str(title) if title else None)
    if not sections:
        raise ValueError("no extractable text (a scanned PDF?)")
    return ParsedDocument(sections, {"num_pages": len(reader.pages)})


def _paragraphs(texts: list[str], title: str | None):
    builder = SectionBuilder(title)
    for text in texts:
        for para in PARAGRAPH_BREAK.split(text):
            builder.add(para)
    return builder.build()


_TEXT_PARSERS: dict[str, Callable[[str, str | None], ParsedDocument]] = {
    ".rst": parse_rst, ".rest": parse_rst, ".rst.txt": parse_rst,  # .rst.txt: Sphinx _sources/
    ".md": parse_markdown, ".markdown": parse_markdown, ".html": parse_html, ".htm": parse_html,
    ".txt": parse_text, ".text": parse_text,
}  # fmt: skip
SUPPORTED_SUFFIXES = (*_TEXT_PARSERS, ".pdf")


class IngestError(ValueError):
    """`strict` ingest met files it cannot use; the message lists how many and the first few."""


@dataclass
class IngestReport:
    """Files read, `skipped` ones `(relative path, reason)` and readable ones without text."""

    num_files: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)

    def summary(self, first: int = 5) -> str:
        names = ", ".join(f"{p} ({why})" for p, why in self.skipped[:first])
        more = f", +{len(self.skipped) - first} more" if len(self.skipped) > first else ""
        return f"{len(self.skipped)} file(s) skipped: {names}{more}" if self.skipped else ""


def suffix_of(path: Path) -> str:
    name = path.name.lower()
    return ".rst.txt" if name.endswith(".rst.txt") else path.suffix.lower()


def parse_file(path: Path, doc_title: str | None = None) -> ParsedDocument:
    """Parse one file by its suffix; raises `ValueError` for an unsupported type."""
    suffix = suffix_of(path)
    if suffix == ".pdf":
        return parse_pdf(path, doc_title)
    parser = _TEXT_PARSERS.get(suffix)
    if parser is None:
        raise ValueError(f"unsupported file type {suffix or '(none)'}")
    return parser(path.read_text(encoding="utf-8"), doc_title)


def ingest_folder(
    root: str | Path, *, strict: bool = False, report: IngestReport | None = None
) -> list[tuple[str, ParsedDocument]]:
    """Sorted `(relative path, parsed document)` of the usable files under `root`, hidden ones
    ignored; the others go into `report` (with `strict`: `IngestError` once all are checked)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no corpus folder at {root}")
    report = report if report is not None else IngestReport()
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or any(part.startswith(".") for part in rel.split("/")):
            continue
        report.num_files += 1
        doc, why = _try_parse(path)
        if doc is None:
            report.skipped.append((rel, why))
        elif not doc.sections:
            report.empty.append(rel)
        else:
            out.append((rel, doc))
    if report.skipped:
        if strict:
            raise IngestError(f"{root}: {report.summary()}")
        logger.warning("%s: %s", root, report.summary())
    return out


def _try_parse(path: Path) -> tuple[ParsedDocument | None, str]:
    suffix = suffix_of(path)
    if suffix not in SUPPORTED_SUFFIXES:
        return None, "unsupported type"
    try:
        doc = parse_file(path, path.name[: -len(suffix)])
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    except Exception as exc:  # noqa: BLE001 - any parser failure makes the file unusable
        return None, f"unreadable: {type(exc).__name__}: {exc}"[:200]
    return doc, ""
