"""Tokenize a rendered chat prompt piece by piece, with a cache of the pieces.

Agent clients resend the same system prompt, tools and history on every turn: OpenClaw's
60 KB request is ~18k tokens, of which only the last message is new, and tokenizing all of it
costs ~21 ms of CPU per request. A Hugging Face tokenizer splits its input at the added tokens
(``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ...) before any normalizing or BPE, and
encodes the text between two of them on its own. So encoding those segments one by one and
joining them with the added tokens' ids gives exactly the ids of the whole text, and a
segment seen before (the system prompt, a past message) can come from a cache.

:class:`SegmentCache` does that, and proves it per tokenizer: at construction it encodes probe
texts both ways and, if they ever differ (a tokenizer whose added tokens strip neighbouring
spaces, or that adds a prefix space per call), it turns itself off and encodes whole texts.
"""

from __future__ import annotations

import collections
import re
import threading
from typing import Any

# Texts that exercise the boundaries: tokens glued to added tokens, spaces and newlines around
# them, non-ASCII text, tool-call tags (the chat template adds the rest).
_PROBE_MESSAGES = [
    {"role": "system", "content": "You are a terse agent.\n\n  Tools follow.  "},
    {"role": "user", "content": " héllo wörld 👋 — list files in ./src, then stop.\n"},
    {"role": "assistant", "content": "<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n"
                                     "</tool_call>"},
    {"role": "user", "content": "x<|im_end|>y\t\tz  "},
]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "List a folder.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


class SegmentCache:
    """``encode(text)`` equal to ``tokenizer.encode(text, add_special_tokens=False)``, with the
    text between added tokens cached (LRU, at most ``max_entries`` segments, only segments of
    at least ``min_chars`` characters). Thread-safe."""

    def __init__(self, tokenizer: Any, *, max_entries: int = 4096, min_chars: int = 64,
                 probe_texts: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self.min_chars = min_chars
        self._cache: collections.OrderedDict[str, tuple[int, ...]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        added = {tok: idx for tok, idx in tokenizer.get_added_vocab().items() if tok}
        self._added = added
        self._split = (re.compile("(" + "|".join(re.escape(t) for t in sorted(
            added, key=len, reverse=True)) + ")") if added else None)
        texts = list(probe_texts or []) + [self._probe_text()]
        self.enabled = self._split is not None and all(
            self._segmented(t, cache=False) == self._whole(t) for t in texts if t)
        self.reason = None if self.enabled else (
            "the tokenizer has no added tokens" if self._split is None
            else "segmented and whole encodings differ on a probe text")

    def _probe_text(self) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                _PROBE_MESSAGES, tools=_PROBE_TOOLS, add_generation_prompt=True, tokenize=False)
        except Exception:  # noqa: BLE001 - no usable template: probe the raw contents
            return "\n".join(m["content"] for m in _PROBE_MESSAGES)

    def _whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return self._segmented(text, cache=True) if self.enabled else self._whole(text)

    def _segmented(self, text: str, *, cache: bool) -> list[int]:
        assert self._split is not None
        ids: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # an added token (the split keeps the separators at odd indices)
                ids.append(self._added[part])
            elif part:
                ids.extend(self._segment(part) if cache else self._whole(part))
        return ids

    def _segment(self, part: str) -> tuple[int, ...] | list[int]:
        if len(part) < self.min_chars:
            return self._whole(part)
        with self._lock:
            hit = self._cache.get(part)
            if hit is not None:
                self._cache.move_to_end(part)
                self.hits += 1
                return hit
        ids = tuple(self._whole(part))
        with self._lock:
            self.misses += 1
            self._cache[part] = ids
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return ids

    def stats(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "reason": self.reason, "entries": len(self._cache),
                "hits": self.hits, "misses": self.misses}
