"""CacheWeaver's quality cost: answers with passages in relevance order vs in the order that
matches the cached prefix, SmolLM2 on real questions over the factbook index.

Questions come in groups about one country (capital, languages, population, climate), so
their retrieved passages overlap in different relevance orders, as a stream of related user
questions does. The questions run one by one on one engine with the knowledge tree; each is
answered (greedy, the built-in answer template and chat template) in relevance order and in
CacheWeaver's order given the cache left by the previous questions (the prompt a server with
ordering on would run; it then stays cached). Agreement is exact equality of the answers.

    PYTHONPATH=src python bench/kv_evidence_quality.py --countries 10 --out quality.json
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

from ragserve.generation import LLMEngine, SamplingParams
from ragserve.graph.template import Passage, Template
from ragserve.workflows.builtin import ANSWER

FORMS = (
    "What is the capital of {}?",
    "What languages are spoken in {}?",
    "What is the population of {}?",
    "What is the climate of {}?",
)


def questions(num_countries: int, seed: int) -> list[str]:
    from ragserve.retrieval.factbook import factbook_documents

    titles = sorted({d.title for d in factbook_documents() if d.title})
    rng = random.Random(seed)
    out = []
    for country in rng.sample(titles, num_countries):
        forms = list(FORMS)
        rng.shuffle(forms)
        out += [f.format(country) for f in forms]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--countries", type=int, default=10)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    from ragserve.retrieval import VectorIndex
    from ragserve.retrieval.builtin import builtin_index

    index = VectorIndex.load(builtin_index("factbook"))
    engine = LLMEngine("smollm2-135m-instruct", device="cpu", cpu_threads=1)
    plain = LLMEngine(
        "smollm2-135m-instruct", device="cpu", cpu_threads=1, enable_prefix_caching=False
    )
    template = Template.parse(ANSWER)
    params = SamplingParams(max_tokens=a.max_tokens)
    qs = questions(a.countries, a.seed)
    hits = index.search_text(qs, a.topk)
    rows = []
    for q, found in zip(qs, hits, strict=True):
        passages = [Passage(str(d.id), d.text, d.title) for d in found]

        def render(order, q=q, passages=passages):
            text = template.render({"docs": [passages[i] for i in order], "input": q})
            return engine.apply_chat_template([{"role": "user", "content": text}])

        order = engine.order_passages(render, len(passages))
        relevance = range(len(passages))
        (base,) = plain.generate([render(relevance)], params)  # leaves no cache behind
        (woven,) = engine.generate([render(order)], params)
        rows.append(
            {
                "question": q,
                "order": order,
                "reordered": order != list(relevance),
                "agree": base.text == woven.text,
                "relevance_answer": base.text,
                "woven_answer": woven.text,
            }
        )
        logging.info("%s order=%s agree=%s", q, order, rows[-1]["agree"])
    reordered = [r for r in rows if r["reordered"]]
    summary = {
        "questions": len(rows),
        "reordered": len(reordered),
        "agreement": sum(r["agree"] for r in rows) / len(rows),
        "agreement_when_reordered": (
            sum(r["agree"] for r in reordered) / len(reordered) if reordered else None
        ),
        "stats": engine.stats(),
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        a.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
