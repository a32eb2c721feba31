"""Crash-safe file writes: a file is either its old contents or its new ones, never half; a
cached folder (a built or imported model) is built once, whole, under a lock.

Used wherever clawray keeps state on disk (the buffer's segments and checkpoint, curricula,
the environment adapter, per-user adapters, the gate's payloads, a hub's compacted journal,
hashed system prompts, the transformers engine's spilled LoRA adapters)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(final: str | os.PathLike[str], write: Callable[[BinaryIO], Any]) -> int:
    """``write(f)`` into a hidden temp file in ``final``'s folder, fsync it, rename it over
    ``final``, fsync the folder; the bytes written. On failure the temp file is removed and
    ``final`` is untouched."""
    final = Path(final)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)
    return size


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> str:
    """``obj`` as JSON at ``path`` (its folder created), atomically; the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, lambda f: f.write(json.dumps(obj).encode()))
    return str(p)


@contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if missing) across processes (``flock``; where
    there is none, no lock: callers then rely on atomic renames alone)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_folder_once(final: str | os.PathLike[str], build: Callable[[Path], Any],
                      marker: str) -> Path:
    """``final``, built once: ``build(tmp)`` fills a hidden temp folder beside it, which must
    then hold ``marker`` (the build's last file) and is renamed into place. Concurrent
    builders in several processes wait on a lock and find it built; a failed build leaves
    nothing behind; a folder without its marker is never returned."""
    final = Path(final)
    if (final / marker).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(final.parent / f".{final.name}.lock"):
        if (final / marker).exists():  # another process built it while we waited
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
        try:
            build(tmp)
            if not (tmp / marker).exists():
                raise RuntimeError(f"the build of {final.name} did not write {marker}")
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            if final.exists():  # an interrupted build of an older kind: replace it
                shutil.rmtree(final)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
