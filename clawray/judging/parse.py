r"""Read judge outputs: ``\boxed{…}`` verdicts, OPD hints, and the majority of valid votes.

Which box is the verdict. The last verdict box wins, where a box is *not* a verdict (it is a
mention of the format, e.g. the judge quoting the prompt while thinking) when:

(a) it lies inside an echoed format-examples section: the text from a copy of the prompt's
    ``EXAMPLES_START`` marker up to the next ``EXAMPLES_END`` marker is ignored;
(b) it is glossed: right after it on the same line (past closing quotes, backticks, brackets)
    comes ``means``, ``meaning``, ``stands for``, ``indicates``, ``would mean``, ``is for``,
    ``=``, ``if`` or ``when`` (the prompt writes its examples as ``\boxed{1} means progress``;
    a judge reasoning aloud writes "answer \boxed{1} if the user moved on");
(c) it is part of an enumeration: two or more boxes joined only by ``,``, ``/``, ``or`` or
    ``and`` (``\boxed{1}, \boxed{-1} or \boxed{0}``) are all mentions.

Anything else cannot be told apart from a verdict, so it counts, and the last one wins: a judge
that writes its verdict and then quotes a bare example after it is read by the example. If the
winning box holds an invalid value the output is a parse failure (None); an earlier box is
never used instead.

Accepted values (after stripping whitespace and ``\text{}``-style wrappers): ``1 +1 -1 0 -0
+0`` with an optional ``.0…`` fraction (so ``1.0``, ``+1.0``, ``-1.0``, ``0.0``); a Unicode
minus counts as ``-``. Anything else (``2``, ``yes``, ``0.5``, empty) is invalid.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Sequence

from clawray.judging.prompts import EXAMPLES_END, EXAMPLES_START, HINT_END, HINT_START

_BOX = re.compile(r"\\boxed\s*\{")
_VALUE = re.compile(r"[+-]?[01](?:\.0+)?")
_WRAPPER = re.compile(r"^\\(?:text|textbf|mathrm|mathbf|bf|rm)\s*\{(.*)\}$", re.S)
_GLOSS = re.compile(
    r"""^[\s"'`’”)\]*]*(?:means\b|meaning\b|stands\s+for\b|indicates\b|would\s+mean\b|"""
    r"""is\s+for\b|=|if\b|when\b)""", re.I)
_ENUM_SEP = re.compile(r"^\s*[\"'`’”]*\s*(?:,|/|,?\s*(?:or|and))\s*[\"'`‘“]*\s*$", re.I)


@dataclasses.dataclass
class Box:
    start: int  # offset of "\boxed"
    end: int  # offset just past the closing brace
    content: str


def find_boxes(text: str) -> list[Box]:
    r"""Every complete ``\boxed{…}`` (nested braces matched); an unclosed box is skipped."""
    boxes = []
    for m in _BOX.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            boxes.append(Box(m.start(), i, text[m.end():i - 1]))
    return boxes


def box_value(content: str) -> int | None:
    """The vote a box's content stands for, or None when it is not a valid vote."""
    s = content.strip()
    while True:  # unwrap {…} and \text{…}-style wrappers
        m = _WRAPPER.match(s)
        if m:
            s = m.group(1).strip()
        elif s.startswith("{") and s.endswith("}"):
            s = s[1:-1].strip()
        else:
            break
    s = s.replace("\u2212", "-").replace(" ", "")
    if not _VALUE.fullmatch(s):
        return None
    return int(float(s)) or 0  # -0 → 0


def strip_examples(text: str) -> str:
    """``text`` without echoed format-examples sections (start marker … end marker)."""
    out, pos = [], 0
    while True:
        start = text.find(EXAMPLES_START, pos)
        if start < 0:
            break
        end = text.find(EXAMPLES_END, start)
        if end < 0:
            break
        out.append(text[pos:start])
        pos = end + len(EXAMPLES_END)
    out.append(text[pos:])
    return "".join(out)


def verdict_boxes(text: str) -> list[Box]:
    """The boxes of ``text`` that count as verdicts under rules (a)-(c) of the module doc."""
    text = strip_examples(text)
    boxes = find_boxes(text)
    mention = [False] * len(boxes)
    for i, box in enumerate(boxes):
        line_rest = text[box.end:].split("\n", 1)[0]
        if _GLOSS.match(line_rest):
            mention[i] = True
        if i + 1 < len(boxes) and _ENUM_SEP.match(text[box.end:boxes[i + 1].start]):
            mention[i] = mention[i + 1] = True
    return [b for b, m in zip(boxes, mention) if not m]


def parse_vote(text: str) -> int | None:
    r"""The judge's vote (-1, 0 or 1) from its last verdict box; None on a parse failure."""
    boxes = verdict_boxes(text or "")
    return box_value(boxes[-1].content) if boxes else None


def parse_hint_vote(text: str, max_chars: int = 600) -> tuple[int | None, str | None]:
    """An OPD judge output as (vote, hint).

    The hint is the text between the last ``[HINT_START]`` and the ``[HINT_END]`` after it,
    stripped and cut to ``max_chars``; None when missing, unterminated or empty. The vote is
    read with the hints taken out, so a box inside a hint cannot count.
    """
    text = strip_examples(text or "")
    hint = None
    start = text.rfind(HINT_START)
    if start >= 0:
        end = text.find(HINT_END, start)
        if end >= 0:
            body = text[start + len(HINT_START):end].strip()
            hint = body[:max_chars].rstrip() or None
    without_hints = re.sub(re.escape(HINT_START) + r".*?" + re.escape(HINT_END), " ", text,
                           flags=re.S)
    return parse_vote(without_hints), hint


@dataclasses.dataclass
class VoteResult:
    score: int  # -1, 0 or 1
    votes: list[int]  # the valid votes
    parse_failures: int
    raw: list[str] = dataclasses.field(default_factory=list)


def aggregate(votes: Sequence[int | None], raw: Sequence[str] = ()) -> VoteResult:
    """Majority of the valid votes; a tie for the most votes, or no valid vote, gives 0.

    Unparseable votes (None) are counted as parse failures, never as a 0 vote.
    """
    valid = [v for v in votes if v is not None]
    if any(v not in (-1, 0, 1) for v in valid):
        raise ValueError(f"votes must be -1, 0, 1 or None, got {list(votes)}")
    score = 0
    ranked = Counter(valid).most_common()
    if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]):
        score = ranked[0][0]
    return VoteResult(score=score, votes=valid, parse_failures=len(votes) - len(valid),
                      raw=list(raw))


def tally(outputs: Sequence[str]) -> VoteResult:
    """Parse each PRM judge output and aggregate the votes."""
    return aggregate([parse_vote(t) for t in outputs], raw=outputs)
