"""Corpus fine-tuning of a Hugging Face embedder on the corpus's own (first sentence → rest of
the passage) pairs with in-batch negatives (loss: cross-entropy of cosine / TEMPERATURE, pairs
of the same passage masked), saved as a model folder `load_embedder(path)` reads back.
Deterministic: seeded pair order and dropout; the caller's RNG state is restored."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import re
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from ragserve.retrieval.passages import passage_text

if TYPE_CHECKING:
    from ragserve.retrieval.embedder import Embedder
    from ragserve.retrieval.types import Document

logger = logging.getLogger(__name__)

# Measured in BENCHMARKS.md, "Retrieval quality (issue 14)" (the run named after each):
TEMPERATURE = 0.05
METADATA_KEY = "finetune_encoder"  # index metadata: the build's choice, why, and the folder
AUTO_MIN_PASSAGES = 100  # a folder build fine-tunes by default from this size on (sixth run)
AUTO_MAX_PAIRS = 1000  # ... on at most this many pairs, a seeded sample above (eighth run)
TUNED_ENSEMBLE_WEIGHT = 0.5  # e5's ensemble weight beside a fine-tuned encoder (sixth run)
TUNED_SIDE_ENCODER = "all-mpnet-base-v2"  # a tuned index's side encoder if installed (seventh)
TUNED_SIDE_WEIGHT = 1.0
SECONDS_PER_PAIR = 0.2  # training seconds per pair per epoch, 2-core CPU, fp32 (the estimate)


def estimate_seconds(num_pairs: int, config: FinetuneConfig) -> float:
    return num_pairs * config.epochs * SECONDS_PER_PAIR


def describe_estimate(num_pairs: int, config: FinetuneConfig) -> str:
    """One line shown before fine-tuning starts: what, about how long, how to skip it."""
    seconds = estimate_seconds(num_pairs, config)
    about = f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"
    return (
        f"fine-tuning the encoder on {num_pairs} pseudo-queries: about {about} on a 2-core CPU "
        "(--no-finetune / BuildConfig(finetune=False) skips it)"
    )


def side_weight(side: str, tuned: bool) -> float:
    """The ensemble weight of side encoder `side` beside the index's own (tuned or not)."""
    if not tuned:
        return 1.0
    return TUNED_SIDE_WEIGHT if side == TUNED_SIDE_ENCODER else TUNED_ENSEMBLE_WEIGHT


@dataclass(frozen=True)
class FinetuneConfig:
    """Defaults measured in the fifth run (B). `max_pairs`: train on at most this many pairs, a
    seeded sample of a larger corpus (None: all)."""

    epochs: int = 1
    lr: float = 2e-5
    batch_size: int = 16
    seed: int = 0
    max_pairs: int | None = None

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 2 or self.lr <= 0:
            raise ValueError("finetune epochs must be >= 1, batch_size >= 2 and lr > 0")
        if self.max_pairs is not None and self.max_pairs < 2:
            raise ValueError("finetune max_pairs must be >= 2 (or None: every pair)")


def finetune_embedder(
    embedder: Embedder,
    docs: Sequence[Document],
    config: FinetuneConfig,
    header: str = "path",
    *,
    progress: bool = False,
) -> tuple[Embedder, int]:
    """(a trained copy of `embedder`, the number of pairs); `embedder` is unchanged. The estimate
    is logged first; `progress` also prints it and a bar over the steps (stderr)."""
    import torch
    from tqdm import tqdm

    if not can_finetune(embedder):
        raise ValueError("finetuning needs a Hugging Face embedder without query prefixes")
    pairs = sample_pairs(pseudo_pairs(docs, header), config)
    if not pairs:
        raise ValueError("no pseudo-queries in the corpus (no passage has a first sentence)")
    tuned = copy.copy(embedder)
    tuned.model = _full_precision_copy(embedder).train()
    opt = torch.optim.AdamW(tuned.model.parameters(), lr=config.lr)
    order_rng = torch.Generator().manual_seed(config.seed)
    owners = torch.tensor([p.doc for p in pairs])
    estimate = describe_estimate(len(pairs), config)
    logger.info("%s", estimate)
    if progress:
        tqdm.write(estimate, file=sys.stderr)
    steps = config.epochs * -(-len(pairs) // config.batch_size)
    bar = tqdm(total=steps, desc="fine-tuning", unit="step", disable=not progress)
    with torch.random.fork_rng(devices=[]), bar:
        torch.manual_seed(config.seed)
        for _ in range(config.epochs):
            order = torch.randperm(len(pairs), generator=order_rng)
            for start in range(0, len(pairs), config.batch_size):
                idx = order[start : start + config.batch_size]
                if len(idx) >= 2:
                    q = tuned.pooled([pairs[i].query for i in idx])
                    p = tuned.pooled([pairs[i].held_out_text for i in idx])
                    loss = in_batch_loss(q @ p.T / TEMPERATURE, owners[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                bar.update(1)
    # NOTE: back to the base's dtype, which `load_embedder` gives the saved copy: the passages
    # embedded at build time and a reloaded index's queries see the same weights.
    tuned.model = tuned.model.to(embedder.model.dtype).eval()
    return tuned, len(pairs)


class PseudoPair(NamedTuple):
    """A pseudo-query, its passage's index in the docs, and the passage without it."""

    query: str
    doc: int
    held_out_text: str


_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def pseudo_pairs(docs: Sequence[Document], header: str = "path") -> list[PseudoPair]:
    """In `docs` order: a passage's first sentence when it has 4-40 words and more follows, and
    the passage text (with `header`) without it."""
    pairs: list[PseudoPair] = []
    for i, doc in enumerate(docs):
        parts = _SENTENCE_END.split(doc.text.strip(), maxsplit=1)
        if len(parts) == 2 and 4 <= len(parts[0].split()) <= 40:
            rest = dataclasses.replace(doc, text=parts[1])
            pairs.append(PseudoPair(parts[0], i, passage_text(rest, header)))
    return pairs


def in_batch_loss(logits, owners):
    """Cross-entropy of `logits[i, i]` against row i's other columns, those of the same owner
    (another pair of its passage) masked out. `logits` `[b, b]`, `owners` `[b]` (torch)."""
    import torch

    same = owners[:, None] == owners[None, :]
    logits = logits.masked_fill(same & ~torch.eye(len(owners), dtype=torch.bool), -1e9)
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(owners)))


def _full_precision_copy(embedder: Embedder):
    """An fp32 copy of the model to train; a reduced-precision one is loaded again in fp32 (from
    rounded weights it trained a worse encoder: BENCHMARKS.md, ninth run)."""
    import torch

    from ragserve.retrieval.embedder import load_embedder

    if embedder.model.dtype == torch.float32:
        return copy.deepcopy(embedder.model)
    return load_embedder(embedder.name, device=str(embedder.device), dtype="float32").model


def sample_pairs(pairs: list, config: FinetuneConfig) -> list:
    """`pairs`, or a seeded sample of `config.max_pairs` of them in corpus order."""
    import torch

    if config.max_pairs is None or len(pairs) <= config.max_pairs:
        return pairs
    rng = torch.Generator().manual_seed(config.seed + 1)  # not the training order's stream
    keep = torch.randperm(len(pairs), generator=rng)[: config.max_pairs].sort().values
    return [pairs[i] for i in keep.tolist()]


def can_finetune(embedder: Embedder) -> bool:
    """A Hugging Face embedder without query/passage prefixes."""
    return hasattr(embedder, "model") and not (embedder.passage_prefix or embedder.query_prefix)


def saved_encoder(directory: Path, metadata: dict) -> str | None:
    """The fine-tuned encoder folder inside the index folder `directory` (wherever it was moved),
    or None when the index records none or the folder has none."""
    name = (metadata.get(METADATA_KEY) or {}).get("dir")
    folder = Path(directory).absolute() / name if name else None
    return str(folder) if folder is not None and folder.is_dir() else None


def save_embedder(embedder: Embedder, directory: Path) -> Path:
    """Write `embedder` as a model folder (weights, tokenizer, window, pooling) that
    `load_embedder(str(directory))` loads back; returns the folder's absolute path."""
    directory = Path(directory).absolute()
    tmp = directory.with_name(f".{directory.name}-partial")  # not "*.tmp": compaction sweeps those
    shutil.rmtree(tmp, ignore_errors=True)
    embedder.model.save_pretrained(tmp)
    embedder.tokenizer.save_pretrained(tmp)
    (tmp / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": embedder.max_length})
    )
    (tmp / "1_Pooling").mkdir()
    cls = embedder.pooling == "cls"
    (tmp / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": cls, "pooling_mode_mean_tokens": not cls})
    )
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory
