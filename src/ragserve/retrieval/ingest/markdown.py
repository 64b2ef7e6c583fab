"""Markdown → sections, with markdown-it-py (CommonMark + tables); YAML front matter becomes
document metadata (its `title`, if any, heads the heading path)."""

from __future__ import annotations

from typing import Any

from ragserve.retrieval.ingest.sections import ParsedDocument, SectionBuilder


def parse_markdown(text: str, doc_title: str | None = None) -> ParsedDocument:
    """Parse Markdown; inline markup is dropped (link text, code spans kept), fences are code."""
    from markdown_it import MarkdownIt
    from mdit_py_plugins.front_matter import front_matter_plugin

    md = MarkdownIt("commonmark").enable("table").use(front_matter_plugin)
    tokens = md.parse(text)
    metadata = _front_matter(tokens)
    title = metadata.get("title")
    builder = SectionBuilder(str(title) if title else doc_title)
    i, list_depth, row = 0, 0, []
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == "heading_open":
            builder.heading(int(tok.tag[1]), _inline(tokens[i + 1]))
            i += 2
        elif tok.type in ("fence", "code_block"):
            builder.add(tok.content, is_code=True)
        elif tok.type == "html_block":
            builder.add(_html_text(tok.content))
        elif tok.type in ("bullet_list_open", "ordered_list_open"):
            list_depth += 1
        elif tok.type in ("bullet_list_close", "ordered_list_close"):
            list_depth -= 1
        elif tok.type == "tr_open":
            row = []
        elif tok.type == "tr_close":
            builder.add(" | ".join(row))
        elif tok.type == "inline" and tokens[i - 1].type in ("th_open", "td_open"):
            row.append(_inline(tok))
        elif tok.type == "inline":
            builder.add(("- " if list_depth else "") + _inline(tok))
        i += 1
    return ParsedDocument(builder.build(), metadata)


def _inline(token) -> str:
    parts = []
    for child in token.children or ():
        if child.type in ("text", "code_inline"):
            parts.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append(" ")
        elif child.type == "image":
            parts.append(child.content)  # alt text
        elif child.type == "html_inline":
            continue
    return "".join(parts)


def _front_matter(tokens) -> dict[str, Any]:
    for tok in tokens:
        if tok.type == "front_matter":
            import yaml

            try:
                data = yaml.safe_load(tok.content)
            except yaml.YAMLError:
                return {}
            if not isinstance(data, dict):
                return {}
            return {str(k): _jsonable(v) for k, v in data.items()}
    return {}


def _html_text(html: str) -> str:
    from bs4 import BeautifulSoup

    return BeautifulSoup(html, "html.parser").get_text(" ")


def _jsonable(value: Any) -> Any:
    """YAML dates → ISO strings (range filters compare them as text); containers recursively."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return value
