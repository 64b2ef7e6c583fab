"""The server flags ``serve``, ``ask``, ``demo`` and ``profile-memory`` share (vLLM's names
where ``vllm serve`` has the flag; each defaults to ``None``, "not given", so only a typed
flag overrides ``--config``), and the checks run before a ``Server`` starts."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ragserve.cli.errors import UsageError

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_INDEX = "factbook"

# (flag, dest, type, help, check): a flag given sets ``dest`` (an ``EngineConfig`` field here);
# ``check`` (a key of ``CHECKS``) or ``None`` bounds its value.
Flags = tuple[tuple[str, str, Any, str, str | None], ...]
ENGINE_FLAGS: Flags = (
    ("--device", "device", str, "LLM device: auto, cpu, cuda, cuda:N", None),
    ("--dtype", "dtype", str, "auto, float32, bfloat16, float16", None),
    ("--max-model-len", "max_model_len", int, "LLM context bound", "> 0"),
    ("--max-num-seqs", "max_num_seqs", int, "sequences batched at once", "> 0"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "tokens per engine step", "> 0"),
    ("--block-size", "block_size", int, "KV cache block size, tokens", "> 0"),
    ("--gpu-memory-utilization", "kv_cache_memory_fraction", float,
     "CUDA: share of the free memory after the weights given to the KV cache (0-1]", "in (0, 1]"),
    ("--seed", "seed", int, "the engine's sampling seed", None),
    ("--load-format", "load_format", str, "auto (safetensors) or dummy (random weights)", None),
    ("--cpu-threads", "cpu_threads", int, "torch threads of the LLM (CPU)", "> 0"),
)  # fmt: skip
SIZE_FLAGS: Flags = (
    ("--kv-cache-gb", "kv_cache_gb", float, "KV cache size in GiB", "> 0"),
    ("--host-kv-cache-gb", "host_kv_cache_gb", float,
     "host tier of the knowledge tree's KV, GiB of pinned CPU memory (default 0: GPU only)",
     ">= 0"),
    ("--tensor-parallel-size -tp", "tensor_parallel_size", int, "1 only (--llm-replicas)", None),
    ("--pipeline-parallel-size -pp", "pipeline_parallel_size", int, "1 only (--llm-replicas)",
     None),
)  # fmt: skip
RUNTIME_FLAGS: Flags = (("--nprobe", "default_nprobe", int, "default clusters probed", "> 0"),)
CHECKS = {"> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0, "in (0, 1]": lambda v: 0 < v <= 1}
FLAG = {"action": "store_const", "const": True, "default": None}  # a switch, "not given" if off


def add_flags(group: Any, flags: Flags) -> None:
    """``(flag, dest, type, help, check)`` rows, each defaulting to ``None`` (not given)."""
    for flag, dest, kind, text, _ in flags:
        names = flag.split()  # the long flag, then its short form if any
        metavar = names[0][2:].upper().replace("-", "_")
        group.add_argument(*names, dest=dest, type=kind, default=None, metavar=metavar, help=text)


def given(args: argparse.Namespace, flags: Flags) -> dict:
    """The ``dest`` values of the rows of ``flags`` the user gave (checked: a bad value is a
    ``UsageError`` naming the flag)."""
    values = {}
    for flag, dest, _, _, check in flags:
        if (value := getattr(args, dest)) is not None:
            if check is not None and not CHECKS[check](value):
                raise UsageError(f"{flag.split()[0]} must be {check}, got {value}")
            values[dest] = value
    return values


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Model, index, engine and co-scheduling flags."""
    p.add_argument("--config", default=None, help="TOML or YAML file of these settings")
    p.add_argument("--model", default=None, help=f"HF folder or built-in name ({DEFAULT_MODEL})")
    p.add_argument("--index", default=None, help=f"index folder, or '{DEFAULT_INDEX}' (built-in)")
    p.add_argument("--embedder", default=None, help="embedder (default: the index's own)")
    cosched = "split, gen_chunks, similarity, speculation, spec_retrieval"
    p.add_argument(
        "--cosched",
        help=f"co-scheduling: auto (default: all, or off when the GPU tier holds the index), "
        f"all, off, or a list of {cosched}",
    )
    add_flags(p, RUNTIME_FLAGS)
    p.add_argument("--in-process", **FLAG, help="no worker processes (debugging)")
    g = p.add_argument_group("engine")
    add_flags(g, ENGINE_FLAGS + SIZE_FLAGS)
    prefix = "reuse the KV of shared prompt prefixes (default on)"
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, help=prefix)
    g.add_argument("--enforce-eager", **FLAG, help="no CUDA graphs")


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields the engine flags give (checked; a bad value is a
    ``UsageError`` naming the flag)."""
    sizes = given(args, SIZE_FLAGS)
    for flag in ("tensor_parallel_size", "pipeline_parallel_size"):
        if sizes.pop(flag, 1) != 1:
            raise UsageError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)}: ragserve runs each LLM "
                "replica on one device; scale out with --ray --llm-replicas N instead"
            )
    engine = given(args, ENGINE_FLAGS)
    for gb, value in sizes.items():  # kv_cache_gb -> kv_cache_bytes
        engine[gb.replace("_gb", "_bytes")] = int(value * (1 << 30))
    if args.enable_prefix_caching is not None:
        engine["enable_prefix_caching"] = args.enable_prefix_caching
    if args.enforce_eager:
        engine["enable_cuda_graphs"] = False
    return engine


def resolve_index(index: str) -> str:
    """A saved index folder; the built-in name ``factbook`` is built on first use."""
    if index == DEFAULT_INDEX and not Path(index).is_dir():
        from ragserve.retrieval import builtin_index

        return str(builtin_index(index, progress=sys.stderr.isatty()))
    return index


def check_index(index: str) -> None:
    """A clear error for a missing, empty or damaged index folder (before workers start)."""
    from ragserve.retrieval.storage import read_manifest

    path = Path(index)
    if not path.is_dir():
        raise UsageError(
            f"no index directory at {index} (build one with `ragserve index build`, "
            f"or use --index {DEFAULT_INDEX})"
        )
    if not (path / "manifest.json").is_file():
        raise UsageError(f"{index} is not a ragserve index (no manifest.json)")
    read_manifest(path)  # raises IndexCorruptError (a ValueError) naming the file


def check_model(model: str) -> None:
    """A clear error for an unknown model name or an unsupported architecture, in this
    process (before workers start). A built-in model is converted here on first use, with
    progress logged, rather than silently in the worker."""
    from ragserve.generation.builtin import BUILTIN_MODELS, resolve_model
    from ragserve.generation.config import ModelConfig

    if model in BUILTIN_MODELS:
        from ragserve.generation.builtin import ensure_builtin

        ensure_builtin(model)  # logs "converting built-in model ... (once)" on first use
        return
    folder = resolve_model(model)  # ModelLoadError: neither a folder nor a built-in name
    if Path(folder).is_dir() and not (Path(folder) / "config.json").is_file():
        raise UsageError(f"model folder {folder} has no config.json (not a Hugging Face model)")
    ModelConfig.from_folder(folder)  # ModelLoadError: unsupported architecture, bad config


def load_workflow(spec: str) -> tuple[str, Any]:
    """``module:function`` (optionally ``name=module:function``) -> ``(name, CompiledGraph)``;
    the function is called with no arguments and returns a ``RAGraph`` or ``CompiledGraph``;
    ``name`` defaults to the graph's own name."""
    from ragserve.graph import CompiledGraph, RAGraph

    name, _, target = spec.rpartition("=")
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"workflow {spec!r}: expected module:function")
    _import_from_cwd()
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"workflow {spec!r}: {exc}") from exc
    graph = fn() if callable(fn) and not isinstance(fn, (RAGraph, CompiledGraph)) else fn
    if isinstance(graph, RAGraph):
        graph = graph.compile()
    if not isinstance(graph, CompiledGraph):
        raise UsageError(
            f"workflow {spec!r} returned {type(graph).__name__}, not a RAGraph or CompiledGraph"
        )
    name = name or getattr(graph, "name", None) or attr
    return name, graph


def _import_from_cwd() -> None:
    """As ``python -m``: modules next to the caller import (spawned workers inherit it)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())


def check_reranker(name: str) -> None:
    """A clear error for a ``module:factory`` reranker that cannot be imported or is not
    callable, in this process (before workers start; the retrieval worker builds it)."""
    from ragserve.retrieval.rerank import EMBEDDING_RERANKER, RerankerLoadError, reranker_factory

    if name == EMBEDDING_RERANKER:
        return
    _import_from_cwd()
    try:
        reranker_factory(name)
    except RerankerLoadError as exc:
        raise UsageError(str(exc)) from None


def build_server(config: Any) -> Any:
    """The ``Server`` of a ``LaunchConfig`` (user workflows registered), checked first."""
    # NOTE: set before torch/Faiss load here (index build, in-process mode): OpenMP
    # spin-waiting on a busy machine makes small CPU matmuls many times slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    workflows = dict(load_workflow(spec) for spec in config.workflows)
    check_reranker(config.runtime.operators.reranker)
    index = resolve_index(config.index)
    check_index(index)
    check_model(config.model)
    from ragserve.runtime import Server

    logger.info(
        "starting the Server: model %s, index %s, co-scheduling: %s%s",
        config.model,
        index,
        ", ".join(config.runtime.cosched.enabled) or "off",
        " (auto)" if config.runtime.cosched.auto else "",
    )
    server = Server(config.model, index, embedder=config.embedder, config=config.runtime)
    server.workflows.update(workflows)
    return server
