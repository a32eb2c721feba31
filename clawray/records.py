"""TurnRecord: what the ingress captures of every main turn, and the sinks it goes to.

A record holds the exact ids the engine consumed and produced, so a sample built from it is
token-exact: ``prompt_ids`` is the chat template applied to the request, ``response_ids`` are
the sampled ids (including the stop token), with one raw log-prob per id.

Sinks receive records off the response path: ``RecordSink.put`` must not block (the JSONL sink
hands lines to a writer thread). The session pipeline is one too: ``HubSink``
(``clawray/sessions/pipeline.py``) sends each record to its session's ``SessionHub`` actor
(``clawray/sessions/hub.py``), fire-and-forget.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Protocol

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TurnRecord:
    record_id: str  # the OpenAI response id (chatcmpl-...), plus "#i" for choice i > 0
    session_id: str
    session_id_source: str  # header | body | affinity | prompt_cache_key | derived
    turn_type: str  # main | side
    session_done: bool
    model: str
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str  # stop | length | tool_calls | abort
    policy_version: int
    policy_version_end: int | None
    messages: list[dict[str, Any]]  # the request's messages, normalized (what was templated)
    tools: list[dict[str, Any]] | None
    sampling: dict[str, Any]
    response_text: str | None
    tool_calls: list[dict[str, Any]]
    choice_index: int = 0
    created_at: float = dataclasses.field(default_factory=time.time)
    finished_at: float = 0.0
    started_at: float = 0.0  # when the request arrived (precise; created_at is whole seconds)
    retry: bool = False  # the client marked it a retry (x-stainless-retry-count > 0)
    # The policy version that sampled each response token (None in records written before
    # per-token versions: every token is then on policy_version).
    response_versions: list[int] | None = None
    # Whose session (clawray/serve/session_meta.py): the API key's tenant id and the end user
    # the client named; the session pipeline keys sessions by tenant, user and session id.
    tenant: str = "local"
    user: str | None = None

    def session_key(self) -> str:
        return session_key(self.tenant, self.user, self.session_id)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TurnRecord":
        return cls(**data)


def namespace(tenant: str, user: str | None = None) -> str:
    """The prefix of every session key of ``tenant`` (and ``user``): unambiguous, as a tenant id
    has no ``|`` and the user's length is spelled out."""
    return f"{tenant}|{len(user)}:{user}|" if user else f"{tenant}||"


def session_key(tenant: str, user: str | None, session_id: str) -> str:
    """A session's key in the session pipeline: unique across tenants and their users."""
    return namespace(tenant, user) + session_id


def tenant_prefix(tenant: str) -> str:
    """The prefix every session key of ``tenant`` starts with, whichever its user."""
    return f"{tenant}|"


class RecordSink(Protocol):
    def put(self, record: TurnRecord) -> None:
        """Accept a record without blocking the caller."""
        ...

    def close(self) -> None: ...


class NullSink:
    def put(self, record: TurnRecord) -> None:
        pass

    def close(self) -> None:
        pass


class MemorySink:
    """Keeps the last ``capacity`` records in memory (tests, notebooks)."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.records: deque[TurnRecord] = deque(maxlen=capacity)

    def put(self, record: TurnRecord) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON line per record from a writer thread, flushed after each batch."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._q: queue.SimpleQueue[TurnRecord | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="clawray-jsonl-sink", daemon=True)
        self._thread.start()

    def put(self, record: TurnRecord) -> None:
        self._q.put(record)

    def _run(self) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            while True:
                item = self._q.get()
                batch = [item]
                while not self._q.empty():
                    batch.append(self._q.get())
                for rec in batch:
                    if rec is not None:
                        f.write(json.dumps(rec.to_dict(), ensure_ascii=False) + "\n")
                f.flush()
                if None in batch:
                    return

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)


class TeeSink:
    """Hands each record to several sinks; one failing sink does not starve the others."""

    def __init__(self, sinks: list[RecordSink]) -> None:
        self.sinks = sinks

    def put(self, record: TurnRecord) -> None:
        for sink in self.sinks:
            try:
                sink.put(record)
            except Exception:
                logger.exception("record sink %s failed for %s", type(sink).__name__,
                                 record.record_id)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def read_jsonl_records(path: str | Path) -> list[TurnRecord]:
    p = Path(path).expanduser()
    if not p.exists():
        return []
    with p.open(encoding="utf-8") as f:
        return [TurnRecord.from_dict(json.loads(line)) for line in f if line.strip()]


def make_sink(kind: str, records_path: str) -> RecordSink:
    """Build the sink named in ``serving.record_sink``."""
    if kind == "jsonl":
        return JsonlSink(records_path)
    if kind == "memory":
        return MemorySink()
    if kind == "none":
        return NullSink()
    if ":" in kind:
        module, _, attr = kind.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        return factory()
    raise ValueError(
        f"unknown record sink {kind!r}: use 'jsonl', 'memory', 'none' or 'module:factory'"
    )


class GatedSink:
    """Hands records to ``sink`` only while ``is_open()``; the operator's collecting switch."""

    def __init__(self, sink: RecordSink, is_open: Callable[[], bool]) -> None:
        self.sink = sink
        self.is_open = is_open
        self.dropped = 0

    def put(self, record: TurnRecord) -> None:
        if self.is_open():
            self.sink.put(record)
        else:
            self.dropped += 1

    def close(self) -> None:
        self.sink.close()
