"""HubJournal: a SessionHub's pending turns on disk, so a restarted hub resumes them.

Every main-turn record and every feedback call a hub accepts is appended (JSON lines) before
the hub acts on it; once the sample buffer has acknowledged all rows of a turn as durable, a
``done`` line follows. A hub that starts on an existing journal replays, in order, the records
and feedback of turns not done, with their original times: their sessions, next states and
judgments come back (a turn in flight to the judges is judged again), and the idle timeout
finalizes what no later request will continue. A row written just before a crash whose ``done``
line was lost is written again on replay and dropped by the buffer's ``sample_id`` filter: one
row per served turn.

Lines are flushed at once and fsync'd by ``sync`` (the hub calls it every tick: a turn is
durable within ``sessions.journal_sync_s`` of being served). The file is rewritten with only
live entries when most of it is done.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from clawray.files import write_atomic

logger = logging.getLogger(__name__)

COMPACT_BYTES = 64 * 2**20  # rewrite once the file is this big and mostly done


def _line(entry: dict[str, Any]) -> str:
    return json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n"


class HubJournal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.live: dict[str, None] = {}  # record ids journaled and not done, in order
        self._dirty = False
        self._drop_cut_tail()
        self._file = open(self.path, "a", encoding="utf-8")

    def _drop_cut_tail(self) -> None:
        """A line cut by a crash was never acknowledged: remove it before appending."""
        if not self.path.exists() or not self.path.stat().st_size:
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data.endswith(b"\n"):
                return
            keep = data.rfind(b"\n") + 1
            logger.warning("journal %s: dropping a cut last line (%d bytes)", self.path,
                           len(data) - keep)
            f.truncate(keep)

    # ---------------------------------------------------------------- writing
    def record(self, record: dict[str, Any], now: float) -> None:
        self._append({"t": now, "record": record})
        self.live[record["record_id"]] = None

    def feedback(self, now: float, **call: Any) -> None:
        self._append({"t": now, "feedback": call})

    def done(self, record_ids: list[str]) -> None:
        ids = [r for r in record_ids if r in self.live]
        if not ids:
            return
        self._append({"done": ids})
        for r in ids:
            del self.live[r]

    def _append(self, entry: dict[str, Any]) -> None:
        self._file.write(_line(entry))
        self._file.flush()
        self._dirty = True

    def sync(self) -> None:
        """fsync what was appended (the hub's tick); compact when mostly done."""
        if self._dirty:
            os.fsync(self._file.fileno())
            self._dirty = False
        size = self._file.tell()
        if size > COMPACT_BYTES and len(self.live) * 4 * 2**10 < size // 2:
            self.compact()

    # ---------------------------------------------------------------- reading
    def replay(self) -> Iterator[dict[str, Any]]:
        """The entries of turns not done, in order (records and feedback); fills ``live``."""
        entries, done = [], set()
        for entry in self._read():
            if "done" in entry:
                done.update(entry["done"])
            else:
                entries.append(entry)
        self.live = {}
        out = []
        for entry in entries:
            if "record" in entry:
                rid = entry["record"]["record_id"]
                if rid in done:
                    continue
                self.live[rid] = None
            out.append(entry)
        return iter(out)

    def _read(self) -> Iterator[dict[str, Any]]:
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.endswith("\n"):  # a write cut by the crash: never acknowledged
                    logger.warning("journal %s: ignoring a cut last line %d", self.path, n)
                    return
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    logger.error("journal %s: line %d is not JSON; skipped", self.path, n)

    def compact(self) -> None:
        """Rewrite the file with only the entries of live turns (and all feedback after the
        oldest of them)."""
        keep = list(self.replay())
        write_atomic(self.path, lambda f: f.writelines(_line(e).encode("utf-8") for e in keep))
        self._file.close()  # appends were flushed at once: nothing of the old file is lost
        self._file = open(self.path, "a", encoding="utf-8")
        logger.info("journal %s compacted: %d live turns", self.path, len(self.live))

    def close(self) -> None:
        self._file.close()
