"""HTML → sections: the main content, page chrome dropped, as Markdown (markdownify)."""

from __future__ import annotations

from ragserve.retrieval.ingest.markdown import parse_markdown
from ragserve.retrieval.ingest.sections import ParsedDocument

# page chrome: never part of a page's content
_DROP = ("script", "style", "noscript", "nav", "header", "footer", "aside", "form", "button",
         "iframe", "svg", "template")  # fmt: skip
# "toctree-wrapper": a Sphinx table of contents in the page body (links to other pages'
# headings), dropped as the rST parser drops `.. toctree::`
_DROP_CLASSES = ("headerlink", "sphinxsidebar", "related", "footer", "navigation", "toctree",
                 "toctree-wrapper", "breadcrumb", "sidebar", "skip-link", "mobile-nav",
                 "sidemenu", "menu", "banner")  # fmt: skip
# docutils' in-page table of contents (`.. contents::` as `<div class="contents topic">`: the
# page's own headings again, dropped as the rST parser drops the directive); a bare "contents"
# class is kept, since some generators (Doxygen) wrap the whole page body in one
_DROP_SELECTORS = ("div.contents.topic",)
_MAIN = ("main", "[role=main]", "article", "div.body", "div.document", "body")


def parse_html(text: str, doc_title: str | None = None) -> ParsedDocument:
    """Parse an HTML page; the `<title>` heads the heading path when the page has no `<h1>`."""
    from bs4 import BeautifulSoup
    from markdownify import markdownify

    soup = BeautifulSoup(text, "html.parser")
    page_title = soup.title.get_text(" ", strip=True) if soup.title else None
    for tag in soup.find_all(_DROP):
        tag.decompose()
    for selector in (*(f".{cls}" for cls in _DROP_CLASSES), *_DROP_SELECTORS):
        for tag in soup.select(selector):
            tag.decompose()
    main = next((m for sel in _MAIN if (m := soup.select_one(sel)) is not None), soup)
    markdown = markdownify(str(main), heading_style="ATX", code_language="", strip=["a", "img"])
    has_h1 = main.find("h1") is not None
    return parse_markdown(markdown, None if has_h1 else (page_title or doc_title))
