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

from ragserve.cli.main import UsageError
from ragserve.cli.options import add_server_args, build_server, launch_config

logger = logging.getLogger(__name__)

API_KEY_ENV = "RAGSERVE_API_KEY"
# flag dest -> ServeConfig field
_SERVE_FLAGS = {
    "host": "host",
    "port": "port",
    "api_key": "api_key",
    "served_model_name": "served_model_name",
    "max_inflight": "max_num_inflight",
    "max_body_bytes": "max_body_bytes",
    "drain_timeout": "drain_timeout_s",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions (RAG workflows, or the LLM itself), "
        "/v1/completions (plain LLM), /v1/embeddings, /v1/models, /v1/documents, /metrics and "
        "/health. Co-scheduled by default (--cosched).",
    )
    add_server_args(p)
    p.add_argument(
        "--workflow",
        dest="workflows",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION",
        help="serve a user graph as model ragserve/<name> (repeatable; [name=]module:function)",
    )
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default=None, help="bind address (default: loopback)")
    h.add_argument("--port", type=int, default=None, help="port (default 8000)")
    h.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV}, else no auth)",
    )
    h.add_argument(
        "--served-model-name", default=None, help="model id of the LLM itself (default: --model)"
    )
    h.add_argument("--max-inflight", type=int, default=None, help="admission bound; past it 429")
    h.add_argument("--max-body-bytes", type=int, default=None, help="larger bodies get 413")
    h.add_argument("--drain-timeout", type=float, default=None, help="seconds to drain at exit")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration as TOML (a --config file) and exit",
    )
    p.set_defaults(func=handler)


def serve_launch_config(args: argparse.Namespace, *, key_from_env: bool = True) -> Any:
    """The ``LaunchConfig`` of ``serve``: the shared settings, then the HTTP flags (and the
    API key from ``$RAGSERVE_API_KEY`` when none is given, if ``key_from_env``)."""
    config = launch_config(args)
    if args.workflows:
        config = dataclasses.replace(config, workflows=(*config.workflows, *args.workflows))
    changes = {
        field: getattr(args, dest)
        for dest, field in _SERVE_FLAGS.items()
        if getattr(args, dest) is not None
    }
    env_key = os.environ.get(API_KEY_ENV) if key_from_env else None
    if "api_key" not in changes and config.serve.api_key is None and env_key:
        changes["api_key"] = env_key
    if "served_model_name" not in changes and config.serve.served_model_name == "ragserve":
        changes["served_model_name"] = Path(config.model).name
    try:
        serve = dataclasses.replace(config.serve, **changes)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # NOTE: the Server's own bound must not be below HTTP admission, or admitted requests
    # would wait in threads for a Server slot instead of being refused with 429.
    runtime = config.runtime
    if runtime.max_active_requests < serve.max_num_inflight:
        runtime = dataclasses.replace(runtime, max_active_requests=serve.max_num_inflight)
    return dataclasses.replace(config, serve=serve, runtime=runtime)


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
        logger.warning("binding %s without --api-key: anyone who reaches it may use it", args.host)
    check_port(config.serve.host, config.serve.port)
    server = build_server(config)
    logger.info("Server ready; co-scheduling: %s", ", ".join(server.stats()["cosched"]) or "off")
    serve(server, config.serve)
    return 0
