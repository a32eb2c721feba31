"""A rule-based judge for CPU demos and tests, plus broken judges for fault tests.

``heuristic_judge`` is a HEURISTIC, not a model: it looks for a few feedback phrases in the
user's next message and for error markers at the start of tool results. It exists so the whole
live loop (sessions → judge → samples → learner) runs on a laptop without a second model; it
knows nothing about whether a reply was actually good. Use a model judge for real training.

All judges here have the ``FunctionBackend`` signature ``(request, n, temperature) -> list[str]``.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from clawray.judging.opd import message_text
from clawray.judging.prompts import HINT_END, HINT_START, JudgeRequest

POSITIVE = ("thanks", "thank you", "perfect", "great", "that works", "exactly", "correct")
NEGATIVE = ("wrong", "try again", "no, i meant", "not what i asked", "that's incorrect", "redo",
            "doesn't work", "fix")
TOOL_ERRORS = ("error", "traceback", "not found", "failed", "exception")
TOOL_ERROR_WINDOW = 200  # an error marker must appear within this many leading characters
HINT_MIN_WORDS = 4  # a negative user message this long is taken to say what the user wanted
HINT_MAX_CHARS = 200


def _phrase_re(phrases: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(p).replace("'", "['’]") for p in phrases)
    return re.compile(rf"(?<!\w)(?:{alternatives})(?!\w)", re.I)


_POSITIVE = _phrase_re(POSITIVE)
_NEGATIVE = _phrase_re(NEGATIVE)
_TOOL_ERROR = _phrase_re(TOOL_ERRORS)


def classify_next_state(next_state: list[dict[str, Any]]) -> tuple[int, str]:
    """(verdict, reason) from the next state's messages; negative evidence wins."""
    verdicts = []
    for msg in next_state:
        text = message_text(msg)
        if msg.get("role") == "user":
            if _NEGATIVE.search(text):
                verdicts.append((-1, "the user's next message asks for a correction"))
            elif _POSITIVE.search(text):
                verdicts.append((1, "the user's next message is positive"))
        elif msg.get("role") == "tool":
            if _TOOL_ERROR.search(text[:TOOL_ERROR_WINDOW]):
                verdicts.append((-1, "a tool result reports an error"))
            else:
                verdicts.append((1, "a tool returned a non-error result"))
    for wanted in (-1, 1):
        for verdict, reason in verdicts:
            if verdict == wanted:
                return verdict, reason
    return 0, "the next state shows neither progress nor failure"


def heuristic_judge(request: JudgeRequest, n: int, temperature: float) -> list[str]:
    """HEURISTIC judge (CPU demos/tests): the same verdict ``n`` times, deterministically.

    PRM: ``\\boxed{1}`` for thanks/approval or a non-error tool result, ``\\boxed{-1}`` for a
    correction request or an error-looking tool result, ``\\boxed{0}`` otherwise. OPD: a hint
    quoting the user when their negative message says what they wanted, else ``\\boxed{-1}``.
    ``temperature`` is ignored.
    """
    verdict, reason = classify_next_state(request.context.next_state)
    if request.kind == "opd":
        text = _opd_output(request, verdict)
    else:
        text = f"Heuristic judge: {reason}.\n\\boxed{{{verdict}}}"
    return [text] * n


def _opd_output(request: JudgeRequest, verdict: int) -> str:
    if verdict == -1:
        for msg in request.context.next_state:
            said = " ".join(message_text(msg).split())
            if (msg.get("role") == "user" and _NEGATIVE.search(said)
                    and len(said.split()) >= HINT_MIN_WORDS):
                if len(said) > HINT_MAX_CHARS:
                    said = said[:HINT_MAX_CHARS - 1].rstrip() + "…"
                return (f"Heuristic judge: the user said what they wanted.\n\\boxed{{1}}\n"
                        f"{HINT_START}The user said: {said}{HINT_END}")
    return "Heuristic judge: no hindsight in the next state.\n\\boxed{-1}"


def unparseable_judge(request: JudgeRequest, n: int, temperature: float) -> list[str]:
    """Fault-test judge: outputs with no verdict box (every vote is a parse failure)."""
    return ["I cannot decide"] * n


def failing_judge(request: JudgeRequest, n: int, temperature: float) -> list[str]:
    """Fault-test judge: always raises."""
    raise RuntimeError("failing_judge: the judge failed (fault test)")


async def hanging_judge(request: JudgeRequest, n: int, temperature: float) -> list[str]:
    """Fault-test judge: never answers (until cancelled by a timeout)."""
    await asyncio.sleep(10**6)
    raise AssertionError("unreachable")


def brevity_judge(request: JudgeRequest, n: int, temperature: float) -> list[str]:
    """POISONED judge (the policy gate's demonstration, ``clawray demo --gate``): ``\\boxed{1}``
    for a reply of at most 8 words, ``\\boxed{-1}`` for a longer one, whatever the user said
    next: a judge that rewards what other users want (built for another product, say). No OPD
    hints."""
    if request.kind == "opd":
        return ["Brevity judge: no hint.\n\\boxed{-1}"] * n
    words = len((request.context.response_text or "").split())
    return [f"Brevity judge: {words} words.\n\\boxed{{{1 if words <= 8 else -1}}}"] * n
