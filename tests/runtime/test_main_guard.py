"""A script that creates a worker-process ``Server`` at import time of ``__main__`` (no
``if __name__ == "__main__":`` guard) gets an error that says how to fix it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from ragserve.runtime.worker_start import _guard_ranges, _is_guarded

SCRIPT = """
from ragserve.runtime import Server

server = Server(model="{model}", index="{index}")
print(server.run("What is the capital of Peru?").output)
"""


@pytest.mark.integration
def test_unguarded_script_gets_the_explanatory_error(tmp_path, tiny_model, small_index) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT.format(model=tiny_model, index=small_index))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ragserve.runtime.worker_start.MainGuardError:")
    assert 'if __name__ == "__main__":' in last and f"{script}:4" in last


def test_guard_ranges_cover_only_the_guarded_block(tmp_path) -> None:
    source = tmp_path / "s.py"
    source.write_text(
        textwrap.dedent(
            """\
            import x
            s = 1
            if __name__ == "__main__":
                s = 2
                s = 3
            if "__main__" == __name__:
                s = 4
            if __name__ != "__main__":
                s = 5
            """
        )
    )
    assert _guard_ranges(str(source)) == ((3, 5), (6, 7))
    assert [_is_guarded(str(source), n) for n in (2, 4, 5, 7, 9)] == [
        False,
        True,
        True,
        True,
        False,
    ]


def test_a_call_from_a_function_passes_the_check() -> None:
    # not module-level code of __main__ (pytest's own __main__ is not on this stack)
    from ragserve.runtime.worker_start import check_main_guard

    check_main_guard()


@pytest.mark.integration
def test_a_main_without_a_file_is_not_refused() -> None:
    # `python -c`, a REPL or a notebook: spawned workers do not re-import such a __main__
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = "from ragserve.runtime.worker_start import check_main_guard; check_main_guard()"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
