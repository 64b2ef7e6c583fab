"""`ragserve ask` on a tiny model and a small index; `make demo` itself (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragserve.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_ask_prints_the_response_as_json(tiny_model: str, small_index: str, capsys) -> None:
    argv = ["ask", "What is the capital of Peru?", "--workflow", "oneshot", "--model", tiny_model]
    argv += ["--index", small_index, "--device", "cpu", "--in-process", "--json"]
    argv += ["--max-tokens", "4"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["error"] is None and "Peru" in out["titles"]
    assert set(out["timings"]) == {"0", "1"}


def test_ask_rejects_an_unknown_workflow(capsys) -> None:
    assert main(["ask", "q", "--workflow", "nope"]) == 2
    assert "unknown workflow 'nope'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.integration
def test_make_demo_runs_the_embedded_default() -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(
        ["make", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("oneshot", "hyde", "multistep", "irg", "recomp"):
        assert f"\n{name} " in proc.stdout  # its row of the timing table
    assert "Q: What is the capital of France?" in proc.stdout
    assert "ERROR" not in proc.stdout
