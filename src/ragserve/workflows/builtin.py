"""Builders of the built-in workflows (see the package docstring)."""

from __future__ import annotations

from ragserve.graph import END, START, CompiledGraph, RAGraph

# NOTE: prompts that hold passages are prefix-stable for the knowledge tree (issue 12): fixed
# instructions first, then the passages (each rendered from itself and its position only, in
# its own paragraph), then the question.
ANSWER = (
    "Use the passages to answer the question in one short sentence.\n\n{docs}\n\nQuestion: {input}"
)
# multistep's three prompts: the search query, the note from the passages, the answer
MULTISTEP_QUERY = (
    "Question: {input}\nNotes so far:\n{notes}\n\n"
    "Write one short search query for a fact still needed to answer the question."
)
MULTISTEP_NOTE = "Use the passages to answer briefly.\n\n{docs}\n\nQuestion: {subquestion}"
MULTISTEP_ANSWER = "Notes:\n{notes}\n\nUsing the notes, answer in one short sentence: {input}"
HYDE_PASSAGE = "Write a short encyclopedia passage that answers this question: {input}"
RECOMP_SUMMARY = (
    "Summarize the facts in the passages that help answer the question.\n\n{docs}"
    "\n\nQuestion: {input}"
)
RECOMP_ANSWER = "Facts: {summary}\n\nUsing the facts, answer in one short sentence: {input}"


def oneshot(*, topk: int = 3, nprobe: int | None = None, max_tokens: int = 64) -> CompiledGraph:
    """Retrieve with the question, then answer from the passages."""
    g = RAGraph("oneshot")
    g.add_retrieval(0, query="input", topk=topk, output="docs", nprobe=nprobe)
    g.add_generation(1, prompt=ANSWER, max_tokens=max_tokens)
    return g.add_edge(START, 0).add_edge(0, 1).add_edge(1, END).compile()


def hyde(
    *, topk: int = 3, nprobe: int | None = None, max_tokens: int = 64, hypo_tokens: int = 48
) -> CompiledGraph:
    """HyDE: write a hypothetical passage, retrieve with it, answer from what was found."""
    g = RAGraph("hyde")
    # the search passage follows the conversation
    g.add_generation(
        0, prompt=HYDE_PASSAGE, output="hypo", max_tokens=hypo_tokens, with_history=True
    )
    g.add_retrieval(1, query="hypo", topk=topk, output="docs", nprobe=nprobe)
    g.add_generation(2, prompt=ANSWER, max_tokens=max_tokens)
    return g.add_edge(START, 0).add_edge(0, 1).add_edge(1, 2).add_edge(2, END).compile()


def multistep(
    *,
    rounds: int = 2,
    topk: int = 2,
    nprobe: int | None = None,
    max_tokens: int = 64,
    step_tokens: int = 32,
) -> CompiledGraph:
    """Multistep: ``rounds`` times (sub-question → retrieve → note), then the final answer."""
    _check_rounds(rounds)
    g = RAGraph("multistep")
    g.add_generation(
        0,
        prompt=MULTISTEP_QUERY,
        output="subquestion",
        max_tokens=step_tokens,
        stop=("\n",),
        with_history=True,  # the search query follows the conversation
    )
    g.add_retrieval(1, query="subquestion", topk=topk, output="docs", nprobe=nprobe)
    g.add_generation(2, prompt=MULTISTEP_NOTE, output="notes", max_tokens=step_tokens, append=True)
    g.add_generation(3, prompt=MULTISTEP_ANSWER, max_tokens=max_tokens)
    g.add_edge(START, 0).add_edge(0, 1).add_edge(1, 2)
    g.add_edge(2, lambda s: 0 if s.visit_count(2) < rounds else 3, targets=(0, 3))
    return g.add_edge(3, END).compile()


def irg(
    *, rounds: int = 2, topk: int = 2, nprobe: int | None = None, max_tokens: int = 64
) -> CompiledGraph:
    """IRG (Iter-RetGen): retrieve, draft, retrieve with question + draft; ``rounds`` of each.
    Only the last round's generation is the answer node (what ``stream`` sees)."""
    _check_rounds(rounds)
    g = RAGraph("irg")
    g.add_retrieval(0, query="input", topk=topk, output="docs", nprobe=nprobe)
    g.add_generation(3, prompt=ANSWER, max_tokens=max_tokens)
    g.add_edge(START, 0).add_edge(3, END)
    if rounds == 1:
        return g.add_edge(0, 3).compile()
    # the draft is part of the next query: it follows the conversation, as the answer does
    g.add_generation(1, prompt=ANSWER, output="draft", max_tokens=max_tokens, with_history=True)
    g.add_retrieval(2, query="{input}\n{draft}", topk=topk, output="docs", nprobe=nprobe)
    g.add_edge(0, 1).add_edge(1, 2)
    g.add_edge(2, lambda s: 1 if s.visit_count(2) < rounds - 1 else 3, targets=(1, 3))
    return g.compile()


def recomp(
    *, topk: int = 4, nprobe: int | None = None, max_tokens: int = 64, summary_tokens: int = 64
) -> CompiledGraph:
    """RECOMP: retrieve, compress the passages into a summary, answer from the summary."""
    g = RAGraph("recomp")
    g.add_retrieval(0, query="input", topk=topk, output="docs", nprobe=nprobe)
    g.add_generation(1, prompt=RECOMP_SUMMARY, output="summary", max_tokens=summary_tokens)
    g.add_generation(2, prompt=RECOMP_ANSWER, max_tokens=max_tokens)
    return g.add_edge(START, 0).add_edge(0, 1).add_edge(1, 2).add_edge(2, END).compile()


def _check_rounds(rounds: int) -> None:
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an int >= 1, got {rounds!r}")
