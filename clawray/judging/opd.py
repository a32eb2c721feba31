"""On-policy distillation with hindsight hints (docs/sessions.md, "Judging"): pick a hint,
inject it into the conversation the teacher scores (the token advantages themselves are
``clawray.learner.losses.opd_advantages``).

Pure functions, no Ray and no model: the teacher log-probs themselves come from a judge
backend (``JudgeServer.teacher_logprobs``), scored on the exact response ids the policy sampled.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Sequence

OPENCLAW_CONTEXT_START = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"
HINT_HEADER = "[User's hint / instruction]"

_WORD = re.compile(r"\w+")


def message_text(msg: dict[str, Any]) -> str:
    """A message's content as text: a string, the joined text parts of a list, or ''."""
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return ""


def is_ephemeral_context(msg: dict[str, Any]) -> bool:
    """True for OpenClaw's trailing internal-context user message.

    OpenClaw rebuilds it for every request and never keeps it in the history, so it is not
    something the user wrote: a hint must not go there, and a judge need not read it.
    """
    return msg.get("role") == "user" and message_text(msg).lstrip().startswith(
        OPENCLAW_CONTEXT_START)


def select_hint(parsed: Sequence[tuple[int | None, str | None]], min_agree: int,
                min_chars: int = 1) -> str | None:
    """The hint to distill from, or None.

    Rule: the accepted hints are those of votes that are +1 *and* carry a hint of at least
    ``min_chars`` characters (a few characters hold no instruction: "ok", "-"). With
    fewer than ``min_agree`` accepted hints there is no consensus that the next state holds
    useful hindsight, so no hint. Otherwise the medoid wins: the hint with the highest mean
    word-level Jaccard similarity to the other accepted hints (the one the voters agree with
    most), ties broken by the shorter hint, then by the earlier vote. OpenClaw-RL takes the
    longest hint instead, which rewards rambling.
    """
    if min_agree < 1:
        raise ValueError(f"min_agree must be >= 1, got {min_agree}")
    hints = [h.strip() for vote, h in parsed
             if vote == 1 and h and len(h.strip()) >= max(1, min_chars)]
    if len(hints) < min_agree:
        return None
    if len(hints) == 1:
        return hints[0]
    words = [set(_WORD.findall(h.lower())) for h in hints]

    def mean_similarity(i: int) -> float:
        others = [_jaccard(words[i], words[j]) for j in range(len(hints)) if j != i]
        return sum(others) / len(others)

    best = min(range(len(hints)), key=lambda i: (-mean_similarity(i), len(hints[i]), i))
    return hints[best]


def _jaccard(a: set[str], b: set[str]) -> float:
    union = a | b
    return len(a & b) / len(union) if union else 0.0


def inject_hint(messages: list[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A copy of ``messages`` with ``hint`` appended to the last real user message.

    The teacher prompt is the student prompt as if the user had said the hint. "Real" skips
    OpenClaw's ephemeral internal-context message (``is_ephemeral_context``); a trailing tool
    result is skipped the same way, so the hint lands on the user message that started the
    exchange. The input list is not modified.
    """
    target = next((i for i in range(len(messages) - 1, -1, -1)
                   if messages[i].get("role") == "user" and not is_ephemeral_context(messages[i])),
                  None)
    if target is None:
        raise ValueError("cannot inject a hint: the messages have no user message")
    out = copy.deepcopy(messages)
    suffix = f"\n\n{HINT_HEADER}\n{hint}"
    msg = out[target]
    content = msg.get("content")
    if isinstance(content, list):
        msg["content"] = [*content, {"type": "text", "text": suffix}]
    elif content:
        msg["content"] = content + suffix
    else:
        msg["content"] = suffix.lstrip("\n")
    return out
