"""What several tests share: the test API key, the OpenClaw fixtures, a free port, loading a
script's module, and the
handle on the session's served app (``Served``, made by the ``served`` fixture in conftest)."""

from __future__ import annotations

import dataclasses
import json
import socket
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures" / "openclaw"  # real OpenClaw requests (README.md there):
# session_*.json are Chat Completions requests; openai_responses_* and anthropic_messages_*
# the two other API modes
API_KEY = "sk-clawray-test"
OTHER_KEY = "sk-clawray-other"  # a second tenant of the shared app


class ListSink:
    """A record sink that keeps what it gets (a ``RecordSink`` for tests)."""

    def __init__(self):
        self.records = []

    def put(self, record):
        self.records.append(record)

    def close(self):
        pass


def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def load_file(path: Path, name: str):
    """The module of a file outside the package (``bench/*.py``, ``scripts/*.py``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Served:
    base_url: str
    api_key: str
    model: str
    records_path: Path
    app_name: str
    samples_path: Path | None = None
    config: object = None

    def pipeline(self):
        from clawray.sessions.pipeline import attach_live_pipeline

        return attach_live_pipeline(self.config, self.app_name)

    def samples(self, expected: int = 1, timeout_s: float = 90.0, where=None, **match):
        """Sample rows in the WAL matching ``match`` (column=value) and ``where(row)`` if
        given, flushing the hubs until ``expected`` such rows are there or ``timeout_s``
        passed."""
        import pyarrow.dataset as ds

        pipe = self.pipeline()
        deadline = time.time() + timeout_s
        while True:
            pipe.flush(timeout_s)
            table = ds.dataset(str(self.samples_path), format="parquet").to_table()
            rows = [r for r in table.to_pylist() if all(r[k] == v for k, v in match.items())
                    and (where is None or where(r))]
            if len(rows) >= expected or time.time() > deadline:
                return sorted(rows, key=lambda r: (r["turn"] or 0, r["kind"]))
            time.sleep(0.3)

    def handle(self):
        from ray import serve

        return serve.get_app_handle(self.app_name)

    def records(self, expected: int = 1, timeout_s: float = 60.0, **match):
        """Records matching ``match`` (field=value), waiting until ``expected`` arrived (the
        deadlines of both waits only end a hang: each returns as soon as its rows are there)."""
        from clawray.records import read_jsonl_records

        deadline = time.time() + timeout_s
        while True:
            found = [r for r in read_jsonl_records(self.records_path)
                     if all(getattr(r, k) == v for k, v in match.items())]
            if len(found) >= expected or time.time() > deadline:
                return found
            time.sleep(0.1)


# The RLAnything notebook's live section runs at the "tiny" scale in the suite (20-step warm
# starts: the machinery, in minutes of CPU instead of a quarter of an hour); users run "small".
RLA_NOTEBOOK_SCALE = "tiny"


def die_with_parent() -> None:
    """In a child process: killed when the thread that started it ends (Linux's
    ``PR_SET_PDEATHSIG``), so a killed parent leaves no child running; a no-op elsewhere."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def checks_of(proc) -> dict[str, dict]:
    """A check script's JSON lines (``{"check": name, ...}``) by name, and its exit status and
    stderr's end under ``"stderr"`` (tests/support/multinode.py, twohost.py)."""
    import json

    checks = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            out = json.loads(line)
            checks[out["check"]] = out
    checks["stderr"] = {"rc": proc.returncode, "tail": proc.stderr[-4000:]}
    return checks
