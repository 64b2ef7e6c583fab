"""``ragserve ask "question"``: one question through a workflow, answer and sources printed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ragserve.cli.errors import UsageError
from ragserve.cli.options import add_server_args, build_server, load_workflow


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ask", help="answer one question with a RAG workflow")
    p.add_argument("question")
    workflows = "oneshot, hyde, multistep, irg, recomp, or module:function (a user graph)"
    p.add_argument("--workflow", default="oneshot", help=workflows)
    p.add_argument("--topk", type=int, help="passages per retrieval")
    p.add_argument("--max-tokens", type=int, help="answer length bound")
    p.add_argument("--json", action="store_true", help="print the response as JSON")
    add_server_args(p)
    p.set_defaults(func=handler)


def resolve_graph(args: argparse.Namespace) -> Any:
    """The built-in workflow (with ``--topk`` / ``--max-tokens``) or a ``module:function``."""
    from ragserve.server.graphs import tune_graph
    from ragserve.workflows import get_workflow

    knobs = {k: getattr(args, k) for k in ("topk", "max_tokens") if getattr(args, k) is not None}
    for flag, value in knobs.items():
        if value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if ":" in args.workflow:
        return tune_graph(load_workflow(args.workflow)[1], **knobs)
    try:
        return get_workflow(args.workflow, **knobs)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None


def handler(args: argparse.Namespace) -> int:
    from ragserve.cli.launch_config import from_args

    graph = resolve_graph(args)
    with build_server(from_args(args)) as server:
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
