"""Format parsers strip markup and keep text and code; heading paths become titles; files that
cannot be used are reported (or fail a strict ingest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragserve.retrieval.ingest import IngestError, IngestReport, ingest_folder, parse_file

DOCS = Path(__file__).parent / "fixtures" / "docs"
MARKUP = ("::", ".. ", ":func:", ":ref:", ":class:", "``", "**", "](", "<b>", "</", "&amp;",
          "¶", "---", "|---")  # fmt: skip


def _text(doc) -> str:
    return "\n".join(b.text for s in doc.sections for b in s.blocks)


def _titles(doc) -> list[str]:
    return [s.title for s in doc.sections]


@pytest.mark.parametrize("name", ["tutorial.rst", "guide/install.md", "page.html", "notes.txt"])
def test_markup_is_stripped(name):
    text = _text(parse_file(DOCS / name, "stem"))
    assert text.strip()
    assert not [m for m in MARKUP if m in text], text


def test_rst_keeps_roles_code_and_directive_content():
    doc = parse_file(DOCS / "tutorial.rst")
    assert _titles(doc) == ["Tutorial", "Tutorial > Data Structures > Sets"]
    blocks = [b for s in doc.sections for b in s.blocks]
    text = _text(doc)
    assert "Intro paragraph with len and the guide and code." in text  # roles → display text
    assert "Shown only in HTML." in text  # `.. only::` content kept
    assert "See Set." in text  # `~collections.abc.Set` → `Set`
    code = [b.text for b in blocks if b.is_code]
    assert code == ["basket = {'apple', 'orange'}\nprint(basket)", ">>> x = 1"]
    assert "Note: Sets have no order." in text
    assert "len(s)" in text and "Return the length." in text  # `function::` signature + body
    assert "single: set" not in text and "foo" not in text  # index / toctree dropped


def test_markdown_front_matter_lists_tables_and_code():
    doc = parse_file(DOCS / "guide" / "install.md")
    assert doc.metadata == {
        "title": "Install Guide",
        "date": "2024-05-01",
        "tags": ["setup", "pip"],
    }
    assert _titles(doc) == ["Installing", "Installing > From PyPI"]
    blocks = doc.sections[1].blocks
    assert [b.text for b in blocks] == [
        "- create a virtual environment",
        "- install the package",
        "pip install ragserve",
        "option | meaning",
        "--user | per-user install",
    ]
    assert blocks[2].is_code


def test_html_main_content_only():
    doc = parse_file(DOCS / "page.html")
    text = _text(doc)
    assert _titles(doc) == ["Library Reference", "Library Reference > Functions"]
    assert "The json module encodes & decodes JSON." in text
    assert 'print(json.dumps({"a": 1}))' in text
    for chrome in ("Home", "Sidebar", "Copyright", "tracking", "color"):
        assert chrome not in text


def test_html_without_h1_is_titled_by_the_page_title():
    doc = parse_file(DOCS / "page.html")
    assert doc.sections[0].path[0] == "Library Reference"
    from ragserve.retrieval.ingest.html import parse_html

    bare = parse_html("<html><head><title>Only Title</title></head><body><p>x y</p></body></html>")
    assert _titles(bare) == ["Only Title"]


def test_html_sphinx_toctree_dropped_like_rst_toctree():
    from ragserve.retrieval.ingest.html import parse_html

    page = parse_html(
        '<html><body><div role="main"><h1>FAQ</h1><p>Questions by topic.</p>'
        '<div class="toctree-wrapper compound"><ul><li class="toctree-l1">'
        '<a href="general.html">Why does this project exist?</a></li></ul></div>'
        "</div></body></html>"
    )
    assert _text(page) == "Questions by topic."


def test_html_docutils_page_contents_dropped_but_a_contents_wrapper_kept():
    from ragserve.retrieval.ingest.html import parse_html

    page = parse_html(
        '<html><body><div class="document"><h1>FAQ</h1><div class="contents topic">'
        '<p class="topic-title">Contents</p><ul><li><a href="#q1">Is it fast?</a></li></ul>'
        '</div><h2 id="q1">Is it fast?</h2><p>Yes, quite.</p></div></body></html>'
    )
    assert _text(page).count("Is it fast?") == 0 and "Yes, quite." in _text(page)
    menu = parse_html(
        '<html><body><div class="document"><div class="sidemenu"><div class="menu"><ul>'
        '<li>Download</li></ul></div><div class="banner">Donate!</div></div>'
        "<h1>Intro</h1><p>Text.</p></div></body></html>"
    )
    assert _text(menu) == "Text."
    doxygen = parse_html('<html><body><div class="contents"><h1>API</h1><p>Call f().</p></div>')
    assert _text(doxygen) == "Call f()."


def test_pdf_text_and_title():
    doc = parse_file(DOCS / "report.pdf", "report")
    assert _titles(doc) == ["Annual Report"]
    text = _text(doc)
    assert "Revenue grew by ten percent this year." in text
    assert "The board approved a new plan." in text


def test_plain_text_paragraphs_under_the_file_name():
    doc = parse_file(DOCS / "notes.txt", "notes")
    assert _titles(doc) == ["notes"]
    assert [b.text for b in doc.sections[0].blocks] == [
        "Plain notes",
        "First paragraph of notes.",
        "Second paragraph.",
    ]


def test_folder_reports_skipped_files():
    report = IngestReport()
    docs = ingest_folder(DOCS, report=report)
    assert [rel for rel, _ in docs] == [
        "guide/install.md",
        "notes.txt",
        "page.html",
        "report.pdf",
        "tutorial.rst",
    ]  # sorted; hidden files ignored
    assert report.num_files == 7
    assert report.skipped == [
        ("broken.txt", "not UTF-8 text"),
        ("slides.pptx", "unsupported type"),
    ]
    assert report.summary().startswith("2 file(s) skipped: broken.txt (not UTF-8 text)")


def test_strict_ingest_fails_naming_the_files():
    with pytest.raises(IngestError, match=r"2 file\(s\) skipped: broken.txt .* slides.pptx"):
        ingest_folder(DOCS, strict=True)


def test_unreadable_pdf_is_reported(tmp_path):
    (tmp_path / "bad.pdf").write_bytes(b"%PDF-1.4 truncated")
    (tmp_path / "ok.md").write_text("# T\n\ntext\n")
    report = IngestReport()
    docs = ingest_folder(tmp_path, report=report)
    assert [rel for rel, _ in docs] == ["ok.md"]
    assert report.skipped[0][0] == "bad.pdf" and report.skipped[0][1].startswith("unreadable")


def test_a_file_without_text_is_empty_not_skipped(tmp_path):
    (tmp_path / "index.rst").write_text("Contents\n========\n\n.. toctree::\n\n   a\n")
    report = IngestReport()
    assert ingest_folder(tmp_path, strict=True, report=report) == []
    assert report.empty == ["index.rst"] and report.skipped == []


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="no corpus folder"):
        ingest_folder(DOCS / "nope")


def test_rst_directive_arguments_lose_their_inline_markup(tmp_path):
    path = tmp_path / "changes.rst"
    path.write_text(
        "Changes\n=======\n\n"
        ".. versionchanged:: 1.4 the ``Row`` object is a *named* tuple\n\n"
        ".. seealso:: `speed tips <https://example.org/tips>`_ and :ref:`howto`\n\n"
        "   Body text.\n",
        encoding="utf-8",
    )
    text = _text(parse_file(path))
    assert "1.4 the Row object is a named tuple" in text
    assert "speed tips and howto" in text and "Body text." in text
    assert not [m for m in ("``", "`_", "<https", "*named*") if m in text], text


def test_rst_file_wide_metadata_is_not_text(tmp_path):
    path = tmp_path / "faq.rst"
    path.write_text(
        ":tocdepth: 2\n:orphan:\n\n===\nFAQ\n===\n\nWhat is it?\n-----------\n\n"
        ":Author: kept: a field list inside a section is text\n\nAn answer.\n",
        encoding="utf-8",
    )
    text = _text(parse_file(path))
    assert "tocdepth" not in text and "orphan" not in text
    assert "An answer." in text and "Author: kept" in text


MYST = """# Guide

Intro with {doc}`Black is MIT <license>`, {py:func}`~pkg.mod.run` and [the std][std ref].

(install-label)=
## Install {#install}

````{note}
:class: tip
Inner **bold** [link](http://a).
```python
code here
```
````

:::{warning} Careful
body text
:::

```{toctree}
:maxdepth: 2
hidden-page
```

```{eval-rst}
.. note:: An rST note with :func:`len`.
```

```{code-block} python
:linenos:
print(1)
```
"""

MKDOCS = """# Install

!!! tip "Pro tip"
    Use the **cache**.

    Second paragraph.

!!! warning
    Plain warning.

=== "Bash"

    Save the script:

    ```console
    echo hi
    ```

::: hatch.cli
    options:
      depth: 0

--8<-- "snippet.md"

![diagram](x.png){ loading=lazy }
End.
"""


def _blocks(text: str):
    from ragserve.retrieval.ingest.markdown import parse_markdown

    doc = parse_markdown(text, "stem")
    return doc, [(b.text, b.is_code) for s in doc.sections for b in s.blocks]


def test_myst_directives_roles_and_targets_read_as_sphinx_renders_them():
    """MyST (Sphinx's Markdown): admonitions keep their prose, labelled like rST's; code
    directives are code without their options; eval-rst goes through the rST parser; toctree
    is dropped; roles show their title; `(label)=` and `{#id}` are not text."""
    doc, blocks = _blocks(MYST)
    assert _titles(doc) == ["Guide", "Guide > Install"]
    assert blocks == [
        ("Intro with Black is MIT, run and the std.", False),
        ("Note: Inner bold link.", False),
        ("code here", True),
        ("Warning: Careful", False),
        ("body text", False),
        ("Note: An rST note with len.", False),
        ("print(1)", True),
    ]


def test_mkdocs_material_blocks_are_prose_not_code():
    """mkdocs-material admonitions and content tabs: CommonMark alone would keep their
    indented bodies as code blocks; mkdocstrings inserts and snippet lines are not text."""
    _, blocks = _blocks(MKDOCS)
    assert blocks == [
        ("Pro tip", False),
        ("Use the cache.", False),
        ("Second paragraph.", False),
        ("Warning: Plain warning.", False),
        ("Bash", False),
        ("Save the script:", False),
        ("echo hi", True),
        ("diagram End.", False),
    ]


def test_markdown_fences_that_look_like_blocks_are_left_alone():
    """A `!!! note` line inside fenced code is code; an unclosed MyST fence keeps its text."""
    _, blocks = _blocks("# T\n\n```text\n!!! note\n    not an admonition\n```\n")
    assert blocks == [("!!! note\n    not an admonition", True)]
    _, blocks = _blocks("# T\n\n```{note}\nNever closed.\n")
    assert blocks == [("Note: Never closed.", False)]


def test_mkdocs_tabs_nested_in_a_list_item_keep_their_code():
    text = (
        '# T\n\n1. Run the installer:\n\n    === "x64"\n        ```\n        run x64\n'
        '        ```\n    === "x86"\n        ```\n        run x86\n        ```\n2. Restart.\n'
    )
    _, blocks = _blocks(text)
    assert blocks == [
        ("- Run the installer:", False),
        ("x64", False),
        ("run x64", True),
        ("x86", False),
        ("run x86", True),
        ("- Restart.", False),
    ]
