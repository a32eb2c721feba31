r"""The shape a judge's output must take, as a constraint the judge's own engine enforces.

A judge served by clawray (the ``JudgeServer``: ``judge.backend='server'``) samples under an
xgrammar structural tag (the constrained decoding of ``inference/grammar.py`` and vLLM's
structured outputs), so every output it writes reads as a verdict: free reasoning, then exactly
one verdict box with nothing after it. The parser (``parse.py``) still reads every output: the
verdict of a constrained output is its one box, and judges that cannot be constrained (a Python
function, an external OpenAI-compatible endpoint) are read as before.

- ``prm``: ``<reasoning>\boxed{v}`` with v in 1, -1, 0;
- ``opd``: ``<reasoning>\boxed{-1}`` or ``<reasoning>\boxed{1}[HINT_START]<hint>[HINT_END]``
  (the hint starts with a visible character, has no brackets or backslash);
- ``step_rm``: ``<reasoning>\boxed{v}`` with v in 1, -1 (the step RM has no neutral score);
- a request with an ``answer_schema`` (the environment rewriter): ``<reasoning>`` then one JSON
  object matching the schema.

The reasoning is printable ASCII, tabs and newlines, without a backslash (so no box can start
inside it), and at most as many characters as ``max_tokens`` leaves after the longest verdict:
a token writes at least one such character, so the verdict always fits in the token budget
and a constrained judge never runs out of tokens before its verdict.
"""

from __future__ import annotations

import json
import re
from typing import Any

from clawray.judging.prompts import HINT_END, HINT_START, JudgeRequest

# Printable ASCII without the backslash, plus tab and newline.
_REASONING = r"[\t\n\x20-\x5b\x5d-\x7e]"
# The hint: the same without brackets (the end marker starts with one).
_HINT = r"[\t\n\x20-\x5a\x5e-\x7e]"
_HINT_FIRST = r"[\x21-\x5a\x5e-\x7e]"  # a hint starts with a visible character
_BOX = re.escape("\\boxed{")
VERDICTS = {"prm": (1, -1, 0), "step_rm": (1, -1)}
_JSON_SLACK = 64  # braces, keys, quotes and commas of a rewrite answer beyond its values


def _tag(fmt: dict[str, Any]) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


def _regex(pattern: str) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern}


def verdict_format(values: tuple[int, ...], max_tokens: int) -> str:
    r"""Reasoning, then ``\boxed{v}`` for one of ``values``, then the end."""
    tail = max(len(f"\\boxed{{{v}}}") for v in values)
    choice = "|".join(re.escape(str(v)) for v in sorted(values, key=str))
    return _tag(_regex(rf"{_REASONING}{{0,{max(0, max_tokens - tail)}}}{_BOX}({choice})\}}"))


def hint_format(max_tokens: int, hint_max_chars: int) -> str:
    r"""Reasoning, then ``\boxed{-1}``, or ``\boxed{1}`` with a hint of at most
    ``hint_max_chars`` characters between the hint markers."""
    fixed = len("\\boxed{1}") + len(HINT_START) + len(HINT_END)
    hint = max(1, min(hint_max_chars, max_tokens - fixed))
    reasoning = max(0, max_tokens - fixed - hint)
    start, end = re.escape(HINT_START), re.escape(HINT_END)
    return _tag(_regex(rf"{_REASONING}{{0,{reasoning}}}{_BOX}(-1\}}|1\}}{start}"
                       rf"{_HINT_FIRST}{_HINT}{{0,{hint - 1}}}{end})"))


def answer_format(schema: dict[str, Any], max_tokens: int, answer_chars: int) -> str:
    """Reasoning without braces, then one JSON object matching ``schema`` (whose own length
    is about ``answer_chars``: the reasoning leaves room for it)."""
    reasoning = max(0, max_tokens - answer_chars - _JSON_SLACK)
    no_braces = _REASONING.replace(r"\x5d-\x7e", r"\x5d-\x7a\x7c\x7e")  # not { or }
    return _tag({"type": "sequence", "elements": [
        _regex(rf"{no_braces}{{0,{reasoning}}}"),
        {"type": "json_schema", "json_schema": schema}]})


def output_format(request: JudgeRequest, max_tokens: int, hint_max_chars: int) -> str | None:
    """The constraint for ``request``'s outputs, or None for a kind that has no fixed shape."""
    if request.answer_schema is not None:
        return answer_format(request.answer_schema, max_tokens, request.answer_chars)
    if request.kind == "opd":
        return hint_format(max_tokens, hint_max_chars)
    if request.kind in VERDICTS:
        return verdict_format(VERDICTS[request.kind], max_tokens)
    return None
