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
import hashlib
import json
import logging
import pkgutil
import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Protocol

from clawray.files import write_atomic

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
    # Whose policy serves and learns from the turn (per-user policies): "<tenant>/<user>" for
    # an end user a trusted app named, else the tenant (``session_meta.policy_user``).
    policy_user: str | None = None

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


class TextStore:
    """Content-addressed texts (``<sha256>.txt`` in a folder), each written once."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        self._known: set[str] = set()

    def put(self, text: str) -> str:
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest not in self._known:
            path = self.folder / f"{digest}.txt"
            if not path.exists():
                self.folder.mkdir(parents=True, exist_ok=True)
                write_atomic(path, lambda f: f.write(text.encode("utf-8")))
            self._known.add(digest)
        return digest

    def get(self, digest: str) -> str:
        return (self.folder / f"{digest}.txt").read_text(encoding="utf-8")


def prompt_store_of(records_path: str | Path) -> Path:
    """Where a JSONL record file keeps its system prompts by hash."""
    p = Path(records_path).expanduser()
    return p.with_name(p.name + ".prompts")


def externalize_system_prompts(data: dict[str, Any], store: TextStore) -> dict[str, Any]:
    """A record dict whose system messages hold ``content_sha256`` instead of their text (the
    text goes to ``store`` once): agent system prompts are tens of KB, resent every turn."""
    messages = []
    for m in data["messages"]:
        if m.get("role") == "system" and isinstance(m.get("content"), str):
            text = m["content"]
            m = {k: v for k, v in m.items() if k != "content"}
            m["content_sha256"] = store.put(text)
        messages.append(m)
    return {**data, "messages": messages}


def internalize_system_prompts(data: dict[str, Any], store: TextStore | None) -> dict[str, Any]:
    """The inverse of ``externalize_system_prompts`` (a record without hashes is unchanged)."""
    if not any("content_sha256" in m for m in data.get("messages", [])):
        return data
    if store is None:
        raise ValueError("the record keeps its system prompt by hash, but no prompt store "
                         "was given")
    messages = []
    for m in data["messages"]:
        if "content_sha256" in m:
            digest = m["content_sha256"]
            m = {k: v for k, v in m.items() if k != "content_sha256"}
            m["content"] = store.get(digest)
        messages.append(m)
    return {**data, "messages": messages}


class JsonlSink:
    """Appends one JSON line per record from a writer thread, flushed after each batch.

    ``system_prompt="hash"`` keeps each distinct system prompt once, in ``<path>.prompts/``,
    and records its SHA-256 (``read_jsonl_records`` puts the text back)."""

    def __init__(self, path: str | Path, system_prompt: str = "inline") -> None:
        if system_prompt not in ("inline", "hash"):
            raise ValueError(f"system_prompt must be 'inline' or 'hash', got {system_prompt!r}")
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.store = TextStore(prompt_store_of(self.path)) if system_prompt == "hash" else None
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
                        data = rec.to_dict()
                        if self.store is not None:
                            data = externalize_system_prompts(data, self.store)
                        f.write(json.dumps(data, ensure_ascii=False) + "\n")
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
    """The records of a JSONL sink file, system prompts kept by hash put back."""
    p = Path(path).expanduser()
    if not p.exists():
        return []
    store = TextStore(prompt_store_of(p)) if prompt_store_of(p).exists() else None
    with p.open(encoding="utf-8") as f:
        return [TurnRecord.from_dict(internalize_system_prompts(json.loads(line), store))
                for line in f if line.strip()]


def make_sink(kind: str, records_path: str, system_prompt: str = "inline") -> RecordSink:
    """Build the sink named in ``serving.record_sink``."""
    if kind == "jsonl":
        return JsonlSink(records_path, system_prompt)
    if kind == "memory":
        return MemorySink()
    if kind == "none":
        return NullSink()
    if ":" in kind:
        return pkgutil.resolve_name(kind)()
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
