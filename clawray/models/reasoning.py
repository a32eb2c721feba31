"""Split a reply into its reasoning (``<think>…</think>``) and its content.

Models of the Qwen3 / DeepSeek-R1 family write their reasoning first, between ``<think>`` and
``</think>``, then the answer. The APIs carry the two apart (Chat Completions'
``reasoning_content``, a Responses ``reasoning`` item, an Anthropic ``thinking`` block); the
record keeps the exact token ids of both, as sampled.

Rules (the same for the whole text and for any split of it into stream deltas):

- the reply opens reasoning when it starts, after optional whitespace, with ``<think>``, or
  when the prompt itself ended inside an open ``<think>`` (``starts_in_reasoning``: templates
  that prefill it);
- reasoning ends at the first ``</think>``; the content is what follows, without its leading
  whitespace; a reasoning never closed (cut by ``max_tokens``) leaves no content;
- a reply that does not open reasoning is all content, ``<think>`` anywhere later included.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, starts_in_reasoning: bool = False) -> tuple[str | None, str]:
    """``(reasoning or None, content)`` of a finished reply."""
    parser = ReasoningParser(starts_in_reasoning)
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
    content = "".join(t for kind, t in pieces if kind == "content")
    return (reasoning if parser.had_reasoning else None), content


class ReasoningParser:
    """Streaming: ``feed`` text deltas, get ``("reasoning" | "content", text)`` pieces."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self.state = "reasoning" if starts_in_reasoning else "start"
        self.had_reasoning = starts_in_reasoning
        self.held = ""  # text that may still turn out to be a tag

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        while self.held:
            if self.state == "start":
                stripped = self.held.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self.had_reasoning = "reasoning", True
                    self.held = stripped[len(OPEN):]
                    continue
                if OPEN.startswith(stripped):  # whitespace, or a prefix of the tag: wait
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                end = self.held.find(CLOSE)
                if end >= 0:
                    if end:
                        out.append(("reasoning", self.held[:end]))
                    self.held = self.held[end + len(CLOSE):]
                    self.state = "after"
                    continue
                keep = _partial_suffix(self.held, CLOSE)
                if len(self.held) > keep:
                    out.append(("reasoning", self.held[:len(self.held) - keep]))
                    self.held = self.held[len(self.held) - keep:]
                break
            if self.state == "after":  # the content's leading whitespace is dropped
                stripped = self.held.lstrip()
                if not stripped:
                    self.held = ""
                    break
                self.held, self.state = stripped, "content"
                continue
            out.append(("content", self.held))
            self.held = ""
        return out

    def finish(self) -> list[tuple[str, str]]:
        """What was held back, at the end of the reply."""
        held, self.held = self.held, ""
        if not held:
            return []
        if self.state == "reasoning":
            return [("reasoning", held)]
        if self.state == "start":  # only whitespace or a lone tag prefix: it is content
            return [("content", held)]
        return [] if self.state == "after" else [("content", held)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def has_think_tokens(tokenizer: object) -> bool:
    """Whether the tokenizer knows ``<think>`` and ``</think>`` as tokens of their own."""
    vocab = getattr(tokenizer, "get_vocab", lambda: {})()
    return OPEN in vocab and CLOSE in vocab
