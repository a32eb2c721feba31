"""How simulated users word their reactions: phrasing pools, disjoint by construction.

A reaction is an opener, a body and a closer joined by a frame ("Hold on - that rambles on.
Again but brief."). Each pool has frames and closers of its own, so no reaction of one pool is
a reaction of another (tested); openers and bodies are partly shared: a small judge model built
from the embedded model knows no English beyond what it is trained on, so a pool of entirely
new words would test a vocabulary it cannot have, where a real (pretrained) judge would not
care. The evaluation reports "familiar" reactions (sentiment said with trained words, in new
frames) and the rest (new words) separately.

- ``judge_train``: the wording a judge model is trained on (``clawray judge-sft``);
- ``judge_validation``: for choosing the judge's training settings;
- ``users``: what the simulated users of the live demo say, and the judge's test pool: a judge
  is reported on wording it never saw in training;
- ``keywords``: the heuristic rule judge's own keywords, for protocol tests and the quickstart
  that run the loop with that judge (it measures nothing about a judge).

Negative bodies say what went wrong (too long, unreadable, empty, or too short for a user who
wants detail), as a person would. The
pools are written as people talk, not to match the keyword lists of the heuristic rule judge
(``clawray/judging/rules.py``), whose accuracy on them is measured, not assumed
(``clawray judge-sft`` reports both).

Pure Python, no Ray.
"""

from __future__ import annotations

import dataclasses
import random

REASONS = ("long", "unreadable", "empty", "short")


@dataclasses.dataclass(frozen=True)
class PhrasingPool:
    """Parts of reactions and the frames that join them: ``{O}``/``{o}`` the opener
    (capitalized / lower case), ``{B}``/``{b}`` the body, ``{c}`` the closer."""

    frames: tuple[str, ...]
    positive_openers: tuple[str, ...]
    positive_bodies: tuple[str, ...]
    positive_closers: tuple[str, ...]
    negative_openers: tuple[str, ...]
    negative_bodies: dict[str, tuple[str, ...]]  # by reason: long, unreadable, empty, short
    negative_closers: tuple[str, ...]

    def words(self, satisfied: bool) -> set[str]:
        """The openers and bodies of one sentiment (what says whether the user is pleased)."""
        if satisfied:
            return set(self.positive_openers) | set(self.positive_bodies)
        return set(self.negative_openers) | {b for r in REASONS for b in self.negative_bodies[r]}


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


PHRASINGS: dict[str, PhrasingPool] = {
    "judge_train": PhrasingPool(
        frames=("{O}, {b}{c}", "{O}! {B}{c}", "{B}{c}"),
        positive_openers=("Nice", "Cool", "Lovely", "Yes", "Brilliant", "Sweet", "Ah good",
                          "Excellent", "Good"),
        positive_bodies=("that's just right", "spot on", "short and sweet", "you nailed it",
                         "that hits the mark", "just what I was after",
                         "clear and to the point", "that's the stuff", "that's helpful",
                         "I like that"),
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
                      "you can go into more depth"),
        },
        negative_closers=(".", "!", ", do it again shorter.", ". Give it another go.", "?!"),
    ),
    "judge_validation": PhrasingPool(
        frames=("{B} - {o}{c}", "{O}... {b}{c}"),
        positive_openers=("Neat", "Awesome", "Nice", "Yes", "Sweet"),
        positive_bodies=("that's the length I like", "much appreciated", "spot on",
                         "you nailed it", "short and sweet"),
        positive_closers=(". Nice one.", ", thanks a bunch."),
        negative_openers=("Well", "Come on", "Nope", "Ugh", "Hmm"),
        negative_bodies={
            "long": ("please be concise", "that's an essay", "too wordy for me",
                     "that's way too long"),
            "unreadable": ("that's garbled", "I can't read that"),
            "empty": ("there's nothing there", "you said nothing"),
            "short": ("flesh it out", "more detail please"),
        },
        negative_closers=(", once more.", ". Shorter next round."),
    ),
    # What the demo's users say: new frames and closers, part of the openers and bodies new
    # too ("familiar" examples use only openers and bodies the judge was trained on).
    "users": PhrasingPool(
        frames=("{B}, {o}{c}", "{O} - {b}{c}", "{O}: {b}{c}"),
        positive_openers=("Wonderful", "Splendid", "Lovely", "Cool", "Brilliant", "Yep"),
        positive_bodies=("exactly my style", "just the right size", "works for me",
                         "that hits the mark", "just what I was after", "I like that"),
        positive_closers=("!!", ". Appreciated.", ". Keep it like that.", " :)"),
        negative_openers=("Hold on", "Argh", "Oof", "Meh", "Sigh", "Oh no"),
        negative_bodies={
            "long": ("that rambles on", "keep it to a few words", "that's long-winded",
                     "that's a wall of text", "can you cut that down", "that goes on and on"),
            "unreadable": ("that makes no sense", "what is that mess"),
            "empty": ("where's the answer", "I got no words back"),
            "short": ("that is too terse", "tell me a lot more", "I need the full picture",
                      "elaborate a bit"),
        },
        negative_closers=(". Again but brief.", ". One more time, tighter.", ". Redo that.",
                          "..."),
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
    complaint about ``reason`` (``REASONS``: long, unreadable, empty, short)."""
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


def familiar(pool: str, text: str, satisfied: bool, trained_on: str = "judge_train") -> bool:
    """Whether reaction ``text`` of ``pool`` says its sentiment only with openers and bodies
    that pool ``trained_on`` also uses (in other frames), so a judge trained there has seen
    every word that carries it."""
    own, seen = phrasing_pool(pool).words(satisfied), phrasing_pool(trained_on).words(satisfied)
    low = text.lower()
    used = {w for w in own if w.lower() in low}
    return bool(used) and used <= seen
