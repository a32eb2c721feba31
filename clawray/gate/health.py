"""Cheap health checks on a policy's replies (the policy gate's shadow evaluation).

A bad update often shows before any judge reads it: replies collapse into punctuation
(``",",",…``, what the demo's first preference once produced), into one word repeated, into
nothing, or grow to the length limit. These checks measure that on a set of replies, with no
model: the share that reads as text, the share that is empty, the length distribution, and the
share of tool calls that parse.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from clawray.models.tool_calls import TOOL_CALL_END, TOOL_CALL_START, parse_tool_calls

# a token of text: optional opening punctuation, a core, optional closing punctuation
_TOKEN = re.compile(r"^[(\[\"'“‘¿¡*_`]*(?P<core>.+?)[.,!?;:)\]\"'”’…%*_`]*$")
_NUMBER = re.compile(r"[+-]?\d+(?:[.,:/]\d+)*")
MAX_WORD_LETTERS = 20  # longer runs of letters are words glued together


def _core(token: str) -> str:
    m = _TOKEN.match(token)
    return m.group("core") if m else token


def _word_like(token: str) -> bool:
    """A number, or words joined by ' or - , each all letters, at most 20 of them, cased as
    words are (lower, Title or UPPER: no ``youK``); scripts without spaces pass."""
    core = _core(token)
    if _NUMBER.fullmatch(core) or any(ord(c) >= 0x2E80 for c in core):
        return True
    parts = re.split(r"['’-]", core)
    return all(p.isalpha() and len(p) <= MAX_WORD_LETTERS
               and (p.islower() or p.istitle() or p.isupper()) for p in parts)


def readable(text: str) -> bool:
    """Whether ``text`` reads as text: valid tool-call blocks aside, no stray tool-call markup,
    at least 70% of its space-separated tokens are words or numbers (``_word_like``), and
    (from 6 tokens on) no single word makes up more than half of them. Empty text is not
    readable; a reply of valid tool calls only is."""
    content, calls = parse_tool_calls(text) if TOOL_CALL_START in text else (text, [])
    content = (content or "").strip()
    if TOOL_CALL_START in content or TOOL_CALL_END in content:
        return False
    tokens = content.split()
    if not tokens:
        return bool(calls)
    if sum(map(_word_like, tokens)) < 0.7 * len(tokens):
        return False
    if len(tokens) >= 6:
        words = [_core(t).lower() for t in tokens]
        if Counter(words).most_common(1)[0][1] > 0.5 * len(words):
            return False
    return True


def tool_calls_valid(text: str) -> tuple[int, int]:
    """(tool-call blocks opened, those that parse) in ``text``."""
    opened = text.count(TOOL_CALL_START)
    if not opened:
        return 0, 0
    _, calls = parse_tool_calls(text)
    return opened, min(len(calls), opened)


@dataclass(frozen=True)
class Health:
    """Health of one set of replies."""

    n: int
    readable_rate: float
    empty_rate: float
    median_tokens: float
    p90_tokens: float
    tool_calls: int
    tool_call_valid_rate: float | None  # None when no reply opened a tool call
    broken_tool_call_rate: float  # share of replies holding a tool call that does not parse

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def health(texts: Sequence[str], token_counts: Sequence[int]) -> Health:
    """The health of replies ``texts`` of ``token_counts`` tokens each."""
    if len(texts) != len(token_counts):
        raise ValueError(f"{len(texts)} texts but {len(token_counts)} token counts")
    if not texts:
        raise ValueError("health of no replies: the evaluation set is empty")
    n = len(texts)
    opened = valid = broken = 0
    for t in texts:
        o, v = tool_calls_valid(t)
        opened, valid, broken = opened + o, valid + v, broken + (v < o)
    lengths = sorted(token_counts)
    return Health(
        n=n,
        readable_rate=sum(readable(t) for t in texts) / n,
        empty_rate=sum(not t.strip() for t in texts) / n,
        median_tokens=float(statistics.median(lengths)),
        p90_tokens=float(lengths[min(n - 1, int(0.9 * n))]),
        tool_calls=opened,
        tool_call_valid_rate=valid / opened if opened else None,
        broken_tool_call_rate=broken / n,
    )


def health_problems(candidate: Health, incumbent: Health | None, *, min_readable: float,
                    max_empty: float, max_length_ratio: float, max_broken_tool_calls: float,
                    reference_readable: float | None = None) -> list[str]:
    """Why ``candidate``'s replies are unhealthy (none: healthy). The length check compares
    with the incumbent's replies to the same prompts. Readable replies must be at least
    ``min_readable``, or, on a set the reference policy itself reads poorly on (code, say),
    at most 10 points below ``reference_readable`` (the first incumbent's rate on the set:
    a fixed anchor, so versions cannot creep down 10 points at a time)."""
    problems = []
    floor = min_readable if reference_readable is None else min(min_readable,
                                                                reference_readable - 0.1)
    if candidate.readable_rate < floor - 1e-9:
        problems.append(f"readable replies {candidate.readable_rate:.0%} < {floor:.0%}"
                        + (f" (the reference's {reference_readable:.0%})"
                           if reference_readable is not None else ""))
    if candidate.empty_rate > max_empty:
        problems.append(f"empty replies {candidate.empty_rate:.0%} > {max_empty:.0%}")
    if incumbent is not None:
        a, b = max(candidate.median_tokens, 1.0), max(incumbent.median_tokens, 1.0)
        if max(a / b, b / a) > max_length_ratio:
            problems.append(f"median reply length {candidate.median_tokens:g} tokens against "
                            f"the incumbent's {incumbent.median_tokens:g} (more than "
                            f"{max_length_ratio:g}x apart)")
    # per reply, not per call: one broken call among 40 replies is noise, one in three a
    # policy that lost its tool-call format
    if candidate.broken_tool_call_rate > max_broken_tool_calls:
        problems.append(f"replies with a tool call that does not parse "
                        f"{candidate.broken_tool_call_rate:.0%} > {max_broken_tool_calls:.0%}")
    return problems
