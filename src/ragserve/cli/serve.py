"""``ragserve serve``: the OpenAI-compatible HTTP front over a Server (model + index)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

API_KEY_ENV = "RAGSERVE_API_KEY"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions (RAG workflows), /v1/completions (plain LLM), "
        "/v1/models, /v1/documents, /metrics and /health.",
    )
    p.add_argument("--model", required=True, help="HF model folder or built-in name")
    p.add_argument("--index", required=True, help="index folder (ragserve index build)")
    p.add_argument("--embedder", default=None, help="embedder (default: the index's own)")
    p.add_argument("--device", default="auto", help="LLM device: auto, cpu, cuda, cuda:N")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads of the LLM on CPU")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else no auth)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id for /v1/completions (default: --model)"
    )
    p.add_argument("--max-inflight", type=int, default=64, help="admission bound; past it 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to drain at exit")
    p.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run on Ray: join the cluster at ADDRESS, or start a local one without it",
    )
    p.add_argument("--llm-replicas", type=int, default=1, help="LLM engine replicas (--ray)")
    p.add_argument("--index-shards", type=int, default=1, help="index shards (--ray)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    from ragserve.runtime import Server, ServerConfig
    from ragserve.server import ServeConfig, serve

    config = ServeConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key or None,
        served_model_name=args.served_model_name or Path(args.model).name,
        max_num_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
    )
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        logger.warning("binding %s without --api-key: anyone who reaches it may use it", args.host)
    # NOTE: the Server's own bound must not be below HTTP admission, or admitted requests
    # would wait in threads for a Server slot instead of being refused with 429.
    engine_kwargs = {"device": args.device}
    if args.cpu_threads is not None:
        engine_kwargs["cpu_threads"] = args.cpu_threads
    try:
        runtime = ServerConfig(
            engine_kwargs=engine_kwargs,
            max_active_requests=max(ServerConfig.max_active_requests, args.max_inflight),
            **_scale_out(args),
        )
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    if not Path(args.index).is_dir():
        logger.error("no index directory at %s (build one with `ragserve index build`)", args.index)
        return 2
    try:
        server = Server(model=args.model, index=args.index, embedder=args.embedder, config=runtime)
    except (RuntimeError, ValueError, OSError) as exc:
        logger.debug("Server failed to start", exc_info=True)
        logger.error("cannot start the Server: %s", str(exc).strip().splitlines()[-1])
        return 1
    serve(server, config)
    return 0


def _scale_out(args: argparse.Namespace) -> dict:
    """``ServerConfig`` fields of ``--ray [ADDRESS] --llm-replicas N --index-shards M``."""
    if args.ray is None:
        return {"num_llm_replicas": args.llm_replicas, "num_index_shards": args.index_shards}
    return {
        "backend": "ray",
        "ray_address": args.ray or None,
        "num_llm_replicas": args.llm_replicas,
        "num_index_shards": args.index_shards,
    }
