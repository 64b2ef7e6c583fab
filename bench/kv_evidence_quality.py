"""CacheWeaver's quality cost: answers with passages in relevance order vs in the order that
matches the cached prefix, SmolLM2 (real weights, CPU) on two real question sets.

Question sets (``--sets``):

- **factbook**: every factbook question ("What is the capital / are the languages / is the
  population / is the climate of <country>?", the set of ``retrieval_quality.py``), grouped by
  country in a seeded shuffle, so their retrieved passages overlap in different relevance
  orders, as a stream of related user questions does; passages from the built-in index.
- **pydocs**: the Python FAQ's own questions (CPython 3.11 documentation sources, Debian
  package ``python3.11-doc``; the question headings hidden from the corpus as in
  ``retrieval_quality.py``), in the FAQ's order, over an index of the FAQ and the tutorial.

Each question runs on one engine with the knowledge tree: CacheWeaver orders its top-k
passages given the cache the previous questions left, and that prompt is prefilled (as a server
with ordering on would run it; it then stays cached). Questions whose order changed are then
answered twice on an engine without a cache, in batches (greedy, ``--max-tokens``; the
built-in answer template and chat template): relevance order and CacheWeaver's order.
Agreement is exact equality of the two answers. A question whose order did not change has the
same prompt both ways, so its answer is the same (the cache is exact: ``tests/generation``);
``agreement_all`` counts it as agreeing, ``agreement_reordered`` leaves it out.

The run is bounded (``--time-limit`` seconds per set, shared 2-core machine): it stops at the
next batch once the time is spent, and the JSON (written after every batch) says how many
questions were measured out of how many.

    PYTHONPATH=src python bench/kv_evidence_quality.py --sets factbook,pydocs \
        --time-limit 1200 --out bench/results/kv_evidence_quality.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ragserve.generation import LLMEngine, SamplingParams  # noqa: E402
from ragserve.graph.template import Passage, Template  # noqa: E402
from ragserve.workflows.builtin import ANSWER  # noqa: E402
from retrieval_quality import FACTBOOK_FORMS, PYDOCS, prepare_pydocs  # noqa: E402

log = logging.getLogger("kv_evidence_quality")
MODEL = "smollm2-135m-instruct"


def factbook_set(seed: int) -> tuple[list[str], Callable]:
    """Every factbook question, country groups shuffled, and a search over the built-in index."""
    from ragserve.retrieval import VectorIndex
    from ragserve.retrieval.builtin import builtin_index
    from ragserve.retrieval.factbook import factbook_documents

    countries = sorted({d.metadata["country"] for d in factbook_documents()})
    rng = random.Random(seed)
    rng.shuffle(countries)
    questions = []
    for country in countries:
        forms = list(FACTBOOK_FORMS)
        rng.shuffle(forms)
        questions += [f.format(country) for f in forms]
    index = VectorIndex.load(builtin_index("factbook"))
    return questions, index.search_text


def pydocs_set(work: Path) -> tuple[list[str], Callable]:
    """The Python FAQ's questions in document order and a search over the FAQ + tutorial."""
    from ragserve.retrieval import VectorIndex, load_embedder
    from ragserve.retrieval.ingest import ChunkConfig, Chunker, ingest_folder

    hidden = prepare_pydocs(PYDOCS, work, ("faq", "tutorial"))
    embedder = load_embedder("all-minilm-l6-v2")
    chunker = Chunker(embedder.tokenizer, embedder.max_length, ChunkConfig(None, 32))
    docs = list(chunker.chunk_all(ingest_folder(work / "docs", strict=True)))
    index = VectorIndex.build(docs, embedder)
    return [question for _, question in hidden.values()], index.search_text


def run_set(name: str, questions, search, a, engine, plain, out: dict, save) -> None:
    template = Template.parse(ANSWER)
    prefill = SamplingParams(max_tokens=1)
    params = SamplingParams(max_tokens=a.max_tokens)
    rows: list[dict] = []
    result = out[name] = {"questions_total": len(questions), "rows": rows}
    deadline = time.monotonic() + a.time_limit
    for start in range(0, len(questions), a.batch):
        if time.monotonic() > deadline:
            log.info("%s: time limit reached after %d questions", name, len(rows))
            break
        chunk = questions[start : start + a.batch]
        pending = []
        for q, found in zip(chunk, search(chunk, a.topk), strict=True):
            passages = [Passage(str(d.id), d.text, d.title) for d in found]

            def render(order, q=q, passages=passages):
                text = template.render({"docs": [passages[i] for i in order], "input": q})
                return engine.apply_chat_template([{"role": "user", "content": text}])

            order = engine.order_passages(render, len(passages))
            engine.generate([render(order)], prefill)  # what a server would cache
            row = {"question": q, "order": order, "reordered": order != sorted(order)}
            rows.append(row)
            if row["reordered"]:
                pending.append((row, render(range(len(passages))), render(order)))
        if pending:
            prompts = [p for _, base, woven in pending for p in (base, woven)]
            answers = plain.generate(prompts, params)
            for i, (row, _, _) in enumerate(pending):
                base, woven = answers[2 * i].text, answers[2 * i + 1].text
                row |= {"agree": base == woven, "relevance_answer": base, "woven_answer": woven}
                log.info("%s: %s order=%s agree=%s", name, row["question"], row["order"],
                         row["agree"])  # fmt: skip
        result |= summarize(rows)
        save()


def summarize(rows: list[dict]) -> dict:
    reordered = [r for r in rows if r["reordered"]]
    agree = sum(r["agree"] for r in reordered)
    return {
        "questions": len(rows),
        "reordered": len(reordered),
        "reordered_agree": agree,
        "agreement_all": (len(rows) - len(reordered) + agree) / len(rows) if rows else None,
        "agreement_reordered": agree / len(reordered) if reordered else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--sets", default="factbook,pydocs")
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--batch", type=int, default=8, help="questions per batch of answers")
    p.add_argument("--time-limit", type=float, default=1200.0, help="seconds per set")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu-threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    kw = dict(device="cpu", cpu_threads=a.cpu_threads)
    engine = LLMEngine(MODEL, **kw)
    plain = LLMEngine(MODEL, enable_prefix_caching=False, **kw)
    out: dict = {"args": {k: str(v) for k, v in vars(a).items()}}

    def save() -> None:
        out["engine_stats"] = engine.stats()
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(out, indent=1) + "\n")

    for name in a.sets.split(","):
        if name == "factbook":
            run_set(name, *factbook_set(a.seed), a, engine, plain, out, save)
        elif name == "pydocs":
            work = Path(tempfile.mkdtemp(prefix="pydocs-"))
            try:
                run_set(name, *pydocs_set(work), a, engine, plain, out, save)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        else:
            raise SystemExit(f"--sets: unknown set {name!r}; use factbook, pydocs")
        engine.block_manager.reset_prefix_cache()  # each set starts from an empty cache
    print(json.dumps({k: {m: v for m, v in r.items() if m != "rows"} for k, r in out.items()
                      if k in ("factbook", "pydocs")}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
