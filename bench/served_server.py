"""``ragserve serve`` for the capacity bench, with one extra route to switch features off.

``python bench/served_server.py serve FLAGS`` parses FLAGS with ragserve's own CLI parser and
starts exactly what ``ragserve serve FLAGS`` starts (``serve_launch_config``, ``build_server``,
``create_app``, uvicorn), plus ``POST /bench/control``: between load points the bench asks it
to switch a feature off or on in the running Server (nothing is switched unless asked), and
reads the counters /metrics does not export (the GPU tier's hit rate). Body (every key
optional): ``{"cosched": "auto" | "off" | "all" | "split,..."}`` (the scheduler's transform
chain, swapped once the requests in flight finish; ``auto`` resolved against the tier as it is
after this call), ``{"kv_reuse": bool}`` (document-KV reuse; empties the KV cache either way),
``{"tier": bool}`` (place / drop the GPU index tier at the configured budget; a server
started with ``auto`` co-scheduling re-resolves it, as a server started so would run).
The reply: ``{"stats": Server.stats(), "tier": gpu_tier_stats}``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def add_control(app: Any, server: Any, config: Any) -> None:
    """``POST /bench/control`` (module doc) on ``app`` in front of ``server``."""
    from fastapi import Body

    from ragserve.scheduler.cosched import CoScheduleConfig

    tier = config.runtime.gpu_tier
    knobs = {
        f.name: getattr(config.runtime.cosched, f.name)
        for f in dataclasses.fields(CoScheduleConfig)
        if not f.name.startswith("enable_")
    }

    @app.post("/bench/control")
    def control(body: dict = Body(default={})) -> dict:  # noqa: B008 - FastAPI's idiom
        wait = 600.0
        if "kv_reuse" in body:
            server.executor.call_generation("set_kv_reuse", bool(body["kv_reuse"])).result(wait)
        if "tier" in body:
            if body["tier"]:
                if tier is None or tier.budget_bytes is None:
                    raise ValueError("tier: the server was started without --gpu-index-gb")
                spec = (tier.budget_bytes, tier.device, tier.dtype, tier.scan, tier.stream_cold)
                server.executor.call_retrieval("set_gpu_tier", *spec).result(wait)
            else:
                server.executor.call_retrieval("drop_gpu_tier").result(wait)
        tier_stats = server.executor.call_retrieval("gpu_tier_stats").result(wait)
        cosched = None
        if "cosched" in body:
            cosched = CoScheduleConfig.from_names(str(body["cosched"]), **knobs)
        elif "tier" in body and config.runtime.cosched.auto:
            cosched = config.runtime.cosched  # what a server started with this tier runs
        if cosched is not None:
            server.set_cosched(cosched, timeout=wait)
        stats = server.stats()
        return {"stats": stats, "tier": tier_stats}


def build_app(argv: list[str]) -> tuple[Any, Any]:
    """``(app, ServeConfig)`` of ``ragserve serve ARGV`` (the ``serve`` handler's steps: CLI
    parser, ``serve_launch_config``, ``build_server``, ``create_app``), with the control
    route added."""
    from ragserve.cli.main import build_parser, configure_logging
    from ragserve.cli.options import build_server
    from ragserve.cli.serve import check_port, serve_launch_config
    from ragserve.server.app import create_app

    args = build_parser().parse_args(argv)
    if args.command != "serve":
        raise SystemExit("usage: served_server.py serve [ragserve serve flags]")
    configure_logging(args.verbose)
    config = serve_launch_config(args)
    check_port(config.serve.host, config.serve.port)
    server = build_server(config)
    app = create_app(server, config.serve, own_server=True)
    add_control(app, server, config)
    print(f"served: co-scheduling {server.stats()['cosched']}", file=sys.stderr, flush=True)
    return app, config.serve


class ThreadServed:
    """``build_app`` served by uvicorn on a thread of this process (the CPU test's fast path:
    no second interpreter importing torch and transformers again); ``stop`` drains and closes
    the Server as SIGTERM does."""

    def __init__(self, argv: list[str]) -> None:
        from ragserve.server.launch import BackgroundServer

        app, serve_config = build_app(argv)
        self._bg = BackgroundServer(app, serve_config).start()
        self.url = self._bg.url
        self.start_s = 0.0

    def stop(self) -> None:
        self._bg.stop(60)


def main(argv: list[str] | None = None) -> int:
    from ragserve.server.launch import _uvicorn_server

    app, serve_config = build_app(sys.argv[1:] if argv is None else argv)
    _uvicorn_server(app, serve_config).run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
