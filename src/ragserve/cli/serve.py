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
        "--api-key-file",
        default=None,
        help=f"require 'Authorization: Bearer KEY', KEY read from this file (or from "
        f"${API_KEY_ENV}; never from the command line, where `ps` shows it). Default: no auth",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id for /v1/completions (default: --model)"
    )
    p.add_argument("--max-inflight", type=int, default=64, help="admission bound; past it 429")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to drain at exit")
    tier = p.add_argument_group("GPU index tier (hot IVF-Flat lists in GPU memory)")
    tier.add_argument(
        "--gpu-index-gb", type=float, default=None, help="tier size in GB (overrides Eq. 2)"
    )
    tier.add_argument(
        "--gpu-index-profile",
        default=None,
        help="JSON with generation_profile and retrieval_profile: Eq. 2 splits the GPU memory "
        "between the KV cache and the tier",
    )
    tier.add_argument("--gpu-index-device", default="cuda", help="tier device (cuda, cuda:N, cpu)")
    tier.add_argument(
        "--gpu-index-dtype", default="float32", choices=("float32", "float16", "bfloat16")
    )
    p.set_defaults(func=handler)


def gpu_tier_config(args: argparse.Namespace):
    """``GpuTierConfig`` from the flags, or None when neither a size nor a profile is given."""
    from ragserve.runtime import GpuTierConfig
    from ragserve.runtime.memory_plan import load_profiles

    if args.gpu_index_gb is None and args.gpu_index_profile is None:
        return None
    if args.gpu_index_gb is not None and args.gpu_index_gb < 0:
        raise ValueError(f"--gpu-index-gb must be >= 0, got {args.gpu_index_gb}")
    profiles = load_profiles(args.gpu_index_profile) if args.gpu_index_profile else {}
    budget = None if args.gpu_index_gb is None else int(args.gpu_index_gb * 1e9)
    return GpuTierConfig(
        budget_bytes=budget, device=args.gpu_index_device, dtype=args.gpu_index_dtype, **profiles
    )


def read_api_key(path: str | None) -> str | None:
    """The API key from ``path`` (surrounding whitespace stripped), else from
    ``$RAGSERVE_API_KEY``, else ``None`` (no auth). An empty key is an error, never "no auth"."""
    if path is not None:
        try:
            key = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ValueError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
        if not key:
            raise ValueError(f"--api-key-file: {path} is empty")
        return key
    key = os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"${API_KEY_ENV} is set but empty (unset it to serve without auth)")
    return None if key is None else key.strip()


def handler(args: argparse.Namespace) -> int:
    from ragserve.runtime import Server, ServerConfig
    from ragserve.server import ServeConfig, serve

    try:
        api_key = read_api_key(args.api_key_file)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    config = ServeConfig(
        host=args.host,
        port=args.port,
        api_key=api_key,
        served_model_name=args.served_model_name or Path(args.model).name,
        max_num_inflight=args.max_inflight,
        max_body_bytes=args.max_body_bytes,
        drain_timeout_s=args.drain_timeout,
    )
    if config.host not in ("127.0.0.1", "localhost", "::1") and config.api_key is None:
        logger.warning("binding %s without an API key: anyone who reaches it may use it", args.host)
    # NOTE: the Server's own bound must not be below HTTP admission, or admitted requests
    # would wait in threads for a Server slot instead of being refused with 429.
    engine_kwargs = {"device": args.device}
    if args.cpu_threads is not None:
        engine_kwargs["cpu_threads"] = args.cpu_threads
    if not Path(args.index).is_dir():
        logger.error("no index directory at %s (build one with `ragserve index build`)", args.index)
        return 2
    try:
        runtime = ServerConfig(
            engine_kwargs=engine_kwargs,
            max_active_requests=max(ServerConfig.max_active_requests, args.max_inflight),
            gpu_tier=gpu_tier_config(args),
        )
        server = Server(model=args.model, index=args.index, embedder=args.embedder, config=runtime)
    except (RuntimeError, ValueError, OSError) as exc:
        logger.debug("Server failed to start", exc_info=True)
        logger.error("cannot start the Server: %s", str(exc).strip().splitlines()[-1])
        return 1
    serve(server, config)
    return 0
