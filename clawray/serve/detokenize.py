"""Streaming text from streamed token ids, equal to decoding all ids at once.

``IncrementalDetokenizer`` is the ``tokenizers`` library's own incremental decoder
(``tokenizers.decoders.DecodeStream``): byte-level BPE tokens can end inside a multi-byte
character, and it releases text only once the character is whole. ``finish()`` checks the
streamed text against ``tokenizer.decode(all_ids, skip_special_tokens=True)`` and releases
whatever the full decoding has beyond it, so no text is ever lost. ``StopCutter`` holds back
just enough text that a stop string split over several tokens is never streamed, and cuts the
final text before the first stop string.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class IncrementalDetokenizer:
    """Text deltas of a stream of ids, for a Hugging Face tokenizer backed by ``tokenizers``
    (``tokenizer.backend_tokenizer``; every tokenizer clawray loads is one)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer):
            raise TypeError(f"streaming needs a tokenizer backed by the tokenizers library "
                            f"(a 'fast' tokenizer); got {type(tokenizer).__name__}")
        self._tok = tokenizer
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.text = ""

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        pieces = [self._stream.step(self._backend, int(i)) for i in new_ids]
        delta = "".join(p for p in pieces if p)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The text of the ids not released yet; the streamed text then equals the full
        decoding (or, should the two ever disagree, the full decoding's text beyond the
        streamed length is still released, and the disagreement logged)."""
        full = self._tok.decode(self.ids, skip_special_tokens=True)
        if not full.startswith(self.text):
            logger.warning("streamed text differs from the full decoding of the same ids "
                           "(%d ids): streamed %r, decoded %r", len(self.ids), self.text[-80:],
                           full[-80:])
        delta = full[len(self.text):]
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
