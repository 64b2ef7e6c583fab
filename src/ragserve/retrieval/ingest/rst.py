"""reStructuredText → sections, with docutils; Sphinx roles become their display text and the
common Sphinx directives are registered (code as code, prose kept, `toctree` etc. dropped)."""

from __future__ import annotations

import functools
import re

from ragserve.retrieval.ingest.sections import ParsedDocument, SectionBuilder, role_display_text

# :role:`text`, :domain:role:`title <target>`, :role:`~pkg.mod.name` (Sphinx cross-references)
_ROLE = re.compile(r":(?:[A-Za-z][\w.+-]*:)+`((?:[^`\\]|\\.)+)`")

_CODE_DIRECTIVES = ("code-block", "sourcecode", "code", "doctest", "testcode", "testoutput",
                    "productionlist", "parsed-literal")  # fmt: skip
_SKIP_DIRECTIVES = ("toctree", "index", "highlight", "currentmodule", "moduleauthor",
                    "sectionauthor", "tabularcolumns", "literalinclude", "audit-event",
                    "include", "raw", "image", "figure", "contents", "autosummary",
                    "automodule", "autoclass", "autofunction", "default-role", "role",
                    "testsetup", "testcleanup", "program", "c:namespace", "cpp:namespace",
                    "py:currentmodule", "sectnum", "header", "footer", "meta")  # fmt: skip
_CONTAINER_DIRECTIVES = ("only", "versionadded", "versionchanged", "deprecated",
                         "deprecated-removed", "seealso", "impl-detail",
                         "availability", "glossary", "centered", "hlist", "rubric",
                         "module", "function", "class", "method", "attribute", "data",
                         "exception", "decorator", "decoratormethod", "classmethod",
                         "staticmethod", "describe", "option", "cmdoption", "envvar",
                         "opcode", "pdbcommand", "fixer", "2to3fixer", "coroutinefunction",
                         "coroutinemethod", "abstractmethod", "property", "awaitablefunction",
                         "c:function", "c:macro", "c:type", "c:member", "c:var", "c:struct",
                         "c:enum", "c:enumerator", "c:union", "cfunction", "cmember", "cmacro",
                         "ctype", "cvar", "py:function", "py:class", "py:method", "py:module",
                         "py:attribute", "py:data", "py:exception", "tab", "tabs",
                         "grid", "grid-item", "grid-item-card", "card", "dropdown",
                         "versionremoved", "todo", "confval")  # fmt: skip
_SKIP_NODES = ("comment", "system_message", "substitution_definition", "target", "raw",
               "pending", "meta", "image", "figure", "footnote_reference",
               "citation_reference", "problematic", "title_reference_skip")  # fmt: skip


def parse_rst(text: str, doc_title: str | None = None) -> ParsedDocument:
    """Parse reStructuredText; markup and directives are dropped, their text kept."""
    from docutils.core import publish_doctree

    _register_directives()
    tree = publish_doctree(
        _ROLE.sub(_role_text, text),
        settings_overrides={
            "report_level": 5,
            "halt_level": 5,
            "warning_stream": False,
            "file_insertion_enabled": False,
            "raw_enabled": False,
            "doctitle_xform": False,
            "sectsubtitle_xform": False,
        },
    )
    _drop_file_metadata(tree)
    builder = SectionBuilder(doc_title)
    _walk(tree, builder, level=0)
    return ParsedDocument(builder.build())


def _drop_file_metadata(tree) -> None:
    """Remove a leading field list: Sphinx's file-wide metadata (``:orphan:``), not text."""
    from docutils import nodes

    for child in tree.children:
        if isinstance(child, nodes.comment | nodes.target | nodes.substitution_definition):
            continue
        if isinstance(child, nodes.field_list | nodes.docinfo):
            tree.remove(child)
        return


def _role_text(match: re.Match) -> str:
    body = role_display_text(match.group(1).replace("\\", ""))
    return "``" + body.replace("`", "'") + "``" if body else ""


def _walk(node, builder: SectionBuilder, level: int) -> None:
    from docutils import nodes

    for child in node.children:
        name = child.tagname
        if name in _SKIP_NODES:
            continue
        if isinstance(child, nodes.section):
            title = child.next_node(nodes.title)
            builder.heading(level + 1, title.astext() if title is not None else "")
            _walk(child, builder, level + 1)
        elif isinstance(child, nodes.title):
            continue  # read with its section
        elif isinstance(child, nodes.literal_block | nodes.doctest_block):
            builder.add(child.astext(), is_code=True)
        elif isinstance(child, nodes.list_item):
            builder.add("- " + _plain(child))
        elif isinstance(child, nodes.table):
            for row in child.findall(nodes.row):
                builder.add(" | ".join(_plain(entry) for entry in row.children))
        elif isinstance(child, nodes.definition_list_item | nodes.field):
            parts = [_plain(c) for c in child.children]
            builder.add(": ".join(p for p in parts if p))
        elif isinstance(child, nodes.Admonition):
            label = child.tagname.replace("_", " ").capitalize()
            builder.add(f"{label}: {_plain(child)}" if label != "Admonition" else _plain(child))
        elif isinstance(child, nodes.TextElement):
            builder.add(child.astext())
        else:
            _walk(child, builder, level)


def _plain(node) -> str:
    """Text of a node without comments, system messages and other skipped nodes."""
    from docutils import nodes

    if isinstance(node, nodes.Text):
        return str(node)
    if node.tagname in _SKIP_NODES:
        return ""
    sep = "" if isinstance(node, nodes.TextElement) else " "
    return " ".join(sep.join(_plain(c) for c in node.children).split())


@functools.cache
def _register_directives() -> None:
    from docutils import nodes
    from docutils.parsers.rst import Directive, directives

    class Skip(Directive):
        has_content = True
        optional_arguments = 10
        final_argument_whitespace = True
        option_spec = _AnyOptions()

        def run(self):
            return []

    class Code(Skip):
        optional_arguments = 1

        def run(self):
            return [nodes.literal_block(text="\n".join(self.content))]

    class Container(Skip):
        def run(self):
            out = []
            if self.arguments and self.name not in ("only", "tab", "tabs"):
                # NOTE: parsed as inline text, so that markup in an argument (``literal``,
                # `link <url>`_, *emphasis*) becomes its text, as in the directive's body
                text = " ".join(self.arguments)
                inline, _ = self.state.inline_text(text, self.lineno)
                out.append(nodes.paragraph(text, "", *inline))
            if self.content:
                box = nodes.container()
                self.state.nested_parse(self.content, self.content_offset, box)
                out.append(box)
            return out

    for name in _CODE_DIRECTIVES:
        directives.register_directive(name, Code)
    for name in _SKIP_DIRECTIVES:
        directives.register_directive(name, Skip)
    for name in _CONTAINER_DIRECTIVES:
        directives.register_directive(name, Container)


class _AnyOptions(dict):
    """An option spec that accepts every option (Sphinx directives have many)."""

    def __contains__(self, key) -> bool:
        return True

    def __getitem__(self, key):
        return lambda value: value
