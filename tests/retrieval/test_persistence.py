"""Corrupt or truncated index files are rejected with a clear error naming the file, and a
real subprocess killed with SIGKILL mid-upsert loses no acknowledged change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from ragserve.retrieval import IndexCorruptError, VectorIndex


@pytest.fixture
def saved(tmp_path, small_corpus) -> Path:
    docs, x = small_corpus
    vi = VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=8)
    vi.save(tmp_path / "idx")
    vi.add_documents(docs[:3], x[3:6])  # a logged, not yet compacted change
    vi.close()
    return tmp_path / "idx"


def _snapshot(directory: Path) -> Path:
    return directory / json.loads((directory / "manifest.json").read_text())["snapshot"]


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_byte(path: Path, at: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, culprit",
    [
        (lambda d: (d / "manifest.json").write_text("{not json"), "manifest.json"),
        (lambda d: (d / "manifest.json").write_text('{"format": "x"}'), "manifest.json"),
        (lambda d: _truncate(_snapshot(d), 0.5), "index-000001.faiss"),
        (lambda d: _flip_byte(_snapshot(d), 0.7), "index-000001.faiss"),
        (lambda d: _snapshot(d).unlink(), "index-000001.faiss"),
        (lambda d: (d / "docs.sqlite").unlink(), "docs.sqlite"),
    ],
    ids=[
        "manifest-garbage",
        "manifest-fields",
        "snapshot-truncated",
        "snapshot-flipped",
        "snapshot-missing",
        "docstore-missing",
    ],
)
def test_damaged_files_raise_index_corrupt_error(saved, damage, culprit):
    VectorIndex.load(saved).close()  # intact first
    damage(saved)
    with pytest.raises(IndexCorruptError, match=culprit) as info:
        VectorIndex.load(saved)
    assert isinstance(info.value, ValueError) and info.value.path.name == culprit


@pytest.mark.parametrize("keep", [0.0, 0.3, 0.9])
def test_truncated_docstore_is_rejected(saved, keep):
    for suffix in ("-wal", "-shm"):  # the WAL was checkpointed on close; drop leftovers
        (saved / f"docs.sqlite{suffix}").unlink(missing_ok=True)
    _truncate(saved / "docs.sqlite", keep)
    with pytest.raises(IndexCorruptError, match="docs.sqlite"):
        VectorIndex.load(saved)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no index directory"):
        VectorIndex.load(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError, match="manifest.json missing"):
        VectorIndex.load(tmp_path)


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from ragserve.retrieval import Document, VectorIndex
    vi = VectorIndex.load(sys.argv[1])
    vi.compact_every = int(sys.argv[2])
    rng = np.random.default_rng(int(sys.argv[3]))
    for i in range(100000):
        if i % 4 == 3:
            victim = f"w{int(rng.integers(0, i))}"
            print(f"try del {victim}", flush=True)  # one write: a kill never splits it
            vi.delete_documents([victim])
        else:
            print(f"try add w{i}", flush=True)
            vec = rng.normal(size=(1, vi.dim)).astype("float32")
            vi.add_documents([Document(f"w{i}", f"text {i}")], vec)
        print("ok", flush=True)
    """
)


@pytest.mark.integration
@pytest.mark.parametrize("seed", range(4))
def test_sigkill_during_upserts_loses_no_acknowledged_change(saved, seed):
    rng = np.random.default_rng(seed)
    kill_after = int(rng.integers(5, 60))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(saved), str([3, 7, 1000, 1][seed]), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while sum(line == "ok" for line in lines) < kill_after:
        line = proc.stdout.readline()
        assert line, f"writer exited early with {proc.wait()}"
        lines.append(line.strip())
    os.kill(proc.pid, signal.SIGKILL)  # somewhere inside the next upsert (or just before it)
    proc.wait()
    lines += [line.strip() for line in proc.stdout.read().splitlines()]
    acked = [tuple(t.split()[1:]) for t, ok in pairwise(lines) if ok == "ok"]
    in_flight = lines[-1].split()[1:] if lines[-1].startswith("try") else None

    vi = VectorIndex.load(saved)  # must load, whatever the kill interrupted
    live: set[str] = set()
    for op, doc_id in acked:
        (live.add if op == "add" else live.discard)(doc_id)
    deleted = {doc_id for op, doc_id in acked if op == "del"} - live
    if in_flight is not None:  # it may or may not have landed: either outcome is correct
        live.discard(in_flight[1])
        deleted.discard(in_flight[1])
    ids = sorted(live | deleted)
    found = dict(zip(ids, vi.get_documents(ids), strict=True))
    assert not [d for d in live if found[d] is None], "acknowledged additions lost"
    assert not [d for d in deleted if found[d] is not None], "acknowledged deletions lost"
    vi.check_integrity()
    vi.close()


def test_loads_succeed_while_the_writer_compacts(saved, make_corpus):
    writer = VectorIndex.load(saved)
    writer.compact_every = 1  # a new snapshot + log truncation after every upsert
    docs, x = make_corpus(40, prefix="c")
    failures: list[BaseException] = []

    def write() -> None:
        try:
            for i in range(len(docs)):
                writer.add_documents(docs[i : i + 1], x[i : i + 1])
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    import threading

    thread = threading.Thread(target=write)
    thread.start()
    counts = []
    while thread.is_alive():
        reader = VectorIndex.load(saved)  # may race a compaction: retried, never corrupt
        counts.append(reader.num_documents)
        reader.close()
    thread.join()
    assert not failures and counts
    assert all(600 <= c <= 640 for c in counts)
    final = VectorIndex.load(saved)
    assert final.num_documents == 640
    final.check_integrity()
    writer.close()


SAVER = textwrap.dedent(
    """
    import sys, numpy as np
    from pathlib import Path
    from ragserve.retrieval import Document, VectorIndex
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 8)).astype("float32")
    docs = [Document(f"d{i}", "t") for i in range(300)]
    for i in range(1000):
        vi = VectorIndex.from_vectors(docs, x, embedder_name="synthetic", nlist=4)
        vi.save(Path(sys.argv[1]) / f"idx{i}")
        vi.close()
        print("saved", i, flush=True)
    """
)


@pytest.mark.integration
def test_sigkill_during_save_never_leaves_a_half_index(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for _ in range(3):
        assert proc.stdout.readline().startswith("saved")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = [p for p in tmp_path.iterdir() if p.name.startswith("idx")]
    assert len(saved) >= 3
    for path in saved:  # every folder under its final name is a complete, loadable index
        index = VectorIndex.load(path)
        assert index.num_documents == 300
        index.close()
