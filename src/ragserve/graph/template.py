"""Safe ``{name}`` templates: parsed once; rendering substitutes values verbatim and never
re-scans them, so user text is data (no ``str.format``: ``{x.__class__}``, ``{0}``, ``{}``
render literally). ``{{`` and ``}}`` are escaped braces."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class Passage:
    """One retrieved document as it lives in the request state."""

    doc_id: str
    text: str
    title: str | None = None
    score: float | None = None


@dataclass(frozen=True)
class Template:
    """A parsed template: ``parts`` alternate literal text (str) and variable names (``_Var``)."""

    source: str
    parts: tuple[str | _Var, ...]

    @classmethod
    def parse(cls, source: str) -> Template:
        if not isinstance(source, str):
            raise TypeError(f"template must be a str, got {type(source).__name__}")
        parts: list[str | _Var] = []
        pos = 0
        for m in _TOKEN.finditer(source):
            parts.append(source[pos : m.start()])
            token = m.group(0)
            parts.append(_Var(m.group(1)) if m.group(1) else token[0])
            pos = m.end()
        parts.append(source[pos:])
        return cls(source, tuple(p for p in parts if p != ""))

    @property
    def variables(self) -> frozenset[str]:
        return frozenset(p.name for p in self.parts if isinstance(p, _Var))

    def render(self, state: Mapping[str, Any]) -> str:
        """Substitute each ``{name}`` with ``render_value(state.get(name))``; missing is empty."""
        return "".join(
            render_value(state.get(p.name)) if isinstance(p, _Var) else p for p in self.parts
        )


@dataclass(frozen=True)
class _Var:
    name: str


def render_value(value: Any) -> str:
    """Text for one state value: passages become numbered passages, a list of strings one
    line each, None becomes ''."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, Passage):
        return _render_passage(1, value)
    if isinstance(value, Sequence) and value and all(isinstance(v, Passage) for v in value):
        return "\n\n".join(_render_passage(i, p) for i, p in enumerate(value, 1))
    if isinstance(value, Sequence) and not value:
        return ""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # e.g. a memory node's entries: one per line
    return str(value)


def _render_passage(number: int, passage: Passage) -> str:
    head = f"[{number}] {passage.title}\n" if passage.title else f"[{number}] "
    return head + passage.text.strip()
