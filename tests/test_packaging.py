"""``pip install '.[builtin]'`` into a fresh virtual environment, ``ragserve setup``, then
``ragserve ask`` answers from the embedded default (slow: it installs torch and friends)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(cmd: list, env: dict, timeout: int = 1800) -> str:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(3600)
def test_pip_install_builtin_then_ask(tmp_path: Path) -> None:
    source = tmp_path / "src-copy"  # pip builds in the source tree: keep the checkout clean
    source.mkdir()
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    py, ragserve = str(venv / "bin" / "python"), str(venv / "bin" / "ragserve")
    _run([py, "-m", "pip", "install", "-q", "torch==2.13.0"], env)  # as the Makefile: CPU build
    _run([py, "-m", "pip", "install", "-q", f"{source}[builtin]"], env)
    _run([ragserve, "setup"], env)
    assert _run([py, "-m", "ragserve", "--version"], env).strip() == "ragserve 0.1.0"
    out = _run(
        [ragserve, "ask", "What is the capital of France?", "--max-tokens", "8", "--json"], env
    )
    response = json.loads(out)
    assert response["error"] is None and response["output"].strip()
    assert any(title.startswith("France") for title in response["titles"])
