"""The five built-in workflows' outputs on the tiny model and the small index, as plain data.

``python tests/runtime/builtin_golden.py OUT.json`` (with ``PYTHONPATH`` at a ragserve
``src``) writes them; ``fixtures/builtin_outputs.json`` holds those of the implementation
before operator nodes (issue 16), which ``test_builtin_golden.py`` compares against.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

QUESTIONS = (
    "What is the capital of Kenya?",
    "Which country is in South America?",
    "Tell me about Japan.",
)


def outputs(server) -> dict:
    """Every built-in workflow on every question, through ``server`` (in process, prefix
    caching off: ``serve``)."""
    from test_workflows_e2e import small_workflow

    from ragserve.workflows import BUILTIN_WORKFLOWS

    out: dict = {}
    for name in sorted(BUILTIN_WORKFLOWS):
        for q in QUESTIONS:
            r = server.run(q, small_workflow(name))
            out[f"{name}|{q}"] = {
                "error": r.error,
                "output": r.output,
                "doc_ids": list(r.doc_ids),
                "state": {k: _plain(v) for k, v in r.state.items()},
                "kinds": [t.kind for t in r.node_timings],
            }
    return out


def serve(model: str, index: str):
    """The Server the goldens are written with (as ``conftest.local_server``)."""
    from ragserve.runtime import Server, ServerConfig

    config = ServerConfig(
        in_process=True, engine_kwargs={"device": "cpu", "enable_prefix_caching": False}
    )
    return Server(model, index, config=config)


def _plain(value):
    if isinstance(value, list):
        return [getattr(p, "doc_id", p) for p in value]
    return value if isinstance(value, (str, int, float, type(None))) else repr(value)


def build(root: Path) -> tuple[str, str]:
    from conftest import small_corpus
    from ragserve.retrieval import VectorIndex, load_embedder
    from testing import make_tiny_model

    model = make_tiny_model(root / "tiny-llama", "llama", seed=0)
    index = VectorIndex.build(small_corpus(), load_embedder("all-minilm-l6-v2"), nlist=4)
    index.save(root / "small")
    index.close()
    return str(model), str(root / "small")


if __name__ == "__main__":
    sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]
    with tempfile.TemporaryDirectory() as tmp:
        model, index = build(Path(tmp))
        with serve(model, index) as server:
            data = outputs(server)
        Path(sys.argv[1]).write_text(json.dumps(data, indent=1, sort_keys=True))
