"""Hidden, measurable user preferences for simulated users, and the feedback they give.

A preference decides from the reply text alone whether a simulated user is satisfied, and
words the user's reaction, which the user sends as the start of their next message: approval
when satisfied, else a complaint that says what was wrong, worded from a phrasing pool
(``clawray/sim/feedback.py``; the demo's users speak the ``users`` pool, which a judge model is
tested on and never trained on). The wording is not chosen to match the heuristic rule
judge's keywords (``clawray/judging/rules.py``): how well that judge reads it is measured
(``clawray judge-sft``).

Why "brief replies" (measured base rates in ``clawray/sim/users.py``): the embedded tiny model
answers greetings and requests with short canned replies and questions with a 12-word one, so
"at most 8 words" is met by ~90% of greeting/request replies and ~10% of question replies. It
is natural to state, measurable from the text, reachable for every message type (short answers
to questions already occur), and the users' mix of types puts the base rate near 0.4.

Pure Python, no Ray.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Callable, Protocol, runtime_checkable

from clawray.sim.feedback import react


@runtime_checkable
class Preference(Protocol):
    """What a simulated user wants from every reply; hidden from the policy."""

    name: str

    def describe(self) -> str:
        """One sentence for people (reports, plots), never sent to the model."""
        ...

    def satisfied(self, reply_text: str) -> bool:
        ...

    def feedback(self, reply_text: str, satisfied: bool, rng: random.Random) -> str:
        """The user's reaction, to be sent as the start of their next message."""
        ...


_WORD = re.compile(r"[A-Za-z]{2,}")


def readable(reply_text: str, min_letters: float = 0.6) -> bool:
    """Words a person can read: at least one real word, and letters (with spaces) make up at
    least ``min_letters`` of the non-space characters' count (no punctuation soup)."""
    text = reply_text.strip()
    if not text or not _WORD.search(text):
        return False
    letters = sum(c.isalpha() for c in text)
    return letters / max(1, sum(not c.isspace() for c in text)) >= min_letters


@dataclasses.dataclass(frozen=True)
class BriefReplies:
    """Satisfied by a readable reply of at most ``max_words`` words and ``max_chars``
    characters. Without the readability and length checks, RL finds that a run of
    punctuation with no spaces counts as "one word" (it did, within 8 updates)."""

    max_words: int = 8
    max_chars: int = 60
    name: str = "brief"
    phrasing: str = "users"  # how the user words reactions (clawray/sim/feedback.py)

    def describe(self) -> str:
        return (f"this user wants brief, readable replies: at most {self.max_words} words "
                f"and {self.max_chars} characters")

    def satisfied(self, reply_text: str) -> bool:
        return (1 <= len(reply_text.split()) <= self.max_words
                and len(reply_text.strip()) <= self.max_chars and readable(reply_text))

    def feedback(self, reply_text: str, satisfied: bool, rng: random.Random) -> str:
        """Approval, or a complaint that says what was wrong (too long, unreadable, empty),
        worded from phrasing pool ``phrasing`` (``clawray/sim/feedback.py``)."""
        return react(self.phrasing, satisfied, reason_of(reply_text), rng)


def reason_of(reply_text: str, too: str = "long") -> str:
    """What a rejected reply got wrong, in the words of ``feedback.REASONS``: empty,
    unreadable, else ``too`` ("long" for a user who wants brief replies, "short" for one who
    wants detail)."""
    return ("empty" if not reply_text.strip() else "unreadable" if not readable(reply_text)
            else too)


@dataclasses.dataclass(frozen=True)
class DetailedReplies:
    """The opposite of ``BriefReplies``: satisfied by a readable reply of at least
    ``min_words`` words. On the embedded model it is met by ~95% of question replies and
    ~1-5% of greeting and request replies (the reverse of "brief"), so one policy cannot
    please both kinds of user: the per-user demonstration (``clawray demo --per-user``)."""

    min_words: int = 10
    name: str = "detailed"
    phrasing: str = "users"

    def describe(self) -> str:
        return f"this user wants detailed, readable replies: at least {self.min_words} words"

    def satisfied(self, reply_text: str) -> bool:
        return len(reply_text.split()) >= self.min_words and readable(reply_text)

    def feedback(self, reply_text: str, satisfied: bool, rng: random.Random) -> str:
        return react(self.phrasing, satisfied, reason_of(reply_text, too="short"), rng)


def concise() -> BriefReplies:
    """"Brief" for a real chat model: at most 20 words and 140 characters (one or two short
    sentences). SmolLM2-135M-Instruct answers greetings in a few words about half the time and
    questions and requests at length (30-45 words, cut at 48 tokens), so at most 8 words is
    met by ~5% of its replies and nothing to learn from; measured base rates in
    docs/models.md."""
    return BriefReplies(max_words=20, max_chars=140, name="concise")


PREFERENCES: dict[str, Callable[[], Preference]] = {"brief": BriefReplies,
                                                    "detailed": DetailedReplies,
                                                    "concise": concise}


def get_preference(name: str) -> Preference:
    """A built-in preference by name (``PREFERENCES``)."""
    try:
        return PREFERENCES[name]()
    except KeyError:
        raise ValueError(f"unknown preference {name!r}; known: {sorted(PREFERENCES)}") from None
