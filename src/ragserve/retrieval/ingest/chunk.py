"""Sections → passages that fit the embedder's window in its own tokens: blocks packed whole,
a long block cut into sentences (code: lines), a long sentence into token windows; a passage
starts with the last sentences of the one before (`overlap_tokens`).

```
window 256 = [CLS] + "Tutorial > Sets:" (6) + text budget (248) + [SEP]
section:  | para 1 (90) | para 2 (120) | para 3 (300 → s1 s2 s3 s4) |
passages: [para 1, para 2]  [tail of para 2 ≤ overlap, s1, s2]  [s2 tail, s3, s4]
```
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ragserve.retrieval.ingest.sections import PARAGRAPH_BREAK, Block, ParsedDocument
from ragserve.retrieval.passages import passage_text
from ragserve.retrieval.types import Document

logger = logging.getLogger(__name__)

_SENTENCE = re.compile(r"(?<=[.!?:;])\s+(?=\S)")
MIN_TEXT_TOKENS = 32  # a heading path longer than window - this is shortened to its last part


@dataclass(frozen=True)
class ChunkConfig:
    """`max_tokens`: text tokens per passage (None: what the window leaves after the heading
    path); `overlap_tokens`: tokens repeated from the previous passage of a section."""

    max_tokens: int | None = None
    overlap_tokens: int = 32

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < MIN_TEXT_TOKENS:
            raise ValueError(f"max_tokens must be >= {MIN_TEXT_TOKENS} or None")
        if self.overlap_tokens < 0:
            raise ValueError(f"overlap_tokens must be >= 0, got {self.overlap_tokens}")
        if self.max_tokens is not None and self.overlap_tokens >= self.max_tokens // 2:
            raise ValueError("overlap_tokens must be below half of max_tokens")


@dataclass
class ChunkStats:
    """Counts over a chunking run; `num_truncated` passages lost text to fit the window."""

    num_passages: int = 0
    num_truncated: int = 0
    num_titles_shortened: int = 0
    max_passage_tokens: int = 0


@dataclass(frozen=True)
class _Unit:
    text: str
    num_tokens: int
    sep: str  # joins it to the unit before it in a passage


class Chunker:
    """Cuts `ParsedDocument`s into `Document` passages for an embedder (`tokenizer`, `window`:
    its maximum sequence length in tokens, special tokens included)."""

    def __init__(self, tokenizer: Any, window: int, config: ChunkConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.window = window
        self.config = config or ChunkConfig()
        self.num_special = int(tokenizer.num_special_tokens_to_add(False))
        if window - self.num_special < MIN_TEXT_TOKENS:
            raise ValueError(f"window {window} leaves fewer than {MIN_TEXT_TOKENS} text tokens")
        self.stats = ChunkStats()

    def chunk_all(self, docs: Iterable[tuple[str, ParsedDocument]]) -> Iterator[Document]:
        """Passages of every `(source path, document)`; warns once if any text was truncated."""
        for source, doc in docs:
            yield from self.chunk(source, doc)
        if self.stats.num_truncated or self.stats.num_titles_shortened:
            logger.warning(
                "chunking: %d of %d passages truncated to the %d-token window, %d heading "
                "paths shortened",
                self.stats.num_truncated,
                self.stats.num_passages,
                self.window,
                self.stats.num_titles_shortened,
            )

    def chunk(self, source: str, doc: ParsedDocument) -> Iterator[Document]:
        """Passages `<source>#<n>` with metadata `source`, `section`, `chunk` (+ front matter)."""
        n = 0
        for section in doc.sections:
            title = section.title or source
            budget, title = self._budget(title, section.path)
            for text in self._pack(section.blocks, budget):
                text = self._fit(title, text)
                meta = {**doc.metadata, "source": source, "section": title, "chunk": n}
                yield Document(f"{source}#{n}", text, title, meta)
                self.stats.num_passages += 1
                n += 1

    def chunk_document(self, doc: Document) -> Iterator[Document]:
        """A record's passages (paragraphs under its title): one keeps `doc.id`, several get
        `<id>#<n>` and `source_id`/`chunk` metadata."""
        paragraphs = tuple(Block(p) for p in PARAGRAPH_BREAK.split(doc.text) if p.strip())
        title = doc.title or ""
        budget, title = self._budget(title, (title,) if title else ())
        texts = [self._fit(title, t) for t in self._pack(paragraphs, budget)] or [doc.text]
        self.stats.num_passages += len(texts)
        if len(texts) == 1:
            yield Document(doc.id, texts[0], doc.title, doc.metadata)
            return
        for i, text in enumerate(texts):
            meta = {**doc.metadata, "source_id": doc.id, "chunk": i}
            yield Document(f"{doc.id}#{i}", text, doc.title, meta)

    def count(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        ids = self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [len(x) for x in ids]

    def passage_tokens(self, title: str, text: str) -> int:
        """Tokens the embedder sees for a passage (as `VectorIndex` embeds it)."""
        return self.count([passage_text(Document("", text, title))])[0] + self.num_special

    def _budget(self, title: str, path: tuple[str, ...]) -> tuple[int, str]:
        room = self.window - self.num_special
        budget = room - self.count([f"{title}:"])[0]
        if budget < MIN_TEXT_TOKENS and path:
            self.stats.num_titles_shortened += 1
            title = path[-1]
            budget = room - self.count([f"{title}:"])[0]
        if budget < MIN_TEXT_TOKENS:
            self.stats.num_titles_shortened += 1
            title, budget = "", room
        if self.config.max_tokens is not None:
            budget = min(budget, self.config.max_tokens)
        return budget, title

    def _pack(self, blocks: tuple[Block, ...], budget: int) -> Iterator[str]:
        units: list[_Unit] = []
        for block, num in zip(blocks, self.count([b.text for b in blocks]), strict=True):
            if num <= budget:
                units.append(_Unit(block.text, num, "\n\n"))
            else:
                units.extend(self._split(block, budget))
        current: list[_Unit] = []
        used = 0
        for unit in units:
            if current and used + unit.num_tokens > budget:
                yield _join(current)
                current = self._overlap(current, budget - unit.num_tokens)
                used = sum(u.num_tokens for u in current)
            current.append(unit if current else _Unit(unit.text, unit.num_tokens, ""))
            used += unit.num_tokens
        if current:
            yield _join(current)

    def _split(self, block: Block, budget: int) -> list[_Unit]:
        """Sentences (code: lines) of a long block, each cut into token windows if needed."""
        parts = block.text.split("\n") if block.is_code else _SENTENCE.split(block.text)
        parts = [p for p in parts if p.strip()]
        sep = "\n" if block.is_code else " "
        out = []
        for i, (part, num) in enumerate(zip(parts, self.count(parts), strict=True)):
            pieces = [(part, num)] if num <= budget else self._token_windows(part, budget)
            for j, (text, n) in enumerate(pieces):
                out.append(_Unit(text, n, "\n\n" if i == j == 0 else sep))
        return out

    def _token_windows(self, text: str, budget: int) -> list[tuple[str, int]]:
        enc = self.tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
        spans = [s for s in enc["offset_mapping"] if s[1] > s[0]]
        out, a = [], 0
        while a < len(spans):
            b = min(a + budget, len(spans))
            while a + 1 < b < len(spans) and spans[b][0] == spans[b - 1][1]:
                b -= 1  # never cut inside a word (its word pieces touch)
            if b == a + 1 and a + budget < len(spans):
                b = a + budget  # one word longer than the budget: cut it after all
            out.append((text[spans[a][0] : spans[b - 1][1]], b - a))
            a = b
        return out

    def _overlap(self, previous: list[_Unit], room: int) -> list[_Unit]:
        """The last sentences of `previous` within `overlap_tokens` (and `room`)."""
        limit = min(self.config.overlap_tokens, room)
        if limit <= 0:
            return []
        sentences = [s for s in _SENTENCE.split(previous[-1].text) if s.strip()]
        counts = self.count(sentences)
        seed: list[_Unit] = []
        used = 0
        for sentence, n in zip(reversed(sentences), reversed(counts), strict=True):
            if used + n > limit:
                break
            seed.insert(0, _Unit(sentence, n, " "))
            used += n
        if len(seed) == len(sentences) and len(previous) == 1:
            return []  # the whole previous passage: no progress
        return seed

    def _fit(self, title: str, text: str) -> str:
        """The passage cut to the window if over (a join may add a token to the counts)."""
        num = self.passage_tokens(title, text)
        self.stats.max_passage_tokens = max(self.stats.max_passage_tokens, min(num, self.window))
        while num > self.window:
            self.stats.num_truncated += 1
            keep = self.count([text])[0] - (num - self.window)
            text = self._token_windows(text, max(1, keep))[0][0]
            num = self.passage_tokens(title, text)
        return text


def _join(units: list[_Unit]) -> str:
    return "".join(u.sep + u.text if i else u.text for i, u in enumerate(units))
