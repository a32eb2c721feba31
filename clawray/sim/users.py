"""Simulated users that talk to clawray through its HTTP API like a real client.

A ``SimUser`` holds a hidden ``Preference`` (``clawray/sim/preferences.py``) and runs sessions
with the official ``openai.AsyncOpenAI`` client: a fresh ``X-Session-Id`` per session, ``k``
user requests drawn from seeded templates of three types (greeting, question, request) of the
"train" prompt pool (``POOLS``: train / validation / test, disjoint templates and words). After
each reply the user judges it with the preference, and its next message is the feedback
sentence followed by the next request, so the heuristic judge finds the feedback in the turn's
next state. The last message of a session is the feedback alone, sent with
``X-Session-Done: true``; its reply is recorded but not judged. ``evaluate`` measures the
satisfaction rate with single-turn SIDE requests (``X-Turn-Type: side``, never trained on) on a
fixed seeded message set of the held-out "test" pool with per-request sampling seeds, so two
evaluations of the same weights give the same replies: the before/after numbers of the
learning demo.

Base rates per pool, single turns, 120 messages per type, seed 0 (2026-12-02, the embedded
model as rebuilt with head_dim 32; ``python -m clawray.sim measure --pool P --n 120 --turns 1``):
train greeting 0.88 / question 0.02 / request 0.99, 3-turn mix 0.41; validation 0.92 / 0.02 /
1.00, 0.45; test 0.83 / 0.03 / 0.99, 0.41.

Earlier figures (the embedded model before its rebuild), the ``brief`` preference (at most 8
words, not empty) at temperature 1.0 (top_k 0, top_p 1, 48 new tokens), offline with
transformers, 240 messages per type and 240 three-turn sessions, seeds 0 and 1:
``python -m clawray.sim measure --n 240 --turns 3 [--seed 1]``

    single turn      greeting 0.88 / 0.86   question 0.09 / 0.10   request 0.95 / 0.95
    3-turn sessions  all 0.41 / 0.43 (turns 1-3: 0.44 0.38 0.40 / 0.42 0.42 0.44);
                     questions 0.04-0.14 per turn, greetings 0.77-0.92, requests 0.91-1.0

and live through the HTTP API (``served`` test app, policy v0): ``evaluate(n=300)`` 0.44
(greeting 0.96, question 0.10, request 0.94); ``run_users`` 8 users x 8 sessions x 3 turns
0.41 over 192 judged replies.

Greetings and requests mostly get short canned replies ("Hello! How can I help you today?",
"OK, I understand."); questions mostly the 12-word "Good question. I am a small model, so my
answers are short.", yet 4-14% of question replies are already short ("Good question I
understand.", "OK, I understand."). So the preference is reachable for every type, the base
rate sits inside 0.2-0.6 (the type mix 0.2/0.6/0.2 gives ~0.42), and the headroom is in the
questions, which is why they weigh 0.6: the policy has to learn to answer them briefly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import re
import time
import uuid
from typing import Any, Callable, Sequence

import httpx
import openai

from clawray.gate.actor import ShadowSet
from clawray.sim.preferences import BriefReplies, Preference, get_preference, on_topic

logger = logging.getLogger(__name__)

SYSTEM_PROMPT = "You are a helpful assistant."

# Prompt pools. Training users draw their requests from the "train" pool; settings are chosen
# on "validation"; before/after figures are reported on "test". The three pools share no
# template and no fill-in word (different places, topics, tasks, not just different seeds;
# tests/unit/sim/test_sim.py checks it), so a figure on "test" measures requests the policy was
# never trained on. Questions in every pool open with the same question words (What, How, Why,
# Can, Is, Where): the embedded model's long reply is imprinted on those openers
# (clawray/models/corpus.py), so every pool keeps the learning problem. No template or fill-in
# may contain a phrase the heuristic judge reads as feedback ("great", "fix", "correct", ...):
# the request part of a message must be neutral (checked too).


@dataclasses.dataclass(frozen=True)
class PromptPool:
    """Templates per message type and the words they are filled with."""

    templates: dict[str, tuple[str, ...]]
    fills: dict[str, tuple[str, ...]]  # place, topic, task, people, thing, color


POOLS: dict[str, PromptPool] = {
    "train": PromptPool(
        templates={
            "greeting": (
                "Hi there!", "Hello.", "Hey!", "Good morning!", "Hello there.", "Hi!",
                "Good evening.", "Hey there.", "Hello again.", "Hi, how are you?",
            ),
            "question": (
                "What is the capital of {place}?", "How do I {task}?",
                "Why is the {thing} {color}?", "What is the weather like in {place} today?",
                "How long does it take to {task}?", "Where can I read about {topic}?",
                "What should I know about {topic}?", "Can you tell me how to {task}?",
                "Is it cold in {place} in winter?", "How many people live in {place}?",
            ),
            "request": (
                "Please write me a poem about {topic}.", "Write a short story about {topic}.",
                "Draft an email to {people} about {topic}.", "Summarize the news about {place}.",
                "Give me five ideas for a weekend in {place}.", "Remind me to {task} tomorrow.",
                "Make a packing list for a trip to {place}.", "Write a limerick about {topic}.",
                "Plan my day around {topic}.", "Describe {topic} in a paragraph.",
            ),
        },
        fills={
            "place": ("Peru", "Norway", "Kenya", "Japan", "Chile", "Canada", "Egypt", "Poland",
                      "Vietnam", "the moon", "Mars", "Iceland"),
            "topic": ("cats", "the sea", "autumn", "coffee", "trains", "the city at night",
                      "old friends", "rain", "a lighthouse", "mountains", "my garden",
                      "space travel"),
            "task": ("list files in a folder", "bake bread", "learn to swim",
                     "set up a new laptop", "plant tomatoes", "back up my photos", "tie a tie",
                     "make cold brew coffee", "start running", "read faster"),
            "people": ("my team", "my landlord", "the school", "my manager", "a client",
                       "my sister"),
            "thing": ("sky", "ocean", "grass", "snow", "sunset", "night sky"),
            "color": ("blue", "green", "white", "red", "dark", "salty"),
        }),
    "validation": PromptPool(
        templates={
            "greeting": (
                "Good afternoon.", "Hiya!", "Hey, you there?", "Hello, hello.",
                "Morning.", "Hi folks.", "Evening!", "Hey again.",
            ),
            "question": (
                "What is the oldest town in {place}?", "How hard is it to {task}?",
                "Why does the {thing} look {color} sometimes?",
                "Where is a quiet spot to enjoy {topic}?",
                "Can you recommend a book on {topic}?", "Is {place} expensive to visit?",
                "What do people eat for breakfast in {place}?",
                "How early should I start to {task}?",
            ),
            "request": (
                "Compose a song about {topic}.", "Sketch a menu for a dinner party in {place}.",
                "Write a note to {people} about {topic}.",
                "Outline a lesson about {topic}.", "Suggest a route through {place}.",
                "Prepare a checklist before I {task}.",
                "Invent a board game about {topic}.", "Name three sights in {place}.",
            ),
        },
        fills={
            "place": ("Argentina", "Sweden", "Nigeria", "China", "Cuba", "Ireland", "Turkey",
                      "Spain", "Thailand", "Jupiter", "Wales", "Tibet"),
            "topic": ("birds", "the river", "spring", "chocolate", "airplanes",
                      "the village at noon", "new neighbors", "thunder", "a castle", "islands",
                      "my balcony", "robots"),
            "task": ("knit a scarf", "change a tire", "study for exams", "steep tea",
                     "organize a closet", "master chess", "water succulents", "draw faces",
                     "jump rope", "speak in public"),
            "people": ("my roommate", "the bank", "my teacher", "my boss", "a vendor",
                       "my cousin"),
            "thing": ("sun", "lake", "rose", "desert", "ice", "horizon"),
            "color": ("orange", "purple", "pink", "golden", "black", "hazy"),
        }),
    "test": PromptPool(
        templates={
            "greeting": (
                "Howdy!", "Greetings.", "Hi, friend.", "Hey, how's it going?",
                "Good day!", "Hello, anyone home?", "Yo!", "Hi again, nice to see you.",
            ),
            "question": (
                "What is the tallest mountain in {place}?", "How can I get better at {task}?",
                "Why does the {thing} turn {color} at times?",
                "Where does the idea of {topic} come from?",
                "Can you explain {topic} to a child?", "Is {place} a safe destination?",
                "What currency is used in {place}?",
                "How much time should I set aside to {task}?",
            ),
            "request": (
                "Compose a haiku about {topic}.", "Write a toast for {people} about {topic}.",
                "Outline a talk about {topic}.", "List three facts about {place}.",
                "Suggest a name for a blog about {topic}.",
                "Create a budget for a month in {place}.",
                "Write instructions to {task}.", "Describe a day in {place} as a tour guide.",
            ),
        },
        fills={
            "place": ("Brazil", "Portugal", "Ghana", "Korea", "Mexico", "Finland", "Morocco",
                      "Greece", "India", "Venus", "Scotland", "Nepal"),
            "topic": ("dogs", "the tundra", "frost", "jazz", "bicycles", "the forest at dawn",
                      "childhood", "snowfall", "a harbor", "rivers", "my kitchen",
                      "deep caves"),
            "task": ("paint a room", "strum a guitar", "cook rice", "write a resume",
                     "save money", "sleep better", "grow basil", "clean a keyboard",
                     "meditate", "train a puppy"),
            "people": ("my neighbor", "my doctor", "the council", "my coach", "a supplier",
                       "my brother"),
            "thing": ("comet", "stream", "leaf", "cloud", "sand", "fog"),
            "color": ("silver", "brown", "yellow", "gray", "bright", "pale"),
        }),
}
POOL_NAMES = tuple(POOLS)
FILL_ORDER = ("place", "topic", "task", "people", "thing", "color")
MESSAGE_TYPES = tuple(POOLS["train"].templates)
# Questions are where the tiny model's replies are long, so they carry most of the weight.
TYPE_WEIGHTS = {"greeting": 0.2, "question": 0.6, "request": 0.2}


def prompt_pool(name: str) -> PromptPool:
    try:
        return POOLS[name]
    except KeyError:
        raise ValueError(f"unknown prompt pool {name!r}; known: {list(POOLS)}") from None


def make_request(rng: random.Random, weights: dict[str, float] | None = None,
                 pool: str = "train") -> tuple[str, str]:
    """(message type, text) of one fresh user request from prompt pool ``pool``, drawn from
    ``rng``."""
    p = prompt_pool(pool)
    weights = weights or TYPE_WEIGHTS
    kind = rng.choices(list(weights), list(weights.values()))[0]
    template = rng.choice(p.templates[kind])
    # Every fill is drawn (in a fixed order) whether the template uses it or not, so a
    # message's draws never depend on which template came up.
    fills = {name: rng.choice(p.fills[name]) for name in FILL_ORDER}
    return kind, template.format(**fills)


def follow_up(feedback: str, request: str) -> str:
    """The user's next message: their reaction to the last reply, then the next request."""
    return f"{feedback} {request}"


_FINGERPRINT = re.compile(r"^clawray-policy-v(\d+)$")


def parse_policy_version(system_fingerprint: str | None) -> int | None:
    """The policy version from a response's ``system_fingerprint`` ("clawray-policy-v{N}")."""
    m = _FINGERPRINT.match(system_fingerprint or "")
    return int(m.group(1)) if m else None


@dataclasses.dataclass
class Interaction:
    """One request of a simulated user and what came back."""

    user: int  # -1 for an evaluation request
    session_id: str
    turn: int  # 1-based index of the request within its session
    message_type: str  # greeting | question | request | closing (the feedback-only last message)
    request: str  # the user message sent
    reply: str | None
    satisfied: bool | None  # None: not judged (the closing turn, or an error)
    policy_version: int | None
    latency_s: float
    response_id: str | None = None
    error: str | None = None


def satisfaction_rate(interactions: Sequence[Interaction]) -> float | None:
    """The share of judged replies that satisfied the user; None if none was judged."""
    judged = [i.satisfied for i in interactions if i.satisfied is not None]
    return sum(judged) / len(judged) if judged else None


_FILL_STOPWORDS = frozenset({"a", "an", "at", "in", "my", "of", "the", "to"})


def topic_words(text: str, pool: str = "test") -> set[str]:
    """The content words of the fills a request of prompt pool ``pool`` was made from (its
    place, topic, task, thing, colour, people; "a", "the", "my" left out): "Can you explain
    jazz to a child?" → {"jazz"}. Empty for a greeting."""
    words: set[str] = set()
    for values in prompt_pool(pool).fills.values():
        for value in values:
            if re.search(rf"\b{re.escape(value)}\b", text):
                words |= {w.lower() for w in re.findall(r"[A-Za-z]+", value)} - _FILL_STOPWORDS
    return words


@dataclasses.dataclass
class EvalResult:
    rate: float  # satisfied / judged replies (0.0 if none)
    n: int  # judged replies
    per_type: dict[str, float]
    errors: int
    policy_versions: list[int]  # distinct versions that answered
    interactions: list[Interaction]
    # Of the judged replies to questions and requests, the share that names the request's
    # topic (``on_topic``); None if there were none.
    on_topic: float | None = None
    on_topic_n: int = 0  # the replies to questions and requests it is the share of


async def _ask(client: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]],
               headers: dict[str, str], *, max_tokens: int, temperature: float,
               seed: int | None = None) -> tuple[str, int | None, str, float]:
    """(reply text, policy version, response id, latency) of one chat completion."""
    t0 = time.perf_counter()
    r = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=temperature,
        top_p=1.0, seed=seed, extra_headers=headers)
    return (r.choices[0].message.content or "", parse_policy_version(r.system_fingerprint), r.id,
            time.perf_counter() - t0)


def _error_text(e: Exception) -> str:
    status = getattr(e, "status_code", None)
    return f"{type(e).__name__}{f' {status}' if status else ''}: {e}"[:500]


@dataclasses.dataclass
class SimUser:
    """One simulated user: runs sessions one after another, judging every reply.

    Every request carries a sampling seed drawn from ``rng``, so a run is repeatable for given
    weights (the served engine seeds each request on its own)."""

    user: int
    client: openai.AsyncOpenAI
    model: str
    preference: Preference
    rng: random.Random
    turns_per_session: int = 3
    max_tokens: int = 48
    temperature: float = 1.0
    run_tag: str = "sim"
    on_interaction: Callable[[Interaction], None] | None = None
    type_weights: dict[str, float] | None = None
    pool: str = "train"  # the prompt pool its requests come from
    sessions_run: int = 0

    async def run_session(self) -> list[Interaction]:
        """One session of ``turns_per_session`` judged replies plus the closing message.

        An error ends the session early (the server's idle timeout closes it)."""
        self.sessions_run += 1
        session_id = f"{self.run_tag}-u{self.user}-s{self.sessions_run}"
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        kind, request = make_request(self.rng, self.type_weights, self.pool)
        text = request
        out: list[Interaction] = []
        for turn in range(1, self.turns_per_session + 2):
            closing = turn > self.turns_per_session
            headers = {"X-Session-Id": session_id, "X-Turn-Type": "main"}
            if closing:
                headers["X-Session-Done"] = "true"
            messages.append({"role": "user", "content": text})
            rec = Interaction(self.user, session_id, turn, "closing" if closing else kind, text,
                              None, None, None, 0.0)
            t0 = time.perf_counter()
            try:
                rec.reply, rec.policy_version, rec.response_id, rec.latency_s = await _ask(
                    self.client, self.model, messages, headers, max_tokens=self.max_tokens,
                    temperature=self.temperature, seed=self.rng.getrandbits(31))
            except openai.APIError as e:
                rec.error, rec.latency_s = _error_text(e), time.perf_counter() - t0
                logger.warning("sim user %d: session %s turn %d failed: %s", self.user,
                               session_id, turn, rec.error)
            topic = topic_words(request, self.pool)  # what an answer names (greetings: none)
            if rec.reply is not None and not closing:
                rec.satisfied = self.preference.satisfied(rec.reply, topic)
            self._emit(rec)
            out.append(rec)
            if rec.error is not None or closing:
                break
            # The reply goes back exactly as received: that is how the server finds it again.
            messages.append({"role": "assistant", "content": rec.reply})
            feedback = self.preference.feedback(rec.reply, bool(rec.satisfied), self.rng, topic)
            if turn < self.turns_per_session:
                kind, request = make_request(self.rng, self.type_weights, self.pool)
                text = follow_up(feedback, request)
            else:
                text = feedback
        return out

    def _emit(self, rec: Interaction) -> None:
        if self.on_interaction is not None:
            self.on_interaction(rec)


def make_client(base_url: str, api_key: str, *, timeout_s: float, concurrency: int
                ) -> openai.AsyncOpenAI:
    """An SDK client without retries (a retry would hide an error the run must count)."""
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 4,
                          max_keepalive_connections=max(concurrency, 1) + 4)
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                              timeout=timeout_s,
                              http_client=openai.DefaultAsyncHttpxClient(limits=limits))


async def run_users(base_url: str, api_key: str, model: str, *, num_users: int = 4,
                    sessions_per_user: int | None = None, duration_s: float | None = None,
                    turns_per_session: int = 3, seed: int = 0,
                    preference: Preference | None = None, max_tokens: int = 48,
                    temperature: float = 1.0,
                    on_interaction: Callable[[Interaction], None] | None = None,
                    timeout_s: float = 60.0, type_weights: dict[str, float] | None = None,
                    pool: str = "train") -> list[Interaction]:
    """Run ``num_users`` users concurrently; each runs ``sessions_per_user`` sessions, or
    starts new sessions until ``duration_s`` has passed (exactly one of the two is given).
    User ``i`` draws its messages and its requests' sampling seeds from
    ``random.Random(f"{seed}/{i}")``, so a run is repeatable for given weights."""
    if (sessions_per_user is None) == (duration_s is None):
        raise ValueError("give exactly one of sessions_per_user and duration_s")
    if num_users < 1 or turns_per_session < 1:
        raise ValueError("num_users and turns_per_session must be at least 1")
    preference = preference or BriefReplies()
    prompt_pool(pool)  # an unknown pool is an error before anything is sent
    tag = f"sim-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + duration_s if duration_s is not None else None
    client = make_client(base_url, api_key, timeout_s=timeout_s, concurrency=num_users)
    users = [SimUser(i, client, model, preference, random.Random(f"{seed}/{i}"),
                     turns_per_session, max_tokens, temperature, tag, on_interaction,
                     type_weights, pool) for i in range(num_users)]

    async def drive(user: SimUser) -> list[Interaction]:
        out: list[Interaction] = []
        while (user.sessions_run < sessions_per_user if deadline is None
               else time.monotonic() < deadline):
            out += await user.run_session()
        return out

    try:
        results = await asyncio.gather(*(drive(u) for u in users))
    finally:
        await client.close()
    return [i for r in results for i in r]


def eval_messages(n: int, seed: int, type_weights: dict[str, float] | None = None,
                  pool: str = "test") -> list[tuple[str, str]]:
    """The fixed evaluation set: ``n`` (type, text) requests from prompt pool ``pool`` (the
    held-out "test" pool by default; "validation" for choosing settings), the same for the
    same seed."""
    rng = random.Random(f"eval/{seed}")
    return [make_request(rng, type_weights, pool) for _ in range(n)]


def shadow_set(n: int = 40, seed: int = 0, pool: str = "validation", preference: str = "brief",
               type_weights: dict[str, float] | None = None) -> ShadowSet:
    """The policy gate's held-out set from the simulated users (``gate.shadow_set:
    clawray.sim.users:shadow_set``): ``eval_messages(n, seed, pool)`` as chat prompts, a reply
    scoring 1 when ``preference`` is satisfied by it, else 0. The "validation" pool by default,
    so the "test" pool stays for reporting."""
    pref = get_preference(preference)
    prompts = [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
               for _, text in eval_messages(n, seed, type_weights, pool)]
    topics = [topic_words(p[-1]["content"], pool) for p in prompts]
    return ShadowSet(prompts, score=lambda i, text: float(pref.satisfied(text, topics[i])),
                     name=f"sim {pool} pool, {n} requests, {preference} preference")


async def evaluate(base_url: str, api_key: str, model: str, *, n: int = 100, seed: int = 0,
                   preference: Preference | None = None, max_tokens: int = 48,
                   temperature: float = 1.0, concurrency: int = 8, timeout_s: float = 60.0,
                   type_weights: dict[str, float] | None = None, pool: str = "test"
                   ) -> EvalResult:
    """Satisfaction rate on ``eval_messages(n, seed, pool=pool)``, sent as single-turn side
    requests (the held-out "test" pool by default: no training user ever sends these).

    Request ``i`` samples with seed ``seed * 100_003 + i``, so the same weights give the same
    replies and a before/after difference is the policy's, not the dice's."""
    preference = preference or BriefReplies()
    session_id = f"sim-eval-{uuid.uuid4().hex[:8]}"
    headers = {"X-Session-Id": session_id, "X-Turn-Type": "side"}
    client = make_client(base_url, api_key, timeout_s=timeout_s, concurrency=concurrency)
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int, kind: str, text: str) -> Interaction:
        rec = Interaction(-1, session_id, i, kind, text, None, None, None, 0.0)
        t0 = time.perf_counter()
        async with slots:
            try:
                rec.reply, rec.policy_version, rec.response_id, rec.latency_s = await _ask(
                    client, model, [{"role": "system", "content": SYSTEM_PROMPT},
                                    {"role": "user", "content": text}], headers,
                    max_tokens=max_tokens, temperature=temperature, seed=seed * 100_003 + i)
                rec.satisfied = preference.satisfied(rec.reply, topic_words(text, pool))
            except openai.APIError as e:
                rec.error, rec.latency_s = _error_text(e), time.perf_counter() - t0
                logger.warning("sim eval request %d failed: %s", i, rec.error)
        return rec

    try:
        recs = await asyncio.gather(*(one(i, k, t) for i, (k, t) in
                                      enumerate(eval_messages(n, seed, type_weights, pool))))
    finally:
        await client.close()
    judged = [r for r in recs if r.satisfied is not None]
    per_type = {k: satisfaction_rate([r for r in judged if r.message_type == k])
                for k in sorted({r.message_type for r in judged})}
    return EvalResult(rate=satisfaction_rate(judged) or 0.0, n=len(judged),
                      per_type={k: v for k, v in per_type.items() if v is not None},
                      errors=sum(r.error is not None for r in recs),
                      policy_versions=sorted({r.policy_version for r in judged
                                              if r.policy_version is not None}),
                      interactions=recs, **on_topic_rate(judged, pool))


def on_topic_rate(interactions: Sequence[Interaction], pool: str) -> dict[str, Any]:
    """``on_topic``: the share of ``interactions``' replies to questions and requests that
    name their request's topic (``on_topic``; None if there were none); ``on_topic_n``: how
    many replies that share is of."""
    hits = [on_topic(i.reply or "", topic_words(i.request, pool)) for i in interactions]
    hits = [h for h in hits if h is not None]
    return {"on_topic": sum(hits) / len(hits) if hits else None, "on_topic_n": len(hits)}
