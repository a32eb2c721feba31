"""CPU profiles of serving processes under load, with py-spy (``bench/serving.py --profile-s``).

Profiling runs in a separate, unmeasured pass after a setup's measurements: py-spy samples the
target at 100 Hz (``--nonblocking``, active samples only) and itself needs CPU, which on a
2-core machine would distort the timed numbers. The raw collapsed stacks are kept next to the
results; the summary lists where the process spends its CPU, by leaf function (self) and by
any function on the stack (inclusive).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str | None:
    """The py-spy executable next to this Python, or on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    return str(local) if local.exists() else shutil.which("py-spy")


def start(pid: int, duration_s: float, out: Path) -> subprocess.Popen | None:
    exe = py_spy()
    if exe is None or pid <= 0:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(duration_s)),
                             "--rate", "100", "--nonblocking", "--format", "raw",
                             "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _short(frame: str) -> str:
    """``func (path/to/module.py:12)`` -> ``func (module.py)``; folds line numbers together."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    parts = m["file"].split("/")
    generic = parts[-1] in ("__init__.py", "main.py", "utils.py")
    where = "/".join(parts[-2:]) if generic else parts[-1]
    return f"{m['func']} ({where})"


def summarize(raw: Path, top: int = 25) -> dict[str, Any]:
    """Self and inclusive sample shares of the collapsed stacks in ``raw``."""
    self_counts: Counter[str] = Counter()
    incl_counts: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [_short(f) for f in stack.split(";")]
        # The first frames name the process/thread; keep Python frames only.
        frames = [f for f in frames if "(" in f]
        if not frames:
            continue
        total += n
        self_counts[frames[-1]] += n
        for f in set(frames):
            incl_counts[f] += n

    def share(c: Counter[str]) -> list[list[Any]]:
        return [[name, round(100.0 * n / total, 1)] for name, n in c.most_common(top)]

    return {"samples": total, "self_pct": share(self_counts) if total else [],
            "inclusive_pct": share(incl_counts) if total else []}


def finish(proc: subprocess.Popen | None, raw: Path) -> dict[str, Any] | None:
    if proc is None:
        return None
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 0 or not raw.exists():
        return {"error": (err or b"").decode(errors="replace")[-500:]}
    return {"raw": str(raw), **summarize(raw)}
