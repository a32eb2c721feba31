"""Crash-safe file writes: a file is either its old contents or its new ones, never half.

Used wherever clawray keeps state on disk (the buffer's segments and checkpoint, curricula,
the environment adapter, per-user adapters, the gate's payloads, a hub's compacted journal,
hashed system prompts, the transformers engine's spilled LoRA adapters)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable


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
