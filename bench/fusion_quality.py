"""Cache fusion's quality cost: answers with fused passage KV vs full prefill, SmolLM2-135M-Instruct
(real weights, CPU, greedy) on real questions, per selector and recompute ratio.

Question sets:

- **factbook**: "What is the capital / languages / population / climate of <country>?" over
  the built-in factbook index (top-k passages, relevance order); a country's questions share
  passages in different orders, so stored passage KV is reused at other positions.
- **pydocs**: the CPython 3.11 FAQ's own questions (section headings of
  `/usr/share/doc/python3.11/html/_sources/faq`, Debian `python3.11-doc`), each with its
  answer section and two other FAQ answers as passages, in a seeded random order.

Each prompt is the answer template as segments inside the chat template: the instructions,
each passage (keyed by its id: "<title>: <text>", no position-dependent label), the question.
Per question: the full-prefill answer, then for each selector and ratio the fused answer.
Reported: exact answer agreement, token F1 between the two answers, and KL(full || fused) of
the first answer token's distribution; mean recomputed share of the passage tokens; the TTFT
ratio full / fused (geometric mean over questions, measured side by side in one process, the
passages already stored: on a shared CPU only the ratio means anything).

    PYTHONPATH=src python bench/fusion_quality.py --countries 6 --faq 16 \
        --out bench/results/fusion_quality.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
from collections import Counter
from pathlib import Path

import torch

from ragserve.generation import LLMEngine, SamplingParams, Segment

RATIOS = (0.0, 0.05, 0.10, 0.15, 0.30, 1.0)
SELECTORS = ("qcfuse", "cacheblend", "sift")
INSTRUCTIONS = "Use the passages to answer the question in one short sentence.\n\n"
FORMS = (
    "What is the capital of {}?",
    "What languages are spoken in {}?",
    "What is the population of {}?",
    "What is the climate of {}?",
)
FAQ_DIR = Path("/usr/share/doc/python3.11/html/_sources/faq")
_HEADING = re.compile(r"^([^\n]+\?)\n([=\-~^\"'`#*+])\2{2,}[ \t]*$", re.M)

Case = tuple[str, list[tuple[str, str]]]  # (question, [(passage key, passage text)])


def factbook_cases(num_countries: int, topk: int, seed: int) -> list[Case]:
    from ragserve.retrieval import VectorIndex
    from ragserve.retrieval.builtin import builtin_index
    from ragserve.retrieval.factbook import factbook_documents

    titles = sorted({d.title for d in factbook_documents() if d.title})
    rng = random.Random(seed)
    qs = [f.format(c) for c in rng.sample(titles, num_countries) for f in FORMS]
    index = VectorIndex.load(builtin_index("factbook"))
    hits = index.search_text(qs, topk)
    return [
        (q, [(f"fb-{d.id}", f"{d.title}: {d.text}") for d in found])
        for q, found in zip(qs, hits, strict=True)
    ]


def faq_cases(num: int, seed: int, max_words: int = 120) -> list[Case]:
    if not FAQ_DIR.is_dir():
        raise SystemExit(f"{FAQ_DIR} missing: apt-get install python3.11-doc (or --faq 0)")
    sections: list[tuple[str, str]] = []
    for path in sorted(FAQ_DIR.glob("*.rst.txt")):
        text = path.read_text(encoding="utf-8")
        heads = list(_HEADING.finditer(text))
        for h, nxt in zip(heads, [*heads[1:], None][: len(heads)], strict=True):
            body = text[h.end() : nxt.start() if nxt else len(text)]
            words = " ".join(body.split()).split(" ")[:max_words]
            if len(words) >= 20:
                sections.append((h.group(1).strip(), " ".join(words)))
    rng = random.Random(seed)
    picked = rng.sample(range(len(sections)), num)
    cases = []
    for i in picked:
        others = rng.sample([j for j in range(len(sections)) if j != i], 2)
        docs = [i, *others]
        rng.shuffle(docs)
        cases.append((sections[i][0], [(f"faq-{j}", f"FAQ: {sections[j][1]}") for j in docs]))
    return cases


def segments(engine: LLMEngine, case: Case) -> list[Segment]:
    question, passages = case
    marker = "\x00SPLIT\x00"
    chat = engine.apply_chat_template([{"role": "user", "content": marker}])
    before, after = chat.split(marker)
    segs = [Segment(before + INSTRUCTIONS)]
    segs += [Segment(text + "\n\n", key=key) for key, text in passages]
    return [*segs, Segment(f"Question: {question}" + after)]


def token_f1(a: str, b: str) -> float:
    ta, tb = a.lower().split(), b.lower().split()
    if not ta and not tb:
        return 1.0
    common = sum((Counter(ta) & Counter(tb)).values())
    if common == 0:
        return 0.0
    p, r = common / len(tb), common / len(ta)
    return 2 * p * r / (p + r)


def answer(engine: LLMEngine, segs, params, ratio) -> tuple[str, torch.Tensor, float]:
    """Greedy answer text, the first answer token's log-probabilities, and the TTFT (s)."""
    first: list[torch.Tensor] = []

    def hook(seqs, logits):
        if not first:
            first.append(torch.log_softmax(logits[0].float(), -1))

    engine.model_runner.logits_hook = hook
    engine.add_request("q", segs, params, fusion_ratio=ratio)
    text, ttft = "", 0.0
    while engine.has_unfinished():
        for out in engine.step():
            text = out.text
            ttft = out.metrics.ttft
    engine.model_runner.logits_hook = None
    return text.strip(), first[0], ttft


def run_set(
    name: str,
    cases: list[Case],
    full_engine: LLMEngine,
    engines: dict[str, LLMEngine],
    params,
    on_progress=None,
) -> dict:
    """``full_engine`` (no prefix caching) gives the reference answers and TTFTs;
    ``on_progress(partial result)`` after every question."""
    rows = {s: {r: [] for r in RATIOS} for s in engines}
    warm = SamplingParams(max_tokens=1)
    for n, case in enumerate(cases):
        segs = segments(full_engine, case)
        full_text, full_lp, full_ttft = answer(full_engine, segs, params, None)
        for sel, engine in engines.items():
            answer(engine, segs, warm, 0.0)  # the passages' KV stored before any timing
            for ratio in RATIOS:
                before = engine.stats()
                text, lp, ttft = answer(engine, segs, params, ratio)
                after = engine.stats()
                fused = after["num_fused_tokens"] - before["num_fused_tokens"]
                recomputed = after["num_recomputed_tokens"] - before["num_recomputed_tokens"]
                kl = float((full_lp.exp() * (full_lp - lp)).sum())
                rows[sel][ratio].append(
                    (
                        text == full_text,
                        token_f1(full_text, text),
                        kl,
                        recomputed / fused,
                        math.log(full_ttft / ttft),
                    )  # fmt: skip
                )
        logging.info("%s %d/%d: %r", name, n + 1, len(cases), full_text[:60])
        if on_progress is not None:
            on_progress({"num_questions": n + 1, "table": _table(rows)})
    return {"num_questions": len(cases), "table": _table(rows)}


def _table(rows: dict) -> dict:
    table = {}
    for sel in rows:
        for ratio in RATIOS:
            r = rows[sel][ratio]
            table[f"{sel}@{ratio:.2f}"] = {
                "agreement": sum(x[0] for x in r) / len(r),
                "token_f1": sum(x[1] for x in r) / len(r),
                "first_token_kl": sum(x[2] for x in r) / len(r),
                "recomputed_share": sum(x[3] for x in r) / len(r),
                "ttft_speedup": math.exp(sum(x[4] for x in r) / len(r)),
            }
    return table


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    p.add_argument("--countries", type=int, default=6)
    p.add_argument("--faq", type=int, default=16)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--selectors", default=",".join(SELECTORS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    model = "smollm2-135m-instruct"
    full_engine = LLMEngine(model, device="cpu", cpu_threads=1, enable_prefix_caching=False)
    engines = {
        s: LLMEngine(model, device="cpu", cpu_threads=1, fusion_selector=s)
        for s in a.selectors.split(",")
    }
    params = SamplingParams(max_tokens=a.max_tokens)
    sets = {}
    if a.countries:
        sets["factbook"] = factbook_cases(a.countries, a.topk, a.seed)
    if a.faq:
        sets["pydocs"] = faq_cases(a.faq, a.seed)
    result = {"args": vars(a) | {"out": str(a.out)}}
    for name, cases in sets.items():

        def progress(partial, name=name):
            result[name] = partial
            _write(result, a.out)

        result[name] = run_set(name, cases, full_engine, engines, params, progress)
        print(f"\n{name} ({len(cases)} questions)")
        print("| selector | r | agreement | token F1 | first-token KL | recomputed | TTFT x |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for key, m in result[name]["table"].items():
            sel, ratio = key.split("@")
            print(
                f"| {sel} | {float(ratio):.0%} | {m['agreement']:.1%} | {m['token_f1']:.3f} | "
                f"{m['first_token_kl']:.4f} | {m['recomputed_share']:.1%} | "
                f"{m['ttft_speedup']:.2f} |"
            )
    _write(result, a.out)


def _write(result: dict, out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
