"""How simulated users word their reactions: phrasing pools, disjoint by construction.

A reaction is an opener, a body and a closer joined by a frame ("Argh - it rambles. Start
over."). The judge's training wording (``judge_train``), the wording settings are chosen on
(``judge_validation``) and the wording it is tested on (``users``) share no opener, body,
frame or closer, and the test wording shares no word with the training wording beyond a short
list of function words ("that", "it", "me", ...; ``FUNCTION_WORDS``; tested). A judge scored
on ``users`` is scored on language it never saw in training. For the embedded model, whose
judge knows no English beyond its training rows, that is a test it cannot pass by reading
(what it can learn is said in docs/training.md); a pretrained judge brings its own English.

- ``judge_train``: the wording a judge model is trained on (``clawray judge-sft``);
- ``judge_validation``: for choosing the judge's training settings;
- ``users``: what the simulated users of the live demo say, and the judge's test pool: a judge
  is reported on wording it never saw in training;
- ``keywords``: the heuristic rule judge's own keywords, for protocol tests and the quickstart
  that run the loop with that judge (it measures nothing about a judge).

Positive openers, bodies and closers say nothing about length, and negative closers neither:
users who want brief replies and users who want detailed ones approve in the same words, and
only a negative body says what went wrong (too long, unreadable, empty, too short, or not
about what was asked), as a person would. The pools are written as people talk, not to match the keyword lists of the
heuristic rule judge (``clawray/judging/rules.py``), and share none of its keywords (tested).

Pure Python, no Ray.
"""

from __future__ import annotations

import dataclasses
import random
import re

REASONS = ("long", "unreadable", "empty", "short", "off_topic")


@dataclasses.dataclass(frozen=True)
class PhrasingPool:
    """Parts of reactions and the frames that join them: ``{O}``/``{o}`` the opener
    (capitalized / lower case), ``{B}``/``{b}`` the body, ``{c}`` the closer."""

    frames: tuple[str, ...]
    positive_openers: tuple[str, ...]
    positive_bodies: tuple[str, ...]
    positive_closers: tuple[str, ...]
    negative_openers: tuple[str, ...]
    negative_bodies: dict[str, tuple[str, ...]]  # by reason (REASONS)
    negative_closers: tuple[str, ...]

    def parts(self) -> set[str]:
        """Every opener, body, closer and frame."""
        return {*self.frames, *self.positive_openers, *self.positive_bodies,
                *self.positive_closers, *self.negative_openers, *self.negative_closers,
                *(b for r in REASONS for b in self.negative_bodies[r])}

    def words(self) -> set[str]:
        """The words of its parts, in lower case, less ``FUNCTION_WORDS``."""
        text = " ".join(re.sub(r"\{\w\}", " ", part) for part in self.parts()).lower()
        return set(re.findall(r"[a-z]+(?:['-][a-z]+)*", text)) - FUNCTION_WORDS


# Words every wording needs; the test wording may share only these with the training wording.
FUNCTION_WORDS = frozenset({"a", "an", "the", "it", "is", "i", "me", "my", "you", "to", "of",
                            "for", "on", "that", "that's", "and", "this", "be", "so"})


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


PHRASINGS: dict[str, PhrasingPool] = {
    "judge_train": PhrasingPool(
        frames=("{O}, {b}{c}", "{O}! {B}{c}", "{B}{c}"),
        positive_openers=("Nice", "Cool", "Lovely", "Yes", "Brilliant", "Sweet", "Ah good",
                          "Excellent", "Good"),
        positive_bodies=("that's just right", "spot on", "you nailed it", "that hits the mark",
                         "just what I was after", "that's the stuff", "that's helpful",
                         "I like that", "that suits me", "right on target"),
        positive_closers=(".", "!", ", cheers.", ". More like this please.", ", ta."),
        negative_openers=("Hmm", "Nope", "Ugh", "Meh", "Oh no", "Sigh", "Uh", "No"),
        negative_bodies={
            "long": ("that's way too long", "too wordy for me", "that's a wall of text",
                     "can you cut that down", "I asked for something brief",
                     "that goes on and on", "shorter please", "far too much text"),
            "unreadable": ("I can't read that", "that's just symbols", "what is that mess",
                           "that's gibberish"),
            "empty": ("you said nothing", "that reply is blank", "I got no words back",
                      "that was empty"),
            "short": ("say more than that", "that is too thin", "I wanted the details",
                      "you can go into more depth", "that's far too short",
                      "I asked for something thorough", "longer please",
                      "hardly any text"),
            "off_topic": ("you missed what I asked", "that's beside the point",
                          "that has nothing to do with my message", "stick to the subject"),
        },
        negative_closers=(".", "!", ". Give it another go.", "?!", ", have another go."),
    ),
    "judge_validation": PhrasingPool(
        frames=("{B} - {o}{c}", "{O}... {b}{c}"),
        positive_openers=("Neat", "Awesome", "Superb", "Wow", "Ace"),
        positive_bodies=("grateful", "that does the job", "well done", "useful", "love it"),
        positive_closers=(". Kudos.", ", obliged."),
        negative_openers=("Well", "Come on", "Hmph", "Bah", "Geez"),
        negative_bodies={
            "long": ("be concise", "an essay", "trim it", "overly verbose"),
            "unreadable": ("garbled output", "static noise"),
            "empty": ("zero output", "a void"),
            "short": ("flesh it out", "richer content needed", "skimpy", "expand on it"),
            "off_topic": ("irrelevant", "off course"),
        },
        negative_closers=(", rewrite it.", ". Retry."),
    ),
    # What the demo's users say, and the judge's test wording: no opener, body, frame or
    # closer of it is in another pool, and no word of it is in the judge's training wording
    # (tests/unit/sim/test_feedback.py).
    "users": PhrasingPool(
        frames=("{B}, {o}{c}", "{O} - {b}{c}", "{O}: {b}{c}"),
        positive_openers=("Wonderful", "Splendid", "Yep", "Fantastic", "Marvellous", "Yay"),
        positive_bodies=("my kind of answer", "works for me", "bang on", "top notch",
                         "lands nicely", "very handy"),
        positive_closers=("!!", ". Appreciated.", ". Keep it up.", " :)"),
        negative_openers=("Hold on", "Argh", "Oof", "Yikes", "Blah", "Erm"),
        negative_bodies={
            "long": ("it rambles", "keep it snappy", "bloated", "condense it", "less talk",
                     "overkill"),
            "unreadable": ("incomprehensible", "pure nonsense"),
            "empty": ("where's the answer", "not a single word"),
            "short": ("rather terse", "I need specifics", "paint the full picture",
                      "elaborate a bit", "dig deeper", "barely anything"),
            "off_topic": ("unrelated to my query", "off on a tangent",
                          "you dodged my request"),
        },
        negative_closers=(". Once again.", ". Start afresh.", "...", ". Start over."),
    ),
    # The heuristic rule judge's own keywords ("thanks", "perfect", "wrong", "try again", ...):
    # for protocol tests and the quickstart, which run the loop with that judge. Not a test of
    # any judge.
    "keywords": PhrasingPool(
        frames=("{O}; {b}{c}",),
        positive_openers=("Thanks", "Perfect", "Great"),
        positive_bodies=("that works", "thank you", "exactly right"),
        positive_closers=("!!!", ". Thanks again."),
        negative_openers=("That's wrong", "Not what I asked for", "No, I meant something else"),
        negative_bodies={
            "long": ("too long", "I want it shorter", "fewer words"),
            "unreadable": ("I can't read it", "no real words"),
            "empty": ("it is empty", "nothing came back"),
            "short": ("too short", "I want it longer", "more words"),
            "off_topic": ("not what I asked", "answer my question"),
        },
        negative_closers=(". Try again.", ", redo it."),
    ),
}
PHRASING_NAMES = tuple(PHRASINGS)


def phrasing_pool(name: str) -> PhrasingPool:
    try:
        return PHRASINGS[name]
    except KeyError:
        raise ValueError(f"unknown phrasing pool {name!r}; known: {list(PHRASINGS)}") from None


def react(pool: str, satisfied: bool, reason: str, rng: random.Random) -> str:
    """A user's reaction from phrasing pool ``pool``: approval when ``satisfied``, else a
    complaint about ``reason`` (``REASONS``: long, unreadable, empty, short, off_topic)."""
    p = phrasing_pool(pool)
    if satisfied:
        opener, body, closer = (rng.choice(p.positive_openers), rng.choice(p.positive_bodies),
                                rng.choice(p.positive_closers))
    else:
        if reason not in REASONS:
            raise ValueError(f"unknown reason {reason!r}; known: {REASONS}")
        opener, body, closer = (rng.choice(p.negative_openers),
                                rng.choice(p.negative_bodies[reason]),
                                rng.choice(p.negative_closers))
    frame = rng.choice(p.frames)
    return frame.format(O=_cap(opener), o=opener.lower(), B=_cap(body), b=body, c=closer).strip()
