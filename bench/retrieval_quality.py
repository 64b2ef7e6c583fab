"""Retrieval quality on real question sets: recall@1/5/10 and MRR@10 per mode and setting.

Corpora and questions:

- **pydocs**: the CPython 3.11 documentation sources (Debian package `python3.11-doc`,
  `/usr/share/doc/python3.11/html/_sources`: the FAQ and the tutorial; `--parts` adds more)
  and the FAQ's own questions, written by the documentation's authors. Each FAQ question is a
  section heading whose body answers it; the heading is replaced by a neutral "FAQ entry <n>"
  before ingest so that the question text is not in the corpus (a passage is relevant when it
  comes from the answer's section).
- **factbook**: the built-in CIA World Factbook passages and the factbook questions ("What is
  the capital / are the languages / is the population / is the climate of <country>?"); the
  relevant passages are the country's section holding the answer (and its overview, which
  repeats the capital and population).

Questions are split in two halves by a hash of their text: defaults are picked on `tune`,
figures are reported on `test`. Settings: chunking (the previous default of 200-word windows over
raw files vs ingest + token-sized chunks), nprobe (the index default vs the previous nlist/4),
and search mode (dense, bm25, hybrid).

    apt-get install python3.11-doc   # once: the documentation sources
    .venv/bin/python bench/retrieval_quality.py [--corpora pydocs,factbook] \
        [--out bench/results/retrieval_quality.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from ragserve.retrieval import VectorIndex, chunk_documents, load_corpus, load_embedder
from ragserve.retrieval.ingest import ChunkConfig, Chunker, ingest_folder

PYDOCS = Path("/usr/share/doc/python3.11/html/_sources")
PYDOCS_PARTS = ("faq", "tutorial")  # --parts adds more (howto, reference, using, library)
MODES = ("dense", "bm25", "hybrid")
K = 10
# an rST heading: a text line followed by an underline of one repeated punctuation character
_HEADING = re.compile(r"^(?P<title>[^\n]+)\n(?P<line>([=\-~^\"'`#*+<>])\3{2,})[ \t]*$", re.M)


@dataclass(frozen=True)
class Question:
    text: str
    relevant: frozenset[str]  # passage ids
    split: str  # "tune" or "test"


def split_of(text: str) -> str:
    return "tune" if zlib.crc32(text.encode()) % 2 == 0 else "test"


# -- pydocs ----------------------------------------------------------------------------------------


def prepare_pydocs(source: Path, work: Path, parts=PYDOCS_PARTS) -> dict[str, tuple[str, str]]:
    """Copy the documentation parts into `work/docs` as `.rst`, FAQ question headings replaced by
    "FAQ entry <n>"; returns placeholder -> (file, question)."""
    if not source.is_dir():
        raise SystemExit(f"{source} missing: apt-get install python3.11-doc")
    out = work / "docs"
    hidden: dict[str, tuple[str, str]] = {}
    for part in parts:
        for path in sorted((source / part).rglob("*.rst.txt")):
            rel = path.relative_to(source).as_posix()[: -len(".txt")]
            text = path.read_text(encoding="utf-8")
            if part == "faq":
                text = _hide_questions(text, rel, hidden)
            dest = out / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8")
    return hidden


def _hide_questions(text: str, rel: str, hidden: dict) -> str:
    def swap(m: re.Match) -> str:
        title = m.group("title").strip()
        if not title.endswith("?"):
            return m.group(0)
        name = f"FAQ entry {zlib.crc32(f'{rel}:{title}'.encode()) % 100000}"
        hidden[name] = (rel, title)
        return f"{name}\n{m.group('line')[0] * len(name)}"

    return _HEADING.sub(swap, text)


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
    docs = list(chunk_documents(load_corpus(work / "docs"), size=200, overlap=40))
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


# -- evaluation ------------------------------------------------------------------------------------


def evaluate(index: VectorIndex, questions: list[Question], mode: str, nprobe: int | None):
    """recall@1/5/10 and MRR@10 per split."""
    hits = index.search_text([q.text for q in questions], K, nprobe=nprobe, mode=mode)
    out = {}
    for split in ("tune", "test"):
        ranks = []
        for q, found in zip(questions, hits, strict=True):
            if q.split == split:
                rank = next((r for r, h in enumerate(found, 1) if h.id in q.relevant), None)
                ranks.append(rank)
        n = max(1, len(ranks))
        out[split] = {
            "num_questions": len(ranks),
            **{
                f"recall@{k}": round(sum(r is not None and r <= k for r in ranks) / n, 4)
                for k in (1, 5, 10)
            },  # fmt: skip
            "mrr@10": round(sum(1 / r for r in ranks if r is not None) / n, 4),
        }
    return out


def run_setting(name: str, docs, questions, embedder, rows: list, **info) -> None:
    t0 = time.perf_counter()
    index = VectorIndex.build(docs, embedder)
    build_s = time.perf_counter() - t0
    index.bm25()
    nprobes = {"default": None, "nlist/4 (previous default)": max(1, index.nlist // 4)}
    for nprobe_name, nprobe in nprobes.items():
        for mode in MODES:
            if mode == "bm25" and nprobe is not None:
                continue  # no probes in BM25
            result = evaluate(index, questions, mode, nprobe)
            row = {
                "corpus_setting": name,
                "num_passages": index.num_documents,
                "nlist": index.nlist,
                "nprobe": nprobe or index.spec.nprobe,
                "nprobe_setting": nprobe_name,
                "mode": mode,
                "build_seconds": round(build_s, 1),
                **info,
                **result,
            }
            rows.append(row)
            t = row["test"]
            logging.info(
                "%-34s %-26s %-6s test R@1 %.3f R@5 %.3f R@10 %.3f MRR %.3f | tune R@5 %.3f",
                name, nprobe_name, mode, t["recall@1"], t["recall@5"], t["recall@10"],
                t["mrr@10"], row["tune"]["recall@5"],
            )  # fmt: skip
    index.close()


def table(path: Path) -> str:
    """The results file as a Markdown table (test split; tune R@5 alongside)."""
    rows = json.loads(path.read_text())["rows"]
    out = [
        "| corpus / chunking | passages | nprobe | mode | R@1 | R@5 | R@10 | MRR@10 | tune R@5 |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        t = r["test"]
        probe = f"{r['nprobe']}/{r['nlist']}" + (
            " (old)" if "previous" in r["nprobe_setting"] else ""
        )
        if r["mode"] == "bm25":
            probe = "-"
        out.append(
            f"| {r['corpus_setting']} | {r['num_passages']} | {probe} | {r['mode']} | "
            f"{t['recall@1']:.3f} | {t['recall@5']:.3f} | {t['recall@10']:.3f} | "
            f"{t['mrr@10']:.3f} | {r['tune']['recall@5']:.3f} |"
        )
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpora", default="pydocs,factbook")
    p.add_argument("--pydocs", type=Path, default=PYDOCS)
    p.add_argument(
        "--chunk-settings",
        default="none/32,none/0,128/16",
        help="max_tokens/overlap pairs for the token chunker (none = the embedder's window)",
    )
    p.add_argument("--parts", default=",".join(PYDOCS_PARTS), help="pydocs folders to index")
    p.add_argument("--out", type=Path, default=Path("bench/results/retrieval_quality.json"))
    p.add_argument("--table", action="store_true", help="print --out as a Markdown table, exit")
    args = p.parse_args()
    if args.table:
        print(table(args.out))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    embedder = load_embedder("all-minilm-l6-v2")
    rows: list[dict] = []

    def save() -> None:  # after every setting: a partial run keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"embedder": embedder.name, "pydocs_parts": args.parts.split(",")}
        args.out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")

    corpora = args.corpora.split(",")
    if "pydocs" in corpora:
        work = Path(tempfile.mkdtemp(prefix="pydocs-"))
        try:
            hidden = prepare_pydocs(args.pydocs, work, args.parts.split(","))
            for setting in args.chunk_settings.split(","):
                size, overlap = setting.split("/")
                config = ChunkConfig(None if size == "none" else int(size), int(overlap))
                chunker = Chunker(embedder.tokenizer, embedder.max_length, config)
                docs, questions = pydocs_new(work, hidden, chunker)
                run_setting(f"pydocs ingest tokens {size}/{overlap}", docs, questions, embedder,
                            rows, chunking=f"ingest, max_tokens {size}, overlap {overlap}",
                            max_passage_tokens=chunker.stats.max_passage_tokens,
                            num_truncated=chunker.stats.num_truncated)  # fmt: skip
                save()
            docs, questions = pydocs_legacy(work, hidden)
            run_setting("pydocs legacy 200 words/40", docs, questions, embedder, rows,
                        chunking="words 200/40 over raw files")  # fmt: skip
            save()
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if "factbook" in corpora:
        docs, questions = factbook()
        run_setting("factbook", docs, questions, embedder, rows, chunking="factbook passages")
        save()
    logging.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
