"""Streaming text from streamed token ids, exactly equal to decoding all ids at once.

Byte-level BPE tokens can end inside a multi-byte character, so text is only released once the
decoded window no longer ends in a replacement character; ``finish()`` releases the rest so the
concatenated deltas always equal ``tokenizer.decode(all_ids, skip_special_tokens=True)``.
``StopCutter`` holds back just enough text that a stop string split over several tokens is never
streamed, and cuts the final text before the first stop string.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are released

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd") and after.startswith(before):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def finish(self) -> str:
        full = self._decode(self.ids)
        if full.startswith(self.text):
            delta = full[len(self.text) :]
        else:  # cannot happen for sane tokenizers; never lose text
            delta = ""
        self.text += delta
        return delta


class StopCutter:
    """Filters a text stream so that no part of a stop string is ever emitted."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        self._pending += delta
        cut = first_stop(self._pending, self._stops)
        if cut is not None:
            out, self._pending, self.stopped = self._pending[:cut], "", True
            return out
        if self._hold == 0:
            out, self._pending = self._pending, ""
            return out
        out, self._pending = self._pending[: -self._hold], self._pending[-self._hold :]
        return out

    def finish(self) -> str:
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index of the earliest occurrence of any stop string, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
