"""On-disk layout of a saved index, atomic writes and integrity checks.

```
DIR/manifest.json        format, dims, kind, metric, embedder, versions, counts, snapshot
                         file name + sha256 + the last log seq it covers   (atomic replace)
DIR/index-<gen>.faiss    Faiss snapshot (write tmp → fsync → rename → fsync DIR)
DIR/docs.sqlite[-wal]    DocStore: passages, vectors, op log (SQLite WAL, synchronous=FULL)
```

A snapshot is deleted only once a newer manifest is durable: a kill at any moment leaves a
manifest whose snapshot exists and matches its checksum.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FORMAT = "ragserve-ivf"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DOCSTORE = "docs.sqlite"
SNAPSHOT_LOCK = "snapshot.lock"
_REQUIRED = ("format", "format_version", "dim", "kind", "metric", "nlist", "embedder", "snapshot")
_REQUIRED += ("snapshot_sha256", "applied_seq")  # manifest fields a load needs


class IndexCorruptError(ValueError):
    """A saved index file is missing, truncated or corrupt; `path` names the file."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(f"corrupt or unreadable index file {path}: {reason}")
        self.path = Path(path)


def snapshot_name(generation: int) -> str:
    return f"index-{generation:06d}.faiss"


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries) or a file (its data), by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    atomic_write_bytes(directory / MANIFEST, json.dumps(manifest, indent=2).encode())


def read_manifest(directory: Path) -> dict[str, Any]:
    """Parse and validate `DIR/manifest.json`; a bad file raises `IndexCorruptError`."""
    path = directory / MANIFEST
    if not directory.is_dir():
        raise FileNotFoundError(f"no index directory at {directory}")
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a ragserve index ({MANIFEST} missing)")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IndexCorruptError(path, f"not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or any(key not in manifest for key in _REQUIRED):
        raise IndexCorruptError(path, f"missing fields (need {', '.join(_REQUIRED)})")
    if manifest["format"] != FORMAT or manifest["format_version"] > FORMAT_VERSION:
        raise IndexCorruptError(
            path, f"unsupported format {manifest['format']!r} v{manifest['format_version']}"
        )
    return manifest


def verify_snapshot(directory: Path, manifest: dict[str, Any]) -> Path:
    """The snapshot file the manifest names, after checking it exists and matches its sha256."""
    path = directory / manifest["snapshot"]
    if not path.is_file():
        raise IndexCorruptError(path, "file missing")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != manifest["snapshot_sha256"]:
        raise IndexCorruptError(path, "checksum mismatch (truncated or modified)")
    return path


@contextmanager
def snapshot_lock(directory: Path, *, exclusive: bool) -> Iterator[None]:
    """`DIR/snapshot.lock` (flock): loads hold it shared, a compaction's swap of manifest,
    snapshot and log holds it exclusive. A folder we cannot write to is not locked."""
    try:
        f = open(directory / SNAPSHOT_LOCK, "a")  # noqa: SIM115 - closed below
    except OSError:
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        f.close()  # releases the lock


def remove_stale_files(
    directory: Path, manifest: dict[str, Any], sidecars: Collection[tuple[str, str]] = ()
) -> None:
    """Delete leftover tmp files, snapshots the manifest no longer names, and folders named
    `prefix*` of `sidecars` ((metadata key, prefix)) other than the one it names."""
    keep = manifest.get("metadata") or {}
    for path in directory.iterdir():
        if path.is_dir():
            if any(path.name.startswith(p) and path.name != keep.get(k) for k, p in sidecars):
                shutil.rmtree(path, ignore_errors=True)
            continue
        stale_snapshot = path.name.startswith("index-") and path.name != manifest["snapshot"]
        if path.name.endswith(".tmp") or stale_snapshot:
            path.unlink(missing_ok=True)


def scratch_dir(directory: Path) -> Path:
    """A fresh ``.NAME.tmp-PID`` folder beside ``directory`` (absent or empty, else
    ``FileExistsError``) to fill, then ``publish_dir``; dead writers' leftovers are removed."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} exists and is not empty")
    directory.parent.mkdir(parents=True, exist_ok=True)
    for old in directory.parent.glob(f".{directory.name}.tmp-*"):
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _is_alive(int(pid))):
            shutil.rmtree(old, ignore_errors=True)
    tmp = directory.parent / f".{directory.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, directory: Path) -> None:
    """Rename the filled ``tmp`` to ``directory`` (absent or empty), then fsync the parent."""
    if directory.exists():
        directory.rmdir()
    os.rename(tmp, directory)
    fsync_dir(directory.parent)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class JsonFile:
    """A dataclass saved as JSON atomically (``save``), read back by its ``from_json``."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def save(self, path: Path) -> None:
        atomic_write_bytes(Path(path), self.to_json().encode())

    @classmethod
    def load(cls, path: Path) -> Any:
        return cls.from_json(Path(path).read_text())


def write_dir_atomically(directory: Path, name: str, fill: Callable[[Path], None]) -> None:
    """Write ``directory/name/`` atomically: ``fill(tmp)`` fills a fresh folder, whose files are
    fsync'd before it replaces any old one by rename."""
    tmp = directory / f"{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fill(tmp)
    for path in tmp.iterdir():
        fsync_dir(path)
    fsync_dir(tmp)
    final = directory / name
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    fsync_dir(directory)
