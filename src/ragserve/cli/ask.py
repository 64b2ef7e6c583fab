"""``ragserve ask "question"``: one question through a workflow, answer and sources printed."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_INDEX = "factbook"


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"HF folder or built-in name ({DEFAULT_MODEL})"
    )
    p.add_argument("--index", default=DEFAULT_INDEX, help="index folder, or 'factbook' (built-in)")
    p.add_argument("--embedder", default=None, help="embedder (default: the index's own)")
    p.add_argument("--device", default="auto", help="LLM device: auto, cpu, cuda")
    p.add_argument(
        "--kv-cache-mb", type=int, default=None, help="LLM KV cache size (default: engine's)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="LLM context bound")
    p.add_argument("--in-process", action="store_true", help="no worker processes (debugging)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ask", help="answer one question with a RAG workflow")
    p.add_argument("question")
    p.add_argument("--workflow", default="oneshot", help="oneshot, hyde, multistep, irg, recomp")
    p.add_argument("--topk", type=int, default=None, help="passages per retrieval")
    p.add_argument("--max-tokens", type=int, default=None, help="answer length bound")
    p.add_argument("--json", action="store_true", help="print the response as JSON")
    add_server_args(p)
    p.set_defaults(func=handler)


def resolve_index(index: str) -> str:
    """A saved index folder; the built-in name ``factbook`` is built on first use."""
    if index == DEFAULT_INDEX:
        from ragserve.retrieval import builtin_index

        return str(builtin_index(index, progress=sys.stderr.isatty()))
    return index


def make_server(args: argparse.Namespace) -> Any:
    # NOTE: set before torch/Faiss load here (index build, in-process mode): OpenMP
    # spin-waiting on a busy machine makes small CPU matmuls many times slower.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from ragserve.runtime import Server, ServerConfig

    engine: dict[str, Any] = {"device": args.device}
    if args.kv_cache_mb is not None:
        engine["kv_cache_bytes"] = args.kv_cache_mb << 20
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    config = ServerConfig(in_process=args.in_process, engine_kwargs=engine)
    index = resolve_index(args.index)
    return Server(model=args.model, index=index, embedder=args.embedder, config=config)


def handler(args: argparse.Namespace) -> int:
    from ragserve.workflows import get_workflow

    knobs = {k: v for k, v in (("topk", args.topk), ("max_tokens", args.max_tokens)) if v}
    try:
        graph = get_workflow(args.workflow, **knobs)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    with make_server(args) as server:
        response = server.run(args.question, graph)
    if args.json:
        print(json.dumps(response_json(response), indent=2))
    else:
        print(response.output.strip() or "(empty answer)")
        for i, (doc_id, title) in enumerate(zip(response.doc_ids, response.titles, strict=True)):
            print(f"  [{i + 1}] {title or doc_id}")
        print(f"  {args.workflow}: {response.latency:.2f} s")
    if response.error is not None:
        print(f"error: {response.error}", file=sys.stderr)
        return 1
    return 0


def response_json(response: Any) -> dict:
    return {
        "request_id": response.request_id,
        "output": response.output,
        "doc_ids": list(response.doc_ids),
        "titles": list(response.titles),
        "timings": {str(k): round(v, 4) for k, v in response.timings.items()},
        "latency": round(response.latency, 4),
        "error": response.error,
    }
