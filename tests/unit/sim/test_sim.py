"""Simulated users without a server: preference ↔ heuristic judge, message generation, the
session protocol a SimUser speaks (against a mock HTTP transport), error accounting."""

from __future__ import annotations

import json
import random
import re

import httpx
import openai
import pytest

from clawray.judging.rules import classify_next_state
from clawray.models.corpus import REPLY_GREETING, REPLY_OTHER, REPLY_QUESTION
from clawray.sim import (BriefReplies, DetailedReplies, Preference, SimUser, get_preference, make_request,
                         parse_policy_version, run_users, satisfaction_rate)
from clawray.sim.feedback import PHRASINGS, REASONS
from clawray.sim.users import FILL_ORDER, MESSAGE_TYPES, POOL_NAMES, POOLS, eval_messages

REPLIES = [REPLY_GREETING, REPLY_QUESTION, REPLY_OTHER, "", "  ", "Yes.",
           "one two three four five six seven eight",
           "one two three four five six seven eight nine",
           "Good question. I am a small model, so my answers answers are.", "OK, I understand.one."]


def sentiment(text: str) -> bool | None:
    """Whether ``text`` holds the users' approval (True), a complaint (False) or neither."""
    low, p = text.lower(), PHRASINGS["users"]
    words = {True: {*p.positive_openers, *p.positive_bodies},
             False: {*p.negative_openers, *(b for bs in p.negative_bodies.values() for b in bs)}}
    said = {ok for ok in (True, False) if any(w.lower() in low for w in words[ok])}
    assert len(said) < 2, text
    return said.pop() if said else None


def verdict(text: str) -> int:
    return classify_next_state([{"role": "user", "content": text}])[0]


def test_brief_preference_on_the_canned_replies():
    pref = BriefReplies()
    assert isinstance(pref, Preference) and get_preference("brief") == pref
    assert pref.satisfied(REPLY_GREETING) and pref.satisfied(REPLY_OTHER)
    assert not pref.satisfied(REPLY_QUESTION)  # 12 words
    assert not pref.satisfied("") and not pref.satisfied(" \n")
    assert pref.satisfied("one two three four five six seven eight")
    assert not pref.satisfied("one two three four five six seven eight nine")
    with pytest.raises(ValueError, match="unknown preference"):
        get_preference("verbose")


def test_detailed_is_the_opposite_of_brief_on_readable_replies():
    pref = DetailedReplies()
    assert isinstance(pref, Preference) and get_preference("detailed") == pref
    assert pref.satisfied(REPLY_QUESTION)  # 12 words
    assert not pref.satisfied(REPLY_GREETING) and not pref.satisfied(REPLY_OTHER)
    assert not pref.satisfied("one two three four five six seven eight nine")
    assert pref.satisfied("one two three four five six seven eight nine ten")
    assert not pref.satisfied(", , , , , , , , , , , ,")  # ten "words" of punctuation
    for reply in REPLIES:
        if reply.strip() and len(reply.split()) <= 8:  # readable here: brief xor detailed
            assert BriefReplies().satisfied(reply) != pref.satisfied(reply), reply
    rng, words = random.Random(0), PHRASINGS["users"]
    for reply in REPLIES:
        ok = pref.satisfied(reply)
        feedback = pref.feedback(reply, ok, rng)
        assert sentiment(feedback) == ok, feedback
        if not ok and reply.strip():
            assert any(b.lower() in feedback.lower() for b in words.negative_bodies["short"]), \
                (reply, feedback)
    said = DetailedReplies(phrasing="keywords").feedback("Hi.", False, rng)
    assert verdict(said) == -1, said  # the heuristic judge reads the keyword wording


def test_feedback_follows_the_preference_and_says_what_was_wrong():
    pref, rng = BriefReplies(), random.Random(0)
    words = PHRASINGS[pref.phrasing]
    assert pref.phrasing == "users"  # the wording no judge is trained on
    for i in range(400):
        reply = REPLIES[i % len(REPLIES)]
        ok = pref.satisfied(reply)
        feedback = pref.feedback(reply, ok, rng)
        assert sentiment(feedback) == ok, feedback
        if not ok:
            reason = "empty" if not reply.strip() else "long"
            assert any(b.lower() in feedback.lower() for b in words.negative_bodies[reason]), \
                (reply, feedback)


def test_every_request_is_neutral_to_the_judge():
    for pool in POOL_NAMES:
        rng = random.Random(1)
        texts = {make_request(rng, pool=pool)[1] for _ in range(5000)}
        assert len(texts) > 200
        assert [t for t in texts if verdict(t) != 0] == []


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower()))


def test_train_validation_and_test_pools_share_no_template_no_fill_and_no_message():
    # Disjoint by construction: no template, no fill-in phrase, no content word in common.
    stop = {"a", "an", "the", "my", "in", "of", "to", "for", "about", "at", "is", "how", "what",
            "why", "can", "where", "do", "i", "me", "you", "it", "on", "there", "and", "does",
            "should", "hi", "hey", "hello", "a", "good", "again", "day", "time", "three", "write",
            "people", "place", "topic", "task", "thing", "color", "set", "describe", "outline",
            "suggest", "compose", "morning", "evening", "afternoon", "some", "as", "be", "get",
            "look", "turn", "into", "when", "much", "from", "come", "idea", "before", "name",
            "note", "sometimes", "times", "start", "trip", "list", "make", "better", "through",
            "long", "up", "new", "safe", "plan", "guide", "tell", "sights", "a", "child"}
    vocab = {}
    for name, pool in POOLS.items():
        assert set(pool.templates) == set(MESSAGE_TYPES) and set(pool.fills) == set(FILL_ORDER)
        words = set()
        for texts in (*pool.templates.values(), *pool.fills.values()):
            for t in texts:
                words |= _words(re.sub(r"\{\w+\}", " ", t))
        vocab[name] = words - stop
    names = list(POOLS)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            pa, pb = POOLS[a], POOLS[b]
            for kind in MESSAGE_TYPES:
                assert not set(pa.templates[kind]) & set(pb.templates[kind]), (a, b, kind)
            for fill in FILL_ORDER:
                assert not set(pa.fills[fill]) & set(pb.fills[fill]), (a, b, fill)
            assert not vocab[a] & vocab[b], (a, b, sorted(vocab[a] & vocab[b]))
    # And so by draw: the training users' requests never include an evaluation message.
    rng = random.Random(0)
    train = {make_request(rng)[1] for _ in range(20_000)}
    for pool in ("validation", "test"):
        held_out = {t for _, t in eval_messages(500, seed=0, pool=pool)}
        assert len(held_out) > 100 and not held_out & train, pool
    assert eval_messages(50, seed=0) == eval_messages(50, seed=0, pool="test")
    with pytest.raises(ValueError, match="unknown prompt pool 'dev'"):
        make_request(rng, pool="dev")


def test_every_pool_keeps_the_learning_problem():
    # Each pool's questions open with the words the embedded model's long reply is imprinted
    # on, and each pool has every message type, so its base rate sits where the train pool's
    # does (measured: python -m clawray.sim measure --pool test).
    for name in POOL_NAMES:
        rng = random.Random(2)
        questions = [make_request(rng, {"question": 1.0}, name)[1] for _ in range(200)]
        assert all(q.split()[0] in ("What", "How", "Why", "Can", "Is", "Where")
                   and q.endswith("?") for q in questions), name


def test_message_generator_is_deterministic_by_seed_and_honours_weights():
    def draw(seed, n=50, weights=None):
        rng = random.Random(seed)
        return [make_request(rng, weights) for _ in range(n)]

    assert draw(3) == draw(3)
    assert draw(3) != draw(4)
    assert {k for k, _ in draw(5, 300)} == set(MESSAGE_TYPES)
    assert {k for k, _ in draw(5, 100, {"question": 1.0})} == {"question"}
    assert all(t.endswith("?") for _, t in draw(5, 100, {"question": 1.0}))
    assert eval_messages(30, seed=2) == eval_messages(30, seed=2) != eval_messages(30, seed=3)


def test_policy_version_parsing():
    assert parse_policy_version("clawray-policy-v0") == 0
    assert parse_policy_version("clawray-policy-v17") == 17
    for bad in (None, "", "fp_44709d6fcb", "clawray-policy-v", "clawray-policy-vx",
                "x-clawray-policy-v3"):
        assert parse_policy_version(bad) is None


def _mock_server(replies: list[str], seen: list[httpx.Request]):
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        text = replies[(len(seen) - 1) % len(replies)]
        return httpx.Response(200, json={
            "id": f"chatcmpl-{len(seen)}", "object": "chat.completion", "created": 0,
            "model": "m", "system_fingerprint": "clawray-policy-v5",
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": text}}]})
    return handler


async def test_a_session_sends_feedback_then_the_next_request_and_ends_with_done():
    seen: list[httpx.Request] = []
    replies = [REPLY_QUESTION, REPLY_OTHER, REPLY_GREETING, "unjudged closing reply"]
    client = openai.AsyncOpenAI(base_url="http://sim.test/v1", api_key="k", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(
                                    _mock_server(replies, seen))))
    got = []
    user = SimUser(0, client, "m", BriefReplies(), random.Random(9), turns_per_session=3,
                   run_tag="t", on_interaction=got.append)
    out = await user.run_session()
    assert got == out and len(out) == 4 and len(seen) == 4
    assert [i.turn for i in out] == [1, 2, 3, 4]
    assert [i.satisfied for i in out] == [False, True, True, None]
    assert out[-1].message_type == "closing" and out[-1].reply == "unjudged closing reply"
    assert all(i.policy_version == 5 and i.error is None for i in out)
    assert len({i.session_id for i in out}) == 1
    bodies = [json.loads(r.content) for r in seen]
    headers = [r.headers for r in seen]
    assert {h["x-session-id"] for h in headers} == {out[0].session_id}
    assert [h.get("x-session-done") for h in headers] == [None, None, None, "true"]
    assert {h["x-turn-type"] for h in headers} == {"main"}
    last = bodies[-1]["messages"]
    assert [m["role"] for m in last] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in last if m["role"] == "assistant"] == replies[:3]  # verbatim
    users = [m["content"] for m in last if m["role"] == "user"]
    # each next message says the last reply's fate (the first is a request alone)
    assert [sentiment(u) for u in users] == [None, False, True, True], users
    assert users == [i.request for i in out]
    assert bodies[0]["temperature"] == 1.0 and bodies[0]["max_tokens"] == 48
    assert satisfaction_rate(out) == pytest.approx(2 / 3)


async def test_run_users_records_errors_without_crashing():
    from tests.support.common import free_port  # nothing listens there

    out = await run_users(f"http://127.0.0.1:{free_port()}/v1", "k", "m", num_users=3,
                          sessions_per_user=2, turns_per_session=2, timeout_s=5)
    assert len(out) == 6  # each session stops at its first error
    assert all(i.error and "APIConnectionError" in i.error and i.satisfied is None for i in out)
    assert len({i.session_id for i in out}) == 6


async def test_run_users_wants_exactly_one_stop_rule():
    for kw in ({}, {"sessions_per_user": 1, "duration_s": 1.0}):
        with pytest.raises(ValueError, match="exactly one"):
            await run_users("http://127.0.0.1:9/v1", "k", "m", **kw)


def test_on_topic_asks_that_a_reply_names_its_requests_fill_words():
    from clawray.sim.users import POOLS, eval_messages, on_topic, topic_words

    assert topic_words("Can you explain jazz to a child?") == {"jazz"}
    assert topic_words("Write a toast for my doctor about a harbor.") == {"doctor", "harbor"}
    assert topic_words("Howdy!") == set() and on_topic("Hi!", set()) is None
    mars = topic_words("Is Venus a safe destination?")
    assert on_topic("Space.", mars) is False and on_topic("Venus is hot.", mars) is True
    rivers = topic_words("Can you explain rivers to a child?")
    assert on_topic("A river flows to the sea.", rivers) is True  # singular of a plural
    assert on_topic("Water flows to the sea.", rivers) is False
    assert on_topic("Argentine food is great.", topic_words(
        "What do people eat for breakfast in Argentina?", "validation")) is True
    # every question and request of every pool has words to name; no greeting has any
    for pool in POOLS:
        for kind, text in eval_messages(200, 3, pool=pool):
            assert bool(topic_words(text, pool)) == (kind != "greeting"), (pool, text)


def test_on_topic_rate_is_a_share_of_the_replies_to_questions_and_requests():
    from clawray.sim.users import Interaction, on_topic_rate

    def rec(request: str, reply: str) -> Interaction:
        return Interaction(-1, "s", 1, "question", request, reply, True, 0, 0.0)

    recs = [rec("Is Venus a safe destination?", "Venus is hot."),
            rec("What currency is used in Nepal?", "Money."), rec("Howdy!", "Hi!")]
    assert on_topic_rate(recs, "test") == {"on_topic": 0.5, "on_topic_n": 2}
    assert on_topic_rate([recs[2]], "test") == {"on_topic": None, "on_topic_n": 0}


async def test_concise_answers_want_a_short_reply_that_names_what_was_asked():
    from clawray.sim.users import topic_words

    pref, rng = get_preference("concise_answer"), random.Random(0)
    assert isinstance(pref, Preference) and pref.phrasing == "users"
    venus = topic_words("Is Venus a safe destination?")
    assert pref.satisfied("Venus is safe to visit.", venus)
    assert not pref.satisfied("Space is vast.", venus)  # short, but about something else
    assert BriefReplies().satisfied("Space is vast.", venus)  # brevity alone ignores the topic
    assert not pref.satisfied("Venus " + "is very hot " * 7, venus)  # names it, too long
    assert pref.satisfied("Hello there!", set()) and pref.satisfied("Hi!")  # nothing to name
    bodies = PHRASINGS["users"].negative_bodies
    for reply, reason in (("Space is vast.", "off_topic"), ("Venus " + "is hot " * 12, "long"),
                          ("", "empty")):
        said = pref.feedback(reply, False, rng, venus)
        assert sentiment(said) is False and any(b in said.lower() for b in bodies[reason]), \
            (reply, said)
    # a user's session judges each reply by the request it answers, not by the follow-up text
    seen: list[httpx.Request] = []
    client = openai.AsyncOpenAI(base_url="http://sim.test/v1", api_key="k", max_retries=0,
                                http_client=httpx.AsyncClient(transport=httpx.MockTransport(
                                    _mock_server(["Okay, sure."], seen))))
    for p, want in ((pref, False), (BriefReplies(), True)):
        user = SimUser(0, client, "m", p, random.Random(3), turns_per_session=3, run_tag="t",
                       type_weights={"question": 1.0})
        out = await user.run_session()
        assert [i.satisfied for i in out[:3]] == [want] * 3, p.name
    assert "off_topic" in REASONS
