"""The KV-reuse bench's workload (as RAGCache): a corpus of ``--docs`` passages of
``--passage-tokens`` tokens with Zipf popularity (``--zipf``); each request retrieves ``--topk``
distinct passages in relevance order under a fixed 48-token instruction prefix, then a question
of ``--question-tokens`` new tokens. With ``--topics N`` requests ask about N topics (Zipf over
topics), each topic a fixed relevance list drawn as above, as repeated popular questions do
(high reuse); with 0 every request draws its own list. The **working set** (distinct KV tokens
of all topics' passage prefixes, whole blocks) is what the KV tiers compete for.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from ragserve.generation.block_manager import hash_block_tokens

INSTRUCTION_TOKENS = 48
BLOCK_SIZE = 16  # the engine's default block size (working-set arithmetic)


@dataclass(frozen=True)
class Corpus:
    """Passages, the instruction prefix and the topics' relevance lists (seeded)."""

    docs: list[list[int]]
    instruction: list[int]
    topics: list[list[int]]
    doc_popularity: np.ndarray
    topic_popularity: np.ndarray | None

    def request(self, rng: np.random.Generator, a: argparse.Namespace):
        """(prompt ids, segment ends) of one request drawn with ``rng``."""
        if self.topics:
            chosen = self.topics[rng.choice(len(self.topics), p=self.topic_popularity)]
        else:
            chosen = _draw_list(rng, a, self.doc_popularity)
        ids, ends = list(self.instruction), [len(self.instruction)]
        for d in chosen:
            ids += self.docs[d]
            ends.append(len(ids))
        ids += _tokens(rng, a.question_tokens)
        ends.append(len(ids))
        return ids, tuple(ends)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(1000, 30000, n).tolist()  # ordinary tokens of both tokenizers' ranges


def _draw_list(rng: np.random.Generator, a: argparse.Namespace, p: np.ndarray) -> list[int]:
    return [int(d) for d in rng.choice(a.docs, size=a.topk, replace=False, p=p)]


def make_corpus(a: argparse.Namespace) -> Corpus:
    rng = np.random.default_rng(a.seed)
    docs = [_tokens(rng, a.passage_tokens) for _ in range(a.docs)]
    instruction = _tokens(rng, INSTRUCTION_TOKENS)
    popularity = _zipf(a.docs, a.zipf)
    topics = [_draw_list(rng, a, popularity) for _ in range(a.topics)]
    topic_popularity = _zipf(a.topics, a.zipf) if a.topics else None
    return Corpus(docs, instruction, topics, popularity, topic_popularity)


def make_workload(
    a: argparse.Namespace, second: bool = False
) -> list[tuple[list[int], tuple[int, ...], float]]:
    """The replay: (prompt ids, segment ends, arrival offset at 1 req/s) per request; seeded.
    ``second``: another draw of the same distribution (the warm replay)."""
    corpus = make_corpus(a)
    rng = np.random.default_rng(a.seed + (2 if second else 1))
    arrivals = np.cumsum(rng.exponential(1.0, a.num_requests))
    return [(*corpus.request(rng, a), float(t - arrivals[0])) for t in arrivals]


def working_set_tokens(a: argparse.Namespace, workload) -> int:
    """Distinct KV tokens (whole blocks) of the passage prefixes the workload can ask for:
    every topic's (or, without topics, the replay's) prompt up to its question."""
    if a.topics:
        corpus = make_corpus(a)
        prefixes = [_prefix(corpus, t) for t in corpus.topics]
    else:
        prefixes = [ids[: ends[-2]] for ids, ends, _ in workload]
    seen: set[int] = set()
    for ids in prefixes:
        parent = None
        for i in range(len(ids) // BLOCK_SIZE):
            parent = hash_block_tokens(parent, ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            seen.add(parent)
    return len(seen) * BLOCK_SIZE


def _prefix(corpus: Corpus, topic: list[int]) -> list[int]:
    ids = list(corpus.instruction)
    for d in topic:
        ids += corpus.docs[d]
    return ids


def _zipf(n: int, s: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return p / p.sum()
