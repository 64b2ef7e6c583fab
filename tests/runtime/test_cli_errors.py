"""Every CLI command turns an ordinary mistake into one ``error:`` line on stderr and a
non-zero exit code, with no traceback (``-v`` adds it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ragserve.cli.main import main


def _corrupt_index(tmp: Path) -> str:
    out = tmp / "corrupt"
    out.mkdir()
    (out / "manifest.json").write_text("{not json")
    return str(out)


def _empty_dir(tmp: Path) -> str:
    out = tmp / "empty"
    out.mkdir()
    return str(out)


def _unsupported_files(tmp: Path) -> str:
    out = tmp / "pdfs"
    out.mkdir()
    (out / "a.pdf").write_bytes(b"%PDF-1.4")
    return str(out)


def _unknown_architecture(tmp: Path) -> str:
    out = tmp / "weird-model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"]}))
    return str(out)


def _bad_config(tmp: Path) -> str:
    path = tmp / "bad.toml"
    path.write_text('model = "x"\n[engine]\nwarp_speed = 9\n')
    return str(path)


def _bad_reranker_config(tmp: Path) -> str:
    path = tmp / "reranker.toml"
    path.write_text('[operators]\nreranker = "not a name"\n')
    return str(path)


# (name, argv builder(tmp, tiny_model, small_index), exit code, text in the error line)
CASES = [
    ("missing index", lambda t, m, i: ["index", "info", str(t / "nope")], 1, "no index directory"),
    ("empty index", lambda t, m, i: ["index", "info", _empty_dir(t)], 1, "not a ragserve index"),
    ("corrupt index", lambda t, m, i: ["index", "search", _corrupt_index(t), "q"], 1, "JSON"),
    (
        "bad corpus path",
        lambda t, m, i: [
            "index",
            "build",
            "--corpus",
            str(t / "none.jsonl"),
            "--out",
            str(t / "o"),
        ],
        1,
        "none.jsonl",
    ),
    (
        "unsupported files",
        lambda t, m, i: [
            "index",
            "build",
            "--corpus",
            _unsupported_files(t),
            "--out",
            str(t / "o"),
        ],
        2,
        "no documents",
    ),
    (
        "unknown model",
        lambda t, m, i: ["ask", "q", "--model", "smollm-typo", "--index", i, "--in-process"],
        1,
        "neither a folder nor a built-in name",
    ),
    (
        "unknown architecture",
        lambda t, m, i: ["ask", "q", "--model", _unknown_architecture(t), "--index", i],
        1,
        "unsupported architecture",
    ),
    (
        "ask: missing index",
        lambda t, m, i: ["ask", "q", "--model", m, "--index", str(t / "nope")],
        2,
        "no index directory",
    ),
    (
        "serve: corrupt index",
        lambda t, m, i: ["serve", "--model", m, "--index", _corrupt_index(t), "--port", "0"],
        1,
        "not valid JSON",
    ),
    ("unknown workflow", lambda t, m, i: ["ask", "q", "--workflow", "nope"], 2, "nope"),
    (
        "bad --cosched",
        lambda t, m, i: ["serve", "--cosched", "split,warp", "--print-config"],
        2,
        "warp",
    ),
    (
        "bad config key",
        lambda t, m, i: ["serve", "--config", _bad_config(t), "--print-config"],
        2,
        "warp_speed",
    ),
    (
        "user workflow not importable",
        lambda t, m, i: ["ask", "q", "--workflow", "no_such_module_x:build"],
        2,
        "no_such_module_x",
    ),
    (
        "bad --reranker",
        lambda t, m, i: ["serve", "--reranker", "cosine", "--print-config"],
        2,
        "--reranker must be 'embedding' or 'module:factory'",
    ),
    (
        "bad [operators] reranker",
        lambda t, m, i: ["serve", "--config", _bad_reranker_config(t), "--print-config"],
        2,
        "[operators] reranker must be",
    ),
    (
        "reranker not importable",
        lambda t, m, i: [
            *("serve", "--model", m, "--index", i, "--port", "0"),
            *("--reranker", "no_such_module_y:make"),
        ],
        2,
        "reranker 'no_such_module_y:make': cannot import no_such_module_y",
    ),
]


@pytest.mark.parametrize(("name", "argv", "code", "text"), CASES, ids=[c[0] for c in CASES])
def test_cli_error_is_one_line(
    name, argv, code, text, tmp_path, tiny_model, small_index, capsys
) -> None:
    assert main(argv(tmp_path, tiny_model, small_index)) == code
    err = capsys.readouterr().err
    # NOTE: warnings may come first (skipped files are listed, issue 14); one error line
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and text in lines[0], lines[0]
    assert "Traceback" not in err


def test_port_in_use_is_one_line(tiny_model, small_index, capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--model", tiny_model, "--index", small_index, "--port", str(port)]
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in err


@pytest.mark.integration
def test_a_real_process_prints_one_line_and_verbose_the_traceback(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "ragserve", "index", "info", str(tmp_path / "nope")]
    quiet = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert quiet.returncode == 1
    assert quiet.stderr.strip().splitlines() == [
        f"error: no index directory at {tmp_path / 'nope'}"
    ]
    loud = subprocess.run(
        [*cmd[:3], "-v", *cmd[3:]], capture_output=True, text=True, env=env, timeout=300
    )
    assert loud.returncode == 1 and "Traceback" in loud.stderr
