"""The held-out retrieval sets of issue 14 (FAQ corpora with their question headings hidden,
the Python docs, the factbook) as passages + questions, for the `bench/retrieval_*.py` scripts."""

from __future__ import annotations

import dataclasses
import html
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from ragserve.retrieval.ingest import Chunker, ingest_folder
from window_chunks import chunk_documents, raw_folder

PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
PYDOCS_PARTS = ("faq", "tutorial")  # --parts adds more (howto, reference, using, library)


@dataclass(frozen=True)
class FaqCorpus:
    """A documentation folder whose `faq` part holds questions as section headings; `parts`
    are indexed (`faq` + the rest as distractors), files matching `pattern`."""

    source: Path
    parts: tuple[str, ...]
    pattern: str
    package: str  # the Debian package shipping it


FAQ_CORPORA = {
    "pydocs": FaqCorpus(PYDOCS, PYDOCS_PARTS, "*.rst.txt", "python3.11-doc"),
    # held out: never used while choosing defaults
    "sqlalchemy": FaqCorpus(
        Path("/usr/share/doc/python-sqlalchemy-doc/rst"),
        ("faq", "tutorial"),
        "*.rst",
        "python-sqlalchemy-doc",
    ),
    "django": FaqCorpus(
        Path("/usr/share/doc/python-django-doc/html"),
        ("faq", "intro"),
        "*.html",
        "python-django-doc",
    ),
    # session 7: two more held-out sets (a part may be one file: `faq` -> faq<suffix>)
    "celery": FaqCorpus(
        Path("/usr/share/doc/python-celery-doc/html/_sources"),
        ("faq", "getting-started"),
        "*.rst.txt",
        "python-celery-doc",
    ),
    "scrapy": FaqCorpus(
        Path("/usr/share/doc/python-scrapy-doc/html"),
        ("faq", "intro"),
        "*.html",
        "python-scrapy-doc",
    ),
    # session 8: two more (the FAQ page's name is matched without case: FAQ.html, FAQ.txt)
    "lxml": FaqCorpus(
        Path("/usr/share/doc/python-lxml-doc/html"),
        ("FAQ", "intro", "installation", "tutorial"),
        "*.html",
        "python-lxml-doc",
    ),
    "docutils": FaqCorpus(
        Path("/usr/share/doc/docutils-doc"),
        ("FAQ", "README", "docs/user/rst/quickstart", "docs/user/tools"),
        "*.txt",
        "docutils-doc",
    ),
}
# session 9: a Markdown (MyST) set, Black 24.10's docs from its PyPI sdist (no Debian package
# ships them): `pip download --no-deps --no-binary :all: black==24.10.0 -d D` and
# `tar xzf D/black-24.10.0.tar.gz -C ~/.cache/ragserve-bench` (`package` names the command).
BLACK_DOCS = Path.home() / ".cache" / "ragserve-bench" / "black-24.10.0" / "docs"
FAQ_CORPORA["black"] = FaqCorpus(
    BLACK_DOCS,
    ("faq", "getting_started", "usage_and_configuration", "the_black_code_style", "guides"),
    "*.md",
    "(PyPI sdist) black==24.10.0: see BLACK_DOCS",
)
# session 9: larger corpora (over the 1,000-passage bound of the sixth run's fine-tuning
# default): the same FAQ questions with more of each documentation set as distractors.
# pydocs-large keeps pydocs' tune/test halves; the others are held out like their small sets.
LARGE_PARTS = {
    "pydocs": ("faq", "tutorial", "howto", "using"),
    "scrapy": ("faq", "intro", "topics"),
    "sqlalchemy": ("faq", "tutorial", "orm"),
    "django": ("faq", "intro", "topics"),
}
FAQ_CORPORA.update(
    {
        f"{name}-large": dataclasses.replace(FAQ_CORPORA[name], parts=parts)
        for name, parts in LARGE_PARTS.items()
    }
)

# an rST heading: a text line followed by an underline of one repeated punctuation character
_HEADING = re.compile(r"^(?P<title>[^\n]+)\n(?P<line>([=\-~^\"'`#*+<>])\3{2,})[ \t]*$", re.M)
# an ATX Markdown heading
_MD_HEADING = re.compile(r"^(?P<hashes>#{1,6})[ \t]+(?P<title>[^\n]+?)[ \t#]*$", re.M)
# an HTML section heading (Sphinx adds a permalink anchor inside it)
_HTML_HEADING = re.compile(r"<(?P<tag>h[2-4])(?P<attrs>[^>]*)>(?P<inner>.*?)</(?P=tag)>", re.S)


@dataclass(frozen=True)
class Question:
    text: str
    relevant: frozenset[str]  # passage ids
    split: str  # "tune" or "test"


def split_of(text: str) -> str:
    return "tune" if zlib.crc32(text.encode()) % 2 == 0 else "test"


# -- pydocs ----------------------------------------------------------------------------------------


def prepare_faq(corpus: FaqCorpus, work: Path, parts=None) -> dict[str, tuple[str, str]]:
    """Copy the documentation parts into `work/docs`, FAQ question headings (those ending in
    "?") replaced by "FAQ entry <n>"; returns placeholder -> (file, question)."""
    if not corpus.source.is_dir():
        how = corpus.package if "sdist" in corpus.package else f"apt-get install {corpus.package}"
        raise SystemExit(f"{corpus.source} missing: {how}")
    out = work / "docs"
    hidden: dict[str, tuple[str, str]] = {}
    for part in parts or corpus.parts:
        folder = corpus.source / part
        if folder.is_dir():
            paths = sorted(folder.rglob(corpus.pattern))
        else:  # a single page: `faq` -> faq.html
            paths = sorted(corpus.source.glob(part + corpus.pattern.removeprefix("*")))
        for path in paths:
            rel = path.relative_to(corpus.source).as_posix().removesuffix(".txt")
            rel += "" if Path(rel).suffix else ".rst"  # docutils' own sources: rST in *.txt
            text = path.read_text(encoding="utf-8")
            if part.lower() == "faq":
                hide = {".html": _hide_html_questions, ".md": _hide_md_questions}
                text = hide.get(path.suffix, _hide_questions)(text, rel, hidden)
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8")
    return hidden


def _placeholder(rel: str, question: str, hidden: dict) -> str:
    name = f"FAQ entry {len(hidden) + 1}"  # unique (a hash collided: questions were lost)
    hidden[name] = (rel, question)
    return name


def _hide_questions(text: str, rel: str, hidden: dict) -> str:
    def swap(m: re.Match) -> str:
        title = m.group("title").strip()
        if not title.endswith("?"):
            return m.group(0)
        name = _placeholder(rel, title, hidden)
        return f"{name}\n{m.group('line')[0] * len(name)}"

    return _HEADING.sub(swap, text)


def _hide_md_questions(text: str, rel: str, hidden: dict) -> str:
    def swap(m: re.Match) -> str:
        title = m.group("title").strip()
        if not title.endswith("?"):
            return m.group(0)
        return f"{m.group('hashes')} {_placeholder(rel, title, hidden)}"

    return _MD_HEADING.sub(swap, text)


def _hide_html_questions(text: str, rel: str, hidden: dict) -> str:
    def swap(m: re.Match) -> str:
        inner = re.sub(r'<a class="headerlink".*?</a>', "", m.group("inner"), flags=re.S)
        title = " ".join(html.unescape(re.sub(r"<[^>]+>", "", inner)).split())
        if not title.endswith("?"):
            return m.group(0)
        name = _placeholder(rel, title, hidden)
        return f"<{m.group('tag')}{m.group('attrs')}>{name}</{m.group('tag')}>"

    return _HTML_HEADING.sub(swap, text)


def pydocs_new(work: Path, hidden: dict, chunker: Chunker):
    """Ingest + token chunking; a passage is relevant to a question when its section's last
    heading is the question's placeholder."""
    docs = list(chunker.chunk_all(ingest_folder(work / "docs", strict=True)))
    by_name: dict[str, set[str]] = {}
    for d in docs:
        last = d.metadata["section"].split(" > ")[-1]
        if last in hidden and hidden[last][0] == d.metadata["source"]:
            by_name.setdefault(last, set()).add(d.id)
    return docs, _questions(hidden, by_name)


def pydocs_legacy(work: Path, hidden: dict):
    """The previous default: raw files in 200-word windows overlapping by 40; a window is
    relevant when it overlaps the answer's span of the raw file."""
    docs = list(chunk_documents(raw_folder(work / "docs"), size=200, overlap=40))
    spans: dict[str, list[tuple[int, int, str]]] = {}
    texts = {}
    for rel in {f for f, _ in hidden.values()}:
        raw = (work / "docs" / rel).read_text(encoding="utf-8")
        texts[rel] = raw
        heads = [(m.start(), m.group("title").strip()) for m in _HEADING.finditer(raw)]
        for (start, title), nxt in zip(heads, [*heads[1:], (len(raw), "")], strict=True):
            if title in hidden:
                spans.setdefault(rel, []).append((start, nxt[0], title))
    by_name: dict[str, set[str]] = {}
    cursor: dict[str, int] = {}
    for d in docs:
        rel = d.metadata.get("path")
        if rel not in spans:
            continue
        a = texts[rel].find(d.text, cursor.get(rel, 0))
        cursor[rel] = a + 1
        b = a + len(d.text)
        for start, end, name in spans[rel]:
            if a < end and b > start:
                by_name.setdefault(name, set()).add(d.id)
    return docs, _questions(hidden, by_name)


def _questions(hidden: dict, by_name: dict) -> list[Question]:
    out = []
    for name, (_, question) in sorted(hidden.items()):
        if by_name.get(name):
            out.append(Question(question, frozenset(by_name[name]), split_of(question)))
    return out


# -- factbook --------------------------------------------------------------------------------------

FACTBOOK_FORMS = {
    "What is the capital of {}?": ("Government", "Overview"),
    "What languages are spoken in {}?": ("People and Society",),
    "What is the population of {}?": ("People and Society", "Overview"),
    "What is the climate of {}?": ("Geography",),
}


def factbook():
    from ragserve.retrieval.factbook import factbook_documents

    docs = list(factbook_documents())
    by_country: dict[str, dict[str, str]] = {}
    for d in docs:
        by_country.setdefault(d.metadata["country"], {})[d.metadata["section"]] = d.id
    questions = []
    for country, sections in sorted(by_country.items()):
        for form, wanted in FACTBOOK_FORMS.items():
            relevant = frozenset(sections[s] for s in wanted if s in sections)
            if relevant:
                text = form.format(country)
                questions.append(Question(text, relevant, split_of(text)))
    return docs, questions
