"""Golden tests of the live-session state machine (docs/sessions.md, "The rules"), without Ray."""

from __future__ import annotations

import itertools

import pytest

from clawray.records import TurnRecord, session_key
from clawray.serve.protocol import ChatCompletionRequest, normalize_messages
from clawray.sessions.core import SessionCore, SessionRules, Verdict, score_of
from tests.support.common import load_fixture

_ids = itertools.count(1)
SYS = {"role": "system", "content": "You are helpful."}


def rec(messages, reply="ok", *, session="s", calls=(), t=0.0, dur=1.0, turn_type="main",
        done=False, retry=False, finish="stop", rid=None, tenant="local",
        user_id=None) -> TurnRecord:
    return TurnRecord(
        record_id=rid or f"chatcmpl-{next(_ids)}", session_id=session, session_id_source="header",
        turn_type=turn_type, session_done=done, model="m", prompt_ids=[1, 2, 3],
        response_ids=[4, 5], response_logprobs=[-0.1, -0.2], finish_reason=finish,
        policy_version=0, policy_version_end=None, messages=list(messages), tools=None,
        sampling={}, response_text=reply, tool_calls=list(calls), created_at=int(t),
        finished_at=t + dur, started_at=t, retry=retry, tenant=tenant, user=user_id)


def user(text):
    return {"role": "user", "content": text}


def asst(text, calls=None):
    m = {"role": "assistant", "content": text}
    if calls:
        m["tool_calls"] = calls
    return m


def core(**kw) -> SessionCore:
    kw.setdefault("feedback_window_s", 0.0)
    return SessionCore(SessionRules(**kw))


def judge_all(c: SessionCore, votes, now=100.0):
    jobs, done = c.drain()
    for job in jobs:
        c.on_verdict(job.job_id, Verdict("judged", list(votes)), now)
    more_jobs, more = c.drain()
    return jobs, done + more


def test_next_state_is_the_message_after_the_reply():
    c = core()
    r1 = rec([SYS, user("What is 2+2?")], "4", t=0)
    c.on_record(r1, 1)
    assert c.drain() == ([], [])  # waits for its next state
    c.on_record(rec([SYS, user("What is 2+2?"), asst("4"), user("thanks!")], "bye", t=5), 6)
    jobs, done = c.drain()
    assert len(jobs) == 1 and jobs[0].record is r1
    assert jobs[0].next_state == [user("thanks!")]
    assert jobs[0].request == [user("What is 2+2?")]
    c.on_verdict(jobs[0].job_id, Verdict("judged", [1, 1, None]), 7)
    _, done = c.drain()
    assert [(f.record.record_id, f.status, f.turn) for f in done] == [(r1.record_id, "judged", 1)]


def _fixture_record(name, reply="", calls=(), t=0.0):
    data = load_fixture(name)
    req = ChatCompletionRequest.model_validate(
        {k: v for k, v in data["body"].items() if k != "prompt_cache_key"})
    return rec(normalize_messages(req.messages), reply, calls=calls, session="s1", t=t)


def test_openclaw_session_ephemeral_context_and_rewritten_tool_ids():
    """The real captured session: the trailing internal-context message is not a next state,
    and the tool call comes back with a rewritten id and re-serialized arguments."""
    c = core()
    t1 = _fixture_record("session_s1_t1.json", "STUB-REPLY #2: I have seen 2 user message(s). ")
    t2 = _fixture_record("session_s1_t2.json", "STUB-REPLY #3: I have seen 3 user message(s). ",
                         t=10)
    call = {"id": "call_stub1", "type": "function",
            "function": {"name": "ls", "arguments": '{"path": "."}'}}
    t3a = _fixture_record("session_s1_t3_req1.json", "", calls=[call], t=20)
    t3b = _fixture_record("session_s1_t3_req2.json", "Here is the listing.", t=30)
    for i, r in enumerate([t1, t2, t3a, t3b]):
        c.on_record(r, r.started_at + 1)
    jobs, _ = c.drain()
    by = {j.record.record_id: j for j in jobs}
    assert set(by) == {t1.record_id, t2.record_id, t3a.record_id}
    assert [m["content"] for m in by[t1.record_id].next_state] == [
        "[Sun 2026-11-29 22:31 UTC] And what is 3+3?"]
    assert [m["role"] for m in by[t3a.record_id].next_state] == ["tool"]
    assert by[t3a.record_id].next_state[0]["content"].startswith('".git/"')
    # the judge sees the user's request, without the ephemeral context
    assert by[t3a.record_id].request[-1]["content"].endswith("list the workspace.")
    # the OPD teacher sees what the student saw (the ephemeral context included); the hint
    # goes on the user's request, not on the ephemeral message
    from clawray.judging.opd import HINT_HEADER, inject_hint

    assert by[t3a.record_id].hint_messages == t3a.messages
    assert "BEGIN_OPENCLAW_INTERNAL_CONTEXT" in t3a.messages[-1]["content"]
    hinted = inject_hint(by[t3a.record_id].hint_messages, "List hidden files too.")
    assert hinted[-1] == t3a.messages[-1] and HINT_HEADER in hinted[-2]["content"]


def test_side_turns_produce_nothing_and_consume_no_next_state():
    c = core()
    r1 = rec([SYS, user("hi")], "hello", t=0)
    c.on_record(r1, 1)
    c.on_record(rec([SYS, user("summarize memory")], "summary", turn_type="side", t=2), 3)
    assert c.drain() == ([], [])
    assert c.stats()["side_turns"] == 1 and c.stats()["turns"] == 1
    c.on_record(rec([SYS, user("hi"), asst("hello"), user("now what?")], t=5), 6)
    jobs, _ = c.drain()
    assert [j.record.record_id for j in jobs] == [r1.record_id]


def test_session_done_finalizes_pending_and_late_verdict_does_not_resurrect():
    c = core()
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    r2 = rec([SYS, user("a"), asst("A"), user("b")], "B", t=2, done=True)
    c.on_record(r2, 3)
    jobs, done = c.drain()
    assert [j.record.record_id for j in jobs] == [r1.record_id]  # r1 is being judged
    assert [(f.record.record_id, f.status) for f in done] == [(r2.record_id, "no_next_state")]
    assert c.stats()["sessions"] == 0
    c.on_verdict(jobs[0].job_id, Verdict("judged", [1, 1, 1]), 4)
    _, done = c.drain()
    assert [(f.record.record_id, f.status) for f in done] == [(r1.record_id, "judged")]
    assert c.stats()["sessions"] == 0 and c.stats()["late_results"] == 1


def test_idle_timeout_finalizes_last_turn():
    c = core(idle_timeout_s=30)
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    c.tick(20)
    assert c.drain() == ([], [])
    c.tick(31)
    _, done = c.drain()
    assert [(f.record.record_id, f.status) for f in done] == [(r1.record_id, "no_next_state")]
    assert c.stats()["sessions"] == 0 and c.stats()["sessions_idle"] == 1


def test_at_least_one_keeps_first_zero_score_turn_with_soft_reward():
    c = core()
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    c.on_record(rec([SYS, user("a"), asst("A"), user("hmm")], "B", t=2, done=True), 3)
    jobs, done = c.drain()
    c.on_verdict(jobs[0].job_id, Verdict("judged", [1, 0, 0]), 4)
    _, done = c.drain()
    assert len(done) == 1 and done[0].at_least_one and done[0].soft_score == pytest.approx(1 / 3)


def test_at_least_one_not_used_when_session_has_an_effective_turn():
    c = core()
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    r2 = rec([SYS, user("a"), asst("A"), user("b")], "B", t=2)
    c.on_record(r2, 3)
    (j1,), _ = c.drain()
    c.on_verdict(j1.job_id, Verdict("judged", [0, 0, 1]), 4)  # score 0: held as the candidate
    assert c.drain()[1] == []
    c.on_record(rec([SYS, user("a"), asst("A"), user("b"), asst("B"), user("thanks")], t=5), 6)
    (j2,), _ = c.drain()
    c.on_verdict(j2.job_id, Verdict("judged", [1, 1, 1]), 7)
    _, done = c.drain()
    assert {f.record.record_id: f.at_least_one for f in done} == {
        r2.record_id: False, r1.record_id: False}


@pytest.mark.parametrize("edit", [False, True])
def test_regenerate_or_edit_is_a_negative_signal(edit):
    c = core()
    r1 = rec([SYS, user("a"), asst("A"), user("b")], "bad", t=0)
    c.on_record(r1, 1)
    again = [SYS, user("a"), asst("A"), user("b, but shorter" if edit else "b")]
    r2 = rec(again, "better", t=5)
    c.on_record(r2, 6)
    jobs, done = c.drain()
    assert jobs == []
    assert [(f.record.record_id, f.status) for f in done] == [(r1.record_id, "regenerated")]
    # the new request is a turn of its own
    assert r2.record_id in c.sessions[session_key("local", None, "s")].turns


def test_retry_and_concurrent_duplicates_are_not_regenerations():
    c = core()
    r1 = rec([SYS, user("a")], "A1", t=0, dur=5)
    c.on_record(r1, 5)
    r2 = rec([SYS, user("a")], "A2", t=6, retry=True)  # the SDK retried: not the user
    c.on_record(r2, 7)
    r3 = rec([SYS, user("a")], "A3", t=1, dur=1)  # sent while r1 was running
    c.on_record(r3, 8)
    assert c.drain() == ([], [])
    c.on_record(rec([SYS, user("a"), asst("A2"), user("next")], t=10), 11)
    jobs, done = c.drain()
    assert [j.record.record_id for j in jobs] == [r2.record_id]
    assert sorted((f.record.record_id, f.status) for f in done) == sorted(
        [(r1.record_id, "no_next_state"), (r3.record_id, "no_next_state")])


def test_duplicate_record_is_ignored():
    c = core()
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    c.on_record(r1, 1)
    assert c.stats()["duplicates"] == 1 and c.stats()["turns"] == 1


def test_out_of_order_records_still_pair_turn_and_next_state():
    c = core()
    r1 = rec([SYS, user("a")], "A", t=0)
    r2 = rec([SYS, user("a"), asst("A"), user("b")], "B", t=2)
    c.on_record(r2, 3)
    c.on_record(r1, 3.5)  # another ingress replica delivered it late
    jobs, _ = c.drain()
    assert [(j.record.record_id, j.next_state) for j in jobs] == [(r1.record_id, [user("b")])]


def test_reused_session_id_after_done_starts_fresh():
    c = core()
    c.on_record(rec([SYS, user("a")], "A", t=0, done=True), 1)
    _, done = c.drain()
    r2 = rec([SYS, user("a")], "A", t=5)
    c.on_record(r2, 6)
    c.on_record(rec([SYS, user("a"), asst("A"), user("z")], t=7), 8)
    jobs, _ = c.drain()
    assert [j.record.record_id for j in jobs] == [r2.record_id]
    assert c.sessions[session_key("local", None, "s")].turns[jobs[0].record.record_id].turn == 1  # counting restarted


def test_sessions_do_not_mix():
    c = core()
    a = rec([SYS, user("a")], "A", session="x", t=0)
    c.on_record(a, 1)
    c.on_record(rec([SYS, user("a"), asst("A"), user("b")], session="y", t=2), 3)
    assert c.drain()[0] == []


def test_memory_is_bounded_under_many_sessions_and_nothing_is_lost(caplog):
    c = core(max_sessions=10)
    n = 1000
    for i in range(n):
        c.on_record(rec([SYS, user(f"q{i}")], "A", session=f"s{i}", t=i), i + 1)
    assert c.stats()["sessions"] <= 10
    c.tick(10 ** 9)
    _, done = c.drain()
    assert len(done) == n and len({f.record.record_id for f in done}) == n
    assert "session cap of 10 reached" in caplog.text


def test_pending_turns_per_session_are_capped():
    c = core(max_pending_turns=2)
    for i in range(5):
        c.on_record(rec([SYS, user(f"q{i}")], f"A{i}", t=i, dur=100), i + 1)  # concurrent
    _, done = c.drain()
    assert len(done) == 3 and all(f.status == "no_next_state" for f in done)


def test_feedback_by_response_id_and_by_session():
    c = core(feedback_window_s=30)
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    assert c.on_feedback(-1, "meh", 2, record_id=r1.record_id)["status"] == "applied"
    assert c.on_feedback(1, None, 2, record_id="chatcmpl-nope")["status"] == "unknown"
    assert c.on_feedback(1, "great session", 2,
                         session_key=session_key("local", None, "s"))["status"] == "applied"
    c.on_record(rec([SYS, user("a"), asst("A"), user("b")], t=3), 4)
    (job,), _ = c.drain()
    c.on_verdict(job.job_id, Verdict("judged", [1, 1, 1]), 5)
    assert c.drain()[1] == []  # held for the feedback window
    c.tick(36)
    _, done = c.drain()
    assert (done[0].outcome, done[0].outcome_scope, done[0].feedback_text) == (-1, "turn", "meh")
    assert c.on_feedback(1, None, 40, record_id=r1.record_id)["status"] == "sealed"


def test_tenants_sharing_a_session_id_never_touch_each_others_turns():
    """Two API keys (and two users of one key) send the same session id and the same opening;
    one ends "its" session and rates the other's turns: nothing of the other changes."""
    c = core(feedback_window_s=30)
    a1 = rec([SYS, user("hi")], "Hello!", t=0, tenant="key-a")
    c.on_record(a1, 1)
    # key-b: the same session id and messages, then ends the session and rates a1
    b1 = rec([SYS, user("hi")], "Hey.", t=1, tenant="key-b", done=True)
    c.on_record(b1, 2)
    u1 = rec([SYS, user("hi")], "Hi there", t=1, tenant="key-a", user_id="u1")
    c.on_record(u1, 2)
    _, done = c.drain()
    # b1 ended key-b's own session only (no next state); a1 is not "regenerated" by b1 or u1
    assert [(f.record.record_id, f.status) for f in done] == [(b1.record_id, "no_next_state")]
    assert c.on_feedback(-1, "x", 3, record_id=a1.record_id, tenant="key-b") == {
        "status": "unknown", "response_id": a1.record_id}
    for key in (session_key("key-b", None, "s"), session_key("key-a", None, "s")):
        assert c.on_feedback(-1, None, 3, session_key=key, tenant="key-b")["status"] == "unknown"
    # a1 gets its next state from key-a's second request, is judged and keeps no outcome
    c.on_record(rec([SYS, user("hi"), asst("Hello!"), user("thanks")], t=4, tenant="key-a"), 5)
    (job,), _ = c.drain()
    assert job.record is a1 and job.next_state == [user("thanks")]
    c.on_verdict(job.job_id, Verdict("judged", [1, 1, 1]), 6)
    c.tick(40)
    _, done = c.drain()
    fin = next(f for f in done if f.record is a1)
    assert (fin.status, fin.outcome, fin.turn) == ("judged", None, 1)
    # once emitted, another tenant still sees nothing (not even "sealed"); the owner sees sealed
    assert c.on_feedback(1, None, 41, record_id=a1.record_id, tenant="key-b")["status"] == "unknown"
    assert c.on_feedback(1, None, 41, record_id=a1.record_id, tenant="key-a")["status"] == "sealed"


def test_feedback_for_a_turn_whose_verdict_is_pending_after_its_session_ended_is_applied():
    c = core(feedback_window_s=30)
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    c.on_record(rec([SYS, user("a"), asst("A"), user("b")], t=2, done=True), 3)
    (job, *_), _ = c.drain()  # r1 is being judged; its session is gone
    assert job.record is r1 and not c.sessions
    result = c.on_feedback(1, "nice", 4, record_id=r1.record_id, tenant="local")
    assert (result["status"], result["client_session_id"]) == ("applied", "s")
    assert c.on_feedback(1, None, 4, record_id=r1.record_id, tenant="key-x")["status"] == \
        "unknown"
    c.on_verdict(job.job_id, Verdict("judged", [-1, -1, -1]), 5)
    _, done = c.drain()
    fin = next(f for f in done if f.record is r1)
    assert (fin.outcome, fin.outcome_scope, fin.feedback_text) == (1, "turn", "nice")


def test_next_state_stops_at_the_next_reply_whichever_record_arrives_first():
    """Turn 2's record is late (another replica) or never comes (collecting was off): turn 1's
    next state is still only the user's message after its reply."""
    c = core()
    r1 = rec([SYS, user("a")], "A", t=0)
    c.on_record(r1, 1)
    r3 = rec([SYS, user("a"), asst("A"), user("thanks"), asst("B"), user("c")], t=6)
    c.on_record(r3, 7)
    (job,), _ = c.drain()
    assert job.record is r1 and job.next_state == [user("thanks")]
    r2 = rec([SYS, user("a"), asst("A"), user("thanks")], "B", t=2)
    c.on_record(r2, 8)  # the late record: judged from r3, never rewrites r1's next state
    (job2,), _ = c.drain()
    assert job2.record is r2 and job2.next_state == [user("c")]
    # turn numbers follow the conversation, not arrival order
    turns = c.sessions[session_key("local", None, "s")].turns
    assert (turns[r1.record_id].turn, turns[r2.record_id].turn, turns[r3.record_id].turn) == (
        1, 2, 3)


@pytest.mark.parametrize("reply, calls, kept", [
    ("<think>the user wants a number</think>42", (), asst("42")),
    ("Let me look.", [{"id": "c1", "type": "function",
                       "function": {"name": "ls", "arguments": "{}"}}],
     asst("", [{"id": "x9", "type": "function", "function": {"name": "ls", "arguments": {}}}])),
])
def test_a_reply_the_client_rewrote_is_still_found(reply, calls, kept):
    """Clients strip <think> blocks and drop the text next to tool calls: still the next state
    of that reply, never a regenerate."""
    c = core()
    r1 = rec([SYS, user("q")], reply, calls=calls, t=0)
    c.on_record(r1, 1)
    c.on_record(rec([SYS, user("q"), kept, user("ok")], t=3), 4)
    jobs, done = c.drain()
    assert [(j.record.record_id, j.next_state) for j in jobs] == [(r1.record_id, [user("ok")])]
    assert done == []


def test_an_edited_first_message_without_a_system_prompt_is_a_regenerate():
    c = core()
    r1 = rec([user("Write a poem")], "Roses...", t=0)
    c.on_record(r1, 1)
    c.on_record(rec([user("Write a short poem")], "Rain.", t=5), 6)
    _, done = c.drain()
    assert [(f.record.record_id, f.status) for f in done] == [(r1.record_id, "regenerated")]


def test_aborted_turn_is_kept_without_next_state():
    c = core()
    r1 = rec([SYS, user("a")], "partial", t=0, finish="abort")
    c.on_record(r1, 1)
    _, done = c.drain()
    assert [(f.record.record_id, f.status) for f in done] == [(r1.record_id, "aborted")]


@pytest.mark.parametrize("votes,score", [
    ([1, None, None], 1), ([1, -1, None], 0), ([1, 1, -1], 1), ([0, 0, 1], 0),
    ([None, None, None], 0), ([1, 0, -1], 0), ([-1, -1, 1], -1)])
def test_vote_majority(votes, score):
    assert score_of(votes) == score


def test_a_resumed_hub_does_not_count_its_downtime_as_idle_time():
    """A hub restarted at t=50 replays a turn served at t=1 (idle timeout 30): the turn's
    session gets a whole idle window from the restart, and a next message then judges it."""
    c = core(idle_timeout_s=30)
    r1 = rec([SYS, user("What is 2+2?")], "4", t=0)
    c.on_record(r1, 1)  # replayed with its original time
    c.resumed(50)
    c.tick(79)
    assert c.drain() == ([], [])  # 29 s after the restart: still waiting for its next state
    c.on_record(rec([SYS, user("What is 2+2?"), asst("4"), user("thanks!")], "bye", t=79), 79)
    jobs, done = judge_all(c, [1, 1, 1], now=80)
    assert [(f.record.record_id, f.status) for f in done] == [(r1.record_id, "judged")]
    c.tick(200)  # and the idle timeout still finalizes what nobody continues
    _, done = c.drain()
    assert [f.status for f in done] == ["no_next_state"]
