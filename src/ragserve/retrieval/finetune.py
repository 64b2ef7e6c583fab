"""Corpus adaptation of the encoder itself: a Hugging Face embedder fine-tuned on the corpus's
own (first sentence -> rest of the passage) pairs (`pseudo_pairs`) with in-batch
negatives, then saved as a model folder that `load_embedder(path)` reads back.

```
loss  = CE( cos(E(query_i), E(target_j)) / TEMPERATURE over j in the batch, target i )
        pairs of the same passage in a batch are masked, not negatives
E     = the embedder's own pooling (mean or CLS) + L2 normalisation, fp32, dropout on
```

Deterministic for a given corpus, config and torch build: the pair order comes from a seeded
generator and dropout from a forked, seeded global RNG (the caller's RNG state is restored).
"""

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

TEMPERATURE = 0.05
METADATA_KEY = "finetune_encoder"  # index metadata: the build's choice, why, and the folder
# `index build` over a folder of documents fine-tunes by default from this size on (BENCHMARKS.md,
# "Retrieval quality (issue 14)", sixth run; below, no corpus was measured: the smallest held-out
# one had 102 passages) ...
AUTO_MIN_PASSAGES = 100
# ... on at most this many pairs (a seeded sample above it), so that the training time stays
# that of a 1,000-passage build whatever the corpus size (eighth run: adopted on four sets of
# 1,034-2,242 passages; a folder of at most 1,000 passages has at most 1,000 pairs: unchanged).
AUTO_MAX_PAIRS = 1000
# The ensemble's side-encoder weight for an index with a fine-tuned encoder (chosen on the pydocs
# tune half; raised held-out R@1 and MRR on five sets): the tuned encoder earns more of the say.
TUNED_ENSEMBLE_WEIGHT = 0.5
# The side encoder of a fine-tuned index when its packages are installed (`ragserve[mpnet]`),
# at full weight: adopted by a rule fixed before its figures on seven held-out sets (BENCHMARKS.md,
# "Retrieval quality (issue 14)", seventh run); e5 at TUNED_ENSEMBLE_WEIGHT otherwise.
TUNED_SIDE_ENCODER = "all-mpnet-base-v2"
TUNED_SIDE_WEIGHT = 1.0
# Training seconds per pair per epoch on a 2-core CPU in fp32: 0.15-0.20 on the seven held-out
# folders (BENCHMARKS.md, "Retrieval quality (issue 14)", fine-tuning's build time); the
# estimate shown before training starts.
SECONDS_PER_PAIR = 0.2


def estimate_seconds(num_pairs: int, config: FinetuneConfig) -> float:
    """The measured CPU estimate of training `num_pairs` pairs under `config`."""
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
    """Defaults: measured on the pydocs tune half (BENCHMARKS.md, "Retrieval quality (issue
    14)", fifth run, B)."""

    epochs: int = 1
    lr: float = 2e-5
    batch_size: int = 16
    seed: int = 0
    # Train on at most this many pairs, a seeded sample when the corpus has more (None: all):
    # bounds the training time of a large corpus; the passages are all embedded by the result.
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
    """A copy of `embedder` (a Hugging Face one) trained on `docs`' pseudo-pairs; `embedder`
    itself is unchanged. Returns (the copy, the number of pairs). The estimate
    (`describe_estimate`) is logged before training; `progress` also shows it as a progress
    bar over the training steps (stderr)."""
    import torch

    if not can_finetune(embedder):
        raise ValueError("finetuning needs a Hugging Face embedder without query prefixes")
    pairs = sample_pairs(pseudo_pairs(docs, header), config)
    if not pairs:
        raise ValueError("no pseudo-queries in the corpus (no passage has a first sentence)")
    tuned = copy.copy(embedder)
    tuned.model = _full_precision_copy(embedder).train()
    opt = torch.optim.AdamW(tuned.model.parameters(), lr=config.lr)
    order_rng = torch.Generator().manual_seed(config.seed)
    owners = torch.tensor([p.doc for p in pairs])  # pairs of one passage: masked, not negatives
    steps = config.epochs * -(-len(pairs) // config.batch_size)
    logger.info("%s", describe_estimate(len(pairs), config))
    bar = _progress_bar(steps, describe_estimate(len(pairs), config), progress)
    with torch.random.fork_rng(devices=[]), bar:
        torch.manual_seed(config.seed)
        for _ in range(config.epochs):
            for idx in _batches(len(pairs), config.batch_size, order_rng):
                if len(idx) >= 2:
                    q = _embed(tuned, [pairs[i].query for i in idx])
                    p = _embed(tuned, [pairs[i].held_out_text for i in idx])
                    loss = in_batch_loss(q @ p.T / TEMPERATURE, owners[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                bar.update(1)
    # NOTE: back to the base's dtype (fp16 on CUDA, or what the caller asked for), which is what
    # `load_embedder` gives the saved copy: the passages embedded at build time and the queries
    # of a reloaded index then see the same weights.
    tuned.model = tuned.model.to(embedder.model.dtype).eval()
    return tuned, len(pairs)


class PseudoPair(NamedTuple):
    """A pseudo-query, the passage it comes from (index into the docs) and the text to embed as
    its target, the passage with the query held out."""

    query: str
    doc: int
    held_out_text: str


_SENTENCE_END = re.compile(r"(?<=[.?!])\s+")


def pseudo_pairs(docs: Sequence[Document], header: str = "path") -> list[PseudoPair]:
    """Pairs drawn from the passages alone, deterministic, in `docs` order: a passage's first
    sentence when it has 4-40 words and more follows, held out as the passage (with `header`)
    without it."""
    pairs: list[PseudoPair] = []
    for i, doc in enumerate(docs):
        parts = _SENTENCE_END.split(doc.text.strip(), maxsplit=1)
        if len(parts) == 2 and 4 <= len(parts[0].split()) <= 40:
            rest = dataclasses.replace(doc, text=parts[1])
            pairs.append(PseudoPair(parts[0], i, passage_text(rest, header)))
    return pairs


def in_batch_loss(logits, owners):
    """Cross-entropy of each row's own column (``logits[i, i]``) against the batch's others;
    columns of the same owner as the row (another pair of its passage) are masked out, not
    negatives. ``logits`` ``[b, b]``, ``owners`` ``[b]`` (torch tensors)."""
    import torch

    same = owners[:, None] == owners[None, :]
    logits = logits.masked_fill(same & ~torch.eye(len(owners), dtype=torch.bool), -1e9)
    return torch.nn.functional.cross_entropy(logits, torch.arange(len(owners)))


def _progress_bar(steps: int, description: str, enabled: bool):
    """A tqdm bar over the training steps, drawn after `description` and before the first."""
    from tqdm import tqdm

    if enabled:
        tqdm.write(description, file=sys.stderr)
    return tqdm(total=steps, desc="fine-tuning", unit="step", disable=not enabled)


def _batches(num_pairs: int, batch_size: int, rng) -> list:
    """One epoch's batches (index tensors): a seeded permutation cut into `batch_size` runs."""
    import torch

    order = torch.randperm(num_pairs, generator=rng)
    return [order[s : s + batch_size] for s in range(0, num_pairs, batch_size)]


def _full_precision_copy(embedder: Embedder):
    """An fp32 copy of `embedder`'s model to train: its own weights when it runs in fp32, else
    the same model loaded again in fp32 (not the fp16/bf16 weights upcast: training from rounded
    weights gave a different encoder, 3 of 325 held-out answers fewer in the top 5;
    BENCHMARKS.md, "Retrieval quality (issue 14)", ninth run)."""
    import torch

    from ragserve.retrieval.embedder import load_embedder

    if embedder.model.dtype == torch.float32:
        return copy.deepcopy(embedder.model)
    full = load_embedder(embedder.name, device=str(embedder.device), dtype="float32")
    return full.model


def sample_pairs(pairs: list, config: FinetuneConfig) -> list:
    """`pairs` when they are at most `config.max_pairs`, else a sample of that many drawn by
    `config.seed` (kept in corpus order); deterministic for a given corpus and config."""
    import torch

    if config.max_pairs is None or len(pairs) <= config.max_pairs:
        return pairs
    rng = torch.Generator().manual_seed(config.seed + 1)  # not the training order's stream
    keep = torch.randperm(len(pairs), generator=rng)[: config.max_pairs].sort().values
    return [pairs[i] for i in keep.tolist()]


def can_finetune(embedder: Embedder) -> bool:
    """A Hugging Face embedder without query/passage prefixes (what `finetune_embedder` trains)."""
    return hasattr(embedder, "model") and not (embedder.passage_prefix or embedder.query_prefix)


def saved_encoder(directory: Path, metadata: dict) -> str | None:
    """The fine-tuned encoder kept inside the index folder `directory`, resolved against where
    the folder is now (a moved or copied index uses its own copy); None when the index has none
    or the folder holds none (an index saved elsewhere: the recorded path is used then)."""
    name = (metadata.get(METADATA_KEY) or {}).get("dir")
    folder = Path(directory).absolute() / name if name else None
    return str(folder) if folder is not None and folder.is_dir() else None


def _embed(embedder: Embedder, texts: list[str]):
    import torch

    enc = embedder.tokenizer(
        texts, padding=True, truncation=True, max_length=embedder.max_length, return_tensors="pt"
    ).to(embedder.device)
    hidden = embedder.model(**enc).last_hidden_state
    if embedder.pooling == "cls":
        pooled = hidden[:, 0]
    else:
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
    return torch.nn.functional.normalize(pooled, dim=-1)


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
