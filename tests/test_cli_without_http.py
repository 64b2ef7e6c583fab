"""Commands that do not serve HTTP start where fastapi/uvicorn are missing (the H200 image)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

_BLOCKED = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "starlette"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None
sys.meta_path.insert(0, _Block())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED + code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_profile_memory_runs_without_fastapi() -> None:
    # past argument parsing and the launch config, up to the model check (a one-line error)
    res = _run(
        "from ragserve.cli.main import main\n"
        "sys.exit(main(['profile-memory', '--model', '/nonexistent', '--index', '/nonexistent',"
        " '--out', '/nonexistent/p.json']))"
    )
    assert "fastapi" not in res.stderr, res.stderr
    assert "model '/nonexistent' is neither a folder" in res.stderr


def test_serving_names_still_need_fastapi_and_say_so() -> None:
    res = _run("import ragserve.server as s\nprint(s.ServeConfig.__name__)\ns.create_app")
    assert "ServeConfig" in res.stdout
    assert res.returncode != 0
    assert "No module named 'fastapi'" in res.stderr
