"""Markdown → sections, with markdown-it-py (CommonMark + tables); YAML front matter becomes
metadata. MyST and mkdocs-material / pymdown markup is read as those sites render it
(docs/architecture.md, "Ingest")."""

from __future__ import annotations

import re
from typing import Any

from ragserve.retrieval.ingest.sections import (
    Block,
    ParsedDocument,
    SectionBuilder,
    role_display_text,
)

_CODE_DIRECTIVES = ("code-block", "code", "sourcecode", "code-cell", "ipython", "doctest",
                    "testcode", "testoutput", "jupyter-execute", "parsed-literal")  # fmt: skip
_SKIP_DIRECTIVES = ("toctree", "contents", "include", "literalinclude", "image", "raw",
                    "mermaid", "graphviz", "index", "tableofcontents", "autosummary",
                    "bibliography", "plot", "currentmodule", "py:currentmodule", "highlight",
                    "program", "sectionauthor", "moduleauthor", "meta", "csv-table")  # fmt: skip
# labelled like the rST parser's admonitions: "Note: <body>"
_ADMONITIONS = ("attention", "caution", "danger", "error", "hint", "important", "note", "tip",
                "warning", "seealso", "todo", "abstract", "info", "success", "question",
                "failure", "bug", "example", "quote")  # fmt: skip
_NO_ARGUMENT_TEXT = ("figure",)  # the argument is a path, the body its caption

_OPTION = re.compile(r"^:[\w-]+:(?:\s.*)?$")
_ROLE_TAIL = re.compile(r"\{[A-Za-z][\w:+.-]*\}$")
_MYST_TARGET = re.compile(r"^\([\w\-:.]+\)=$")
_ATTR = r"(?:[#.][\w-]+|[\w-]+=(?:\"[^\"]*\"|'[^']*'|[^\s}]+))"
_ATTR_LIST = re.compile(r"\s*\{:?\s*" + _ATTR + r"(?:\s+" + _ATTR + r")*\s*\}")
_REF_LINK = re.compile(r"\[([^\[\]]+)\]\[[^\[\]]*\]")
_FOOTNOTE_REF = re.compile(r"\[\^[^\[\]]+\]")
# mkdocs-material / pymdown blocks: `!!! type "Title"`, `??? type`, `???+ type`, `=== "Tab"`
_MKDOCS_BLOCK = re.compile(
    r"^(?P<indent>[ \t]*)(?:(?P<adm>!!!|\?\?\?\+?)[ \t]+(?P<type>[\w-]+)"
    r"(?:[ \t]+\"(?P<title>[^\"]*)\")?|===[!+]?[ \t]+\"(?P<tab>[^\"]*)\")[ \t]*$"
)
_MKDOCSTRINGS = re.compile(r"^[ \t]*:::[ \t]+[\w.:\-]+[ \t]*$")
_SNIPPET = re.compile(r"^[ \t]*-{1,2}8<-{1,2}[ \t]")
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")


def parse_markdown(text: str, doc_title: str | None = None) -> ParsedDocument:
    """Parse Markdown; inline markup is dropped (link text, code spans kept)."""
    tokens = _parser().parse(_mkdocs_to_myst(text))
    metadata = _front_matter(tokens)
    title = metadata.get("title")
    builder = SectionBuilder(str(title) if title else doc_title)
    _emit(tokens, builder, nested=False)
    return ParsedDocument(builder.build(), metadata)


def _parser():
    from markdown_it import MarkdownIt
    from mdit_py_plugins.colon_fence import colon_fence_plugin
    from mdit_py_plugins.front_matter import front_matter_plugin

    return MarkdownIt("commonmark").enable("table").use(front_matter_plugin).use(colon_fence_plugin)


def _emit(tokens, builder: SectionBuilder, *, nested: bool) -> None:
    """Add `tokens`' text to `builder`; `nested` (a directive's body): headings are blocks."""
    i, list_depth, row = 0, 0, []
    while i < len(tokens):
        tok = tokens[i]
        if tok.type == "heading_open":
            heading = _ATTR_LIST.sub("", _inline(tokens[i + 1]))
            if nested:
                builder.add(heading)
            else:
                builder.heading(int(tok.tag[1]), heading)
            i += 2
        elif tok.type in ("fence", "colon_fence") and tok.info.strip().startswith("{"):
            for block in _directive(tok.info.strip(), tok.content):
                builder.add(block.text, is_code=block.is_code)
        elif tok.type == "colon_fence":  # `::: name` (no braces): a container of prose
            _emit(_parser().parse(tok.content), builder, nested=nested)
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
        elif tok.type == "inline" and not _MYST_TARGET.match(tok.content.strip()):
            builder.add(("- " if list_depth else "") + _inline(tok))
        i += 1


def _directive(info: str, content: str) -> list[Block]:
    """The blocks a MyST directive ``{name} argument`` with body `content` renders as."""
    name, _, argument = info[1:].partition("}")
    name, argument = name.strip().lower(), argument.strip()
    body = _strip_options(content)
    if name in _SKIP_DIRECTIVES or name.startswith("auto"):
        return []
    if name in _CODE_DIRECTIVES:
        return [Block(body.strip("\n"), is_code=True)] if body.strip() else []
    if name == "eval-rst":
        from ragserve.retrieval.ingest.rst import parse_rst

        return [b for s in parse_rst(body).sections for b in s.blocks]
    builder = SectionBuilder()
    if argument and name not in _NO_ARGUMENT_TEXT:
        builder.add(argument)
    _emit(_parser().parse(body), builder, nested=True)
    blocks = [b for s in builder.build() for b in s.blocks]
    if name in _ADMONITIONS and blocks and not blocks[0].is_code:
        blocks[0] = Block(f"{name.capitalize()}: {blocks[0].text}")
    return blocks


def _strip_options(content: str) -> str:
    """A directive body without its leading ``:key: value`` lines or ``---`` YAML block."""
    lines = content.split("\n")
    if lines and lines[0].strip() == "---" and "---" in (x.strip() for x in lines[1:]):
        end = next(j for j in range(1, len(lines)) if lines[j].strip() == "---")
        return "\n".join(lines[end + 1 :])
    start = 0
    while start < len(lines) and _OPTION.match(lines[start].strip()):
        start += 1
    return "\n".join(lines[start:])


def _mkdocs_to_myst(text: str) -> str:
    """mkdocs-material / pymdown blocks as MyST colon fences (nested ones too); mkdocstrings
    inserts and snippet lines dropped; fenced code left as it is."""
    if not ("!!!" in text or "???" in text or "===" in text or ":::" in text or "8<" in text):
        return text
    lines = text.split("\n")
    out: list[str] = []
    i, fence = 0, None
    while i < len(lines):
        line = lines[i]
        i += 1
        opened = _FENCE.match(line)
        if fence is not None or opened:  # fenced code, kept as it is
            if fence is None:
                fence = opened.group(1)
            elif opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            out.append(line)
            continue
        if _MKDOCSTRINGS.match(line):  # `::: package.module` and its indented options
            while i < len(lines) and (lines[i][:1] in (" ", "\t")) and lines[i].strip():
                i += 1
            continue
        if _SNIPPET.match(line):
            continue
        block = _MKDOCS_BLOCK.match(line)
        if block is None:
            out.append(line)
            continue
        indent = len(block.group("indent").expandtabs(4))
        body, i = _indented_body(lines, i, indent)
        inner = _mkdocs_to_myst("\n".join(body))
        colons = ":" * max(3, 1 + max((len(m) for m in re.findall(r"^:+", inner, re.M)), default=0))
        if block.group("adm"):
            title = block.group("title")
            head = f"{{{block.group('type')}}}" if title is None else f"{{admonition}} {title}"
        else:
            head = f"{{tab-item}} {block.group('tab')}"
        pad = block.group("indent")
        body = [pad + x if x.strip() else x for x in inner.split("\n")]  # e.g. in a list item
        out += [f"{pad}{colons}{head}", *body, f"{pad}{colons}", ""]
    return "\n".join(out)


def _indented_body(lines: list[str], start: int, indent: int) -> tuple[list[str], int]:
    """The lines from `start` indented deeper than `indent`, dedented, and the index after."""
    end = start
    while end < len(lines):
        line = lines[end]
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    body = [x.expandtabs(4) for x in lines[start:end]]
    depth = min((len(x) - len(x.lstrip()) for x in body if x.strip()), default=0)
    return [x[depth:] for x in body], end


def _inline(token) -> str:
    parts = []
    children = token.children or ()
    for j, child in enumerate(children):
        if child.type == "text":
            text = child.content
            nxt = children[j + 1] if j + 1 < len(children) else None
            if nxt is not None and nxt.type == "code_inline" and _ROLE_TAIL.search(text):
                text = _ROLE_TAIL.sub("", text)  # `{role}` before a code span: a MyST role
                nxt.meta = {**(nxt.meta or {}), "myst_role": True}
            text = _FOOTNOTE_REF.sub("", _REF_LINK.sub(r"\1", text))
            parts.append(_ATTR_LIST.sub("", text))
        elif child.type == "code_inline":
            role = (child.meta or {}).get("myst_role")
            parts.append(role_display_text(child.content) if role else child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append(" ")
        elif child.type == "image":
            parts.append(child.content)  # alt text
    return "".join(parts)


def _front_matter(tokens) -> dict[str, Any]:
    tok = next((t for t in tokens if t.type == "front_matter"), None)
    if tok is None:
        return {}
    import yaml

    try:
        data = yaml.safe_load(tok.content)
    except yaml.YAMLError:
        return {}
    return {str(k): _jsonable(v) for k, v in data.items()} if isinstance(data, dict) else {}


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
