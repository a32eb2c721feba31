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

    def satisfied(self, reply_text: str, topic: set[str] | None = None) -> bool:
        """Whether the reply pleases the user; ``topic``: the words of what was asked that an
        answer names (``users.topic_words``; None or empty for a greeting), which only a
        preference about answering reads."""
        ...

    def feedback(self, reply_text: str, satisfied: bool, rng: random.Random,
                 topic: set[str] | None = None) -> str:
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

    def satisfied(self, reply_text: str, topic: set[str] | None = None) -> bool:
        return (1 <= len(reply_text.split()) <= self.max_words
                and len(reply_text.strip()) <= self.max_chars and readable(reply_text))

    def feedback(self, reply_text: str, satisfied: bool, rng: random.Random,
                 topic: set[str] | None = None) -> str:
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

    def satisfied(self, reply_text: str, topic: set[str] | None = None) -> bool:
        return len(reply_text.split()) >= self.min_words and readable(reply_text)

    def feedback(self, reply_text: str, satisfied: bool, rng: random.Random,
                 topic: set[str] | None = None) -> str:
        return react(self.phrasing, satisfied, reason_of(reply_text, too="short"), rng)


def concise() -> BriefReplies:
    """"Brief" for a real chat model: at most 20 words and 140 characters (one or two short
    sentences). SmolLM2-135M-Instruct answers greetings in a few words about half the time and
    questions and requests at length (30-45 words, cut at 48 tokens), so at most 8 words is
    met by ~5% of its replies and nothing to learn from; measured base rates in
    docs/models.md."""
    return BriefReplies(max_words=20, max_chars=140, name="concise")


@dataclasses.dataclass(frozen=True)
class ConciseAnswers:
    """"Concise" that must still answer: at most 20 words and 140 characters, and a reply to
    a question or request names what was asked about (``users.on_topic``: its place, topic,
    task...; greetings have nothing to name). Trained for brevity alone, SmolLM2's replies
    named the topic 92% -> 50% of the time (docs/models.md); a user who wants a short answer
    says so when a reply is short but about something else ("off_topic" in
    ``feedback.REASONS``)."""

    brief: BriefReplies = BriefReplies(max_words=20, max_chars=140, name="concise")
    name: str = "concise_answer"
    phrasing: str = "users"

    def describe(self) -> str:
        return (f"this user wants concise answers: at most {self.brief.max_words} words and "
                f"{self.brief.max_chars} characters that name what was asked about")

    def satisfied(self, reply_text: str, topic: set[str] | None = None) -> bool:
        return (self.brief.satisfied(reply_text)
                and on_topic(reply_text, topic or set()) is not False)

    def feedback(self, reply_text: str, satisfied: bool, rng: random.Random,
                 topic: set[str] | None = None) -> str:
        reason = reason_of(reply_text)
        if not satisfied and self.brief.satisfied(reply_text):
            reason = "off_topic"  # short and readable, so what was wrong is the subject
        return react(self.phrasing, satisfied, reason, rng)


def on_topic(reply: str, words: set[str]) -> bool | None:
    """Whether ``reply`` names one of ``words`` (a request's ``users.topic_words``), a plural
    or a longer form counting ("river" for "rivers", "Argentine" for "Argentina": the first
    five letters of the stem); None when there are no words to name (a greeting). A crude
    check that a concise reply still answers: it catches "Space." for a question about Mars."""
    if not words:
        return None
    stems = {_stem(w)[:5] for w in words}
    return any(_stem(t)[:5] in stems for t in re.findall(r"[A-Za-z]+", reply))


def _stem(word: str) -> str:
    word = word.lower()
    return word[:-1] if len(word) > 3 and word.endswith("s") else word


PREFERENCES: dict[str, Callable[[], Preference]] = {"brief": BriefReplies,
                                                    "detailed": DetailedReplies,
                                                    "concise": concise,
                                                    "concise_answer": ConciseAnswers}


def get_preference(name: str) -> Preference:
    """A built-in preference by name (``PREFERENCES``)."""
    try:
        return PREFERENCES[name]()
    except KeyError:
        raise ValueError(f"unknown preference {name!r}; known: {sorted(PREFERENCES)}") from None
