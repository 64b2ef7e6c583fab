"""``ragserve serve``: the OpenAI-compatible HTTP front over a co-scheduled Server."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from ragserve.cli.errors import UsageError
from ragserve.cli.options import Flags, add_flags, add_server_args, build_server, given

logger = logging.getLogger(__name__)

API_KEY_ENV = "RAGSERVE_API_KEY"
# (flag, ServeConfig field, type, help, check): a flag given sets the field (which checks it).
HTTP_FLAGS: Flags = (
    ("--host", "host", str, "bind address (default: loopback)", None),
    ("--port", "port", int, "port (default 8000)", None),
    ("--served-model-name", "served_model_name", str, "the LLM's own id (default: --model)", None),
    ("--max-inflight", "max_num_inflight", int, "admission bound; past it 429", None),
    ("--max-body-bytes", "max_body_bytes", int, "larger bodies get 413", None),
    ("--drain-timeout", "drain_timeout_s", float, "seconds to drain at exit", None),
)  # fmt: skip
# (flag, dest, type, help, check) of the tier's sizes, in GB; dest -> GpuTierConfig's bytes field
TIER_SIZE_FLAGS: Flags = (
    ("--gpu-index-gb", "gpu_index_gb", float, "tier size in GB (overrides Eq. 2)", ">= 0"),
    ("--gpu-index-stream-host-gb", "gpu_index_stream_host_gb", float,
     "the stream's pinned host memory, GB", "> 0"),
)  # fmt: skip
TIER_BYTES = {"gpu_index_gb": "budget_bytes", "gpu_index_stream_host_gb": "stream_host_bytes"}
# NOTE: = runtime.config's choices, not imported: that would load Faiss for every command.
TIER_DTYPES, TIER_SCANS = ("float32", "float16", "bfloat16"), ("auto", "grouped", "dense", "fused")
STREAM_MODES = ("auto", "on", "off")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve vLLM's OpenAI-compatible API over RAG workflows (co-scheduled by "
        "default, --cosched): /v1/chat/completions, /v1/completions, /v1/embeddings, "
        "/v1/models, /tokenize, /detokenize, /v1/documents, /metrics, /health, /version.",
    )
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="as --model (vLLM's form)")
    add_server_args(p)
    p.add_argument(
        "--workflow",
        dest="workflows",
        action="append",
        metavar="MODULE:FUNCTION",
        help="serve a user graph as model ragserve/<name> (repeatable; [name=]module:function)",
    )
    scorer = "rerank nodes' scorer: 'embedding' (default) or module:factory (of the embedder)"
    p.add_argument("--reranker", metavar="NAME", help=scorer)
    p.add_argument("--print-config", action="store_true", help="print the config as TOML, exit")
    h = p.add_argument_group("HTTP")
    add_flags(h, HTTP_FLAGS)
    h.add_argument(
        "--api-key-file",
        help=f"require 'Authorization: Bearer KEY', KEY read from this file (or from "
        f"${API_KEY_ENV}, the recommended ways). Default: no auth",
    )
    h.add_argument("--api-key", metavar="KEY", help="the key itself (vLLM's flag; seen in `ps`)")
    tier = p.add_argument_group("GPU index tier (hot IVF-Flat lists in GPU memory)")
    add_flags(tier, TIER_SIZE_FLAGS)
    profile = "JSON of profile-memory: Eq. 2 splits the GPU memory"
    tier.add_argument("--gpu-index-profile", help=profile)
    tier.add_argument("--gpu-index-device", default="cuda", help="tier device (cuda, cuda:N, cpu)")
    tier.add_argument("--gpu-index-dtype", default="float32", choices=TIER_DTYPES)
    scan = "auto: a cost model calibrated on the tier picks per batch; fused: Triton, CUDA"
    tier.add_argument("--gpu-index-scan", default="auto", choices=TIER_SCANS, help=scan)
    stream = "scan lists the tier lacks on its device, streamed from host memory (auto: CUDA)"
    tier.add_argument("--gpu-index-stream", default="auto", choices=STREAM_MODES, help=stream)
    scale = p.add_argument_group("scale-out on Ray")
    ray = "run on Ray: join the cluster at ADDRESS, or start a local one without it"
    scale.add_argument("--ray", nargs="?", const="", metavar="ADDRESS", help=ray)
    scale.add_argument("--llm-replicas", type=int, default=1, help="LLM engine replicas (--ray)")
    scale.add_argument("--index-shards", type=int, default=1, help="index shards (--ray)")
    p.set_defaults(func=handler)


def gpu_tier_config(args: argparse.Namespace) -> Any:
    """``GpuTierConfig`` from the flags, or None when neither a size nor a profile is given."""
    from ragserve.runtime import GpuTierConfig
    from ragserve.runtime.memory_plan import load_profiles

    if args.gpu_index_gb is None and args.gpu_index_profile is None:
        return None
    sizes = {TIER_BYTES[k]: int(gb * 1e9) for k, gb in given(args, TIER_SIZE_FLAGS).items()}
    return GpuTierConfig(
        device=args.gpu_index_device,
        dtype=args.gpu_index_dtype,
        scan=args.gpu_index_scan,
        stream_cold=args.gpu_index_stream,
        **sizes,
        **(load_profiles(args.gpu_index_profile) if args.gpu_index_profile else {}),
    )


def read_api_key(path: str | None, *, from_env: bool = True, key: str | None = None) -> str | None:
    """The API key: ``key`` (``--api-key``, with a warning), else from ``path``, else from
    ``$RAGSERVE_API_KEY`` (if ``from_env``), else ``None``; surrounding whitespace stripped.
    An empty key is an error, never "no auth"."""
    if key is not None and path is not None:
        raise UsageError("give --api-key or --api-key-file, not both")
    on_command_line = key is not None
    if on_command_line:
        empty = "--api-key is empty"
    elif path is not None:
        empty = f"--api-key-file: {path} is empty"
        try:
            key = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"--api-key-file: cannot read {path}: {exc.strerror}") from None
    else:
        empty = f"${API_KEY_ENV} is set but empty (unset it to serve without auth)"
        key = os.environ.get(API_KEY_ENV) if from_env else None
    if key is not None and not key.strip():
        raise UsageError(empty)
    if on_command_line:
        logger.warning(
            "--api-key: a key on the command line is visible to other local users (ps); "
            "prefer --api-key-file or $%s",
            API_KEY_ENV,
        )
    return None if key is None else key.strip()


def serve_launch_config(args: argparse.Namespace, *, key_from_env: bool = True) -> Any:
    """The ``LaunchConfig`` of ``serve``: the shared settings, then the HTTP, GPU-tier and
    scale-out flags; the API key from the flags, else the file, else (if ``key_from_env``)
    ``$RAGSERVE_API_KEY``."""
    from ragserve.cli.launch_config import from_args

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise UsageError(f"model given twice: {args.model_tag} and --model {args.model}")
        args = argparse.Namespace(**{**vars(args), "model": args.model_tag})
    config = from_args(args)
    changes = given(args, HTTP_FLAGS)
    key = read_api_key(args.api_key_file, from_env=key_from_env, key=args.api_key)
    from_flags = args.api_key_file is not None or args.api_key is not None
    if key is not None and (from_flags or config.serve.api_key is None):
        changes["api_key"] = key
    if "served_model_name" not in changes and config.serve.served_model_name == "ragserve":
        changes["served_model_name"] = Path(config.model).name
    if config.serve.tokenizer is None:  # /tokenize: the served LLM's
        changes["tokenizer"] = config.model
    runtime = config.runtime
    updates: dict[str, Any] = {}
    if (tier := gpu_tier_config(args)) is not None:
        updates["gpu_tier"] = tier
    if args.reranker is not None:
        try:
            updates["operators"] = dataclasses.replace(runtime.operators, reranker=args.reranker)
        except ValueError as exc:
            raise UsageError(f"--{exc}") from None
    if args.ray is not None or (args.llm_replicas, args.index_shards) != (1, 1):
        updates |= {"num_llm_replicas": args.llm_replicas, "num_index_shards": args.index_shards}
    if args.ray is not None:
        updates |= {"backend": "ray", "ray_address": args.ray or None}
    try:
        serve = dataclasses.replace(config.serve, **changes)
        # NOTE: the Server's own bound must not be below HTTP admission, or admitted requests
        # would wait in threads for a Server slot instead of being refused with 429.
        bound = max(runtime.max_active_requests, serve.max_num_inflight)
        runtime = dataclasses.replace(runtime, max_active_requests=bound, **updates)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    workflows = (*config.workflows, *(args.workflows or ()))
    return dataclasses.replace(config, workflows=workflows, serve=serve, runtime=runtime)


def check_port(host: str, port: int) -> None:
    """Fail before loading anything if ``host:port`` cannot be bound (in use, bad host)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"cannot bind {host}:{port}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(
                f"cannot listen on {host}:{port}: {exc.strerror} (is another server running? "
                "pick another --port)"
            ) from None


def handler(args: argparse.Namespace) -> int:
    from ragserve.cli.launch_config import dump_toml
    from ragserve.server import serve

    if args.print_config:  # NOTE: a key from the environment is not written out
        sys.stdout.write(dump_toml(serve_launch_config(args, key_from_env=False)))
        return 0
    config = serve_launch_config(args)
    if config.serve.host not in ("127.0.0.1", "localhost", "::1") and config.serve.api_key is None:
        logger.warning(
            "binding %s without an API key: anyone who reaches it may use it", config.serve.host
        )
    check_port(config.serve.host, config.serve.port)
    server = build_server(config)
    logger.info("Server ready; co-scheduling: %s", ", ".join(server.stats()["cosched"]) or "off")
    serve(server, config.serve)
    return 0
