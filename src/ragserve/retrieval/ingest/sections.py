"""What every format parser returns: sections (heading path, blocks) in reading order."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

_ROLE_TARGET = re.compile(r"^(.*?)\s*<[^<>]+>$", re.S)
PARAGRAPH_BREAK = re.compile(r"\n\s*\n")


def role_display_text(body: str) -> str:
    """What a Sphinx / MyST cross-reference role shows: the title of ``title <target>``, else
    the target without a leading ``!``, and ``~a.b.c`` as its last part ``c``."""
    shown = _ROLE_TARGET.match(body)
    body = shown.group(1) if shown else body.lstrip("!")
    return body[1:].rsplit(".", 1)[-1] if body.startswith("~") else body


@dataclass(frozen=True)
class Block:
    """One paragraph, list item, table row group or code block; `is_code` keeps its lines."""

    text: str
    is_code: bool = False


@dataclass(frozen=True)
class Section:
    """The blocks directly under one heading; `path` is the heading path from the document's
    title down (`("Tutorial", "Data Structures", "Sets")`)."""

    path: tuple[str, ...]
    blocks: tuple[Block, ...]

    @property
    def title(self) -> str:
        return " > ".join(self.path)


@dataclass(frozen=True)
class ParsedDocument:
    """A parsed file: its sections and document-level metadata (e.g. Markdown front matter)."""

    sections: tuple[Section, ...]
    metadata: dict[str, Any] = field(default_factory=dict)


class SectionBuilder:
    """Blocks under a heading stack: `heading(level, text)` opens a section (1 = the title),
    `add(text)` appends to it; blocks under no heading get the path `(fallback_title,)`."""

    def __init__(self, fallback_title: str | None = None) -> None:
        self._fallback = fallback_title
        self._stack: list[tuple[int, str]] = []
        self._blocks: list[Block] = []
        self._sections: list[Section] = []

    def heading(self, level: int, text: str) -> None:
        text = " ".join(text.split())
        if not text:
            return
        self._flush()
        while self._stack and self._stack[-1][0] >= level:
            self._stack.pop()
        self._stack.append((level, text))

    def add(self, text: str, *, is_code: bool = False) -> None:
        text = text.strip("\n") if is_code else " ".join(text.split())
        if text.strip():
            self._blocks.append(Block(text, is_code))

    def build(self) -> tuple[Section, ...]:
        self._flush()
        return tuple(self._sections)

    def _flush(self) -> None:
        if self._blocks:
            path = tuple(t for _, t in self._stack)
            if not path and self._fallback:
                path = (self._fallback,)
            self._sections.append(Section(path, tuple(self._blocks)))
            self._blocks = []
