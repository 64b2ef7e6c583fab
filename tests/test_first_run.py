"""The first run's costs: the built-in model's conversion (one GGUF parse), the factbook
index's embedding dtype, and `ragserve demo`'s progress lines on a cold home."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragserve.generation import builtin as gen_builtin
from ragserve.retrieval.builtin import has_native_bf16

ROOT = Path(__file__).resolve().parents[1]


def test_native_bf16_is_read_from_the_cpu_flags() -> None:
    assert has_native_bf16("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 sha_ni\n")
    assert has_native_bf16("flags\t: fpu amx_tile amx_bf16 amx_int8\n")
    assert not has_native_bf16("flags\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert not has_native_bf16("model name\t: avx512_bf16 in a name is not a flag\n")


def test_gguf_memo_shares_one_parse_and_is_undone() -> None:
    gguf = pytest.importorskip("gguf")
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = next(iter(gguf.MODEL_ARCH_NAMES))
    with gen_builtin._gguf_parsed_once():
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.GGUFReader is not reader
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    assert name_map(arch, 2) is not name_map(arch, 2)  # the library's own: built every call


@pytest.mark.slow
def test_conversion_output_is_unchanged_by_the_memo(tmp_path, monkeypatch) -> None:
    import contextlib

    name = "smollm2-135m-instruct"
    outs = {}
    for memo in (True, False):
        monkeypatch.setenv("RAGSERVE_HOME", str(tmp_path / str(memo)))
        if not memo:
            monkeypatch.setattr(gen_builtin, "_gguf_parsed_once", contextlib.nullcontext)
        folder = gen_builtin.ensure_builtin(name)
        outs[memo] = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    assert outs[True].keys() == outs[False].keys() and "model.safetensors" in outs[True]
    for file in outs[True]:
        assert outs[True][file] == outs[False][file], file


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_demo_on_a_cold_home_says_each_step(tmp_path) -> None:
    env = {**os.environ, "RAGSERVE_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "ragserve", "demo", "--questions", "1", "--max-tokens", "8"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for line in (
        "converting the built-in model smollm2-135m-instruct (first run only)",
        "building the factbook index (first run only)",
        "index built in",
        "model converted in",
        "starting the LLM and index workers",
        "ready in",
        "answering 5 requests concurrently",
    ):
        assert line in proc.stdout, line
    warm = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert warm.returncode == 0 and "first run only" not in warm.stdout
