"""Live sessions through the HTTP API become exactly the expected judged samples.

Real Ray + Serve, the embedded model, the official ``openai`` SDK, the heuristic rule judge
(the configured default) and the SampleBuffer's Parquet log, all from the shared ``served`` app.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.ray

TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "List files in a directory.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
SYS = {"role": "system", "content": "You are an agent."}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key=served.api_key, max_retries=0)


def ask(client, served, messages, headers=None, stream=False, tools=None):
    """One turn; returns (the assistant message as a client would resend it, response id)."""
    kw = dict(model=served.model, messages=messages, temperature=0, max_tokens=24,
              extra_headers=headers or {})
    if tools:
        kw["tools"] = tools
    if not stream:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        out = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            out["tool_calls"] = [{"id": "rewritten-" + c.id[-4:], "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": json.dumps(json.loads(c.function.arguments), indent=1)}}
                                 for c in msg.tool_calls]
        return out, r.id
    text, rid, calls = "", None, {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        rid = chunk.id
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls.setdefault(tc.index, {"name": tc.function.name, "arguments": tc.function.arguments})
    out = {"role": "assistant", "content": text}
    if calls:
        out["tool_calls"] = [{"id": f"rw{i}", "type": "function", "function": c}
                             for i, c in sorted(calls.items())]
    return out, rid


def test_header_session_streamed_with_side_turn_and_done(client, served):
    sid = f"live-h-{uuid.uuid4().hex[:6]}"
    h = {"X-Session-Id": sid}
    m = [SYS, {"role": "user", "content": "What is 2+2?"}]
    a1, _ = ask(client, served, m, h, stream=True)
    ask(client, served, [SYS, {"role": "user", "content": "Summarize memory."}],
        {**h, "X-Turn-Type": "side"})
    m += [a1, {"role": "user", "content": "Thanks, perfect. And 3+3?"}]
    a2, _ = ask(client, served, m, h, stream=True)
    m += [a2, {"role": "user", "content": "That's wrong, try again."}]
    ask(client, served, m, {**h, "X-Session-Done": "1"}, stream=True)

    rows = served.samples(expected=3, session_id=sid)
    recs = served.records(expected=4, session_id=sid)
    main = [r for r in recs if r.turn_type == "main"]
    assert [(r["turn"], r["kind"], r["judge_status"], r["reward"]) for r in rows] == [
        (1, "rl", "judged", 1.0), (2, "rl", "judged", -1.0), (3, "rl", "no_next_state", 0.0)]
    assert [set(r["loss_mask"]) for r in rows] == [{1}, {1}, {0}]
    assert [r["votes"] for r in rows[:2]] == [[1, 1, 1], [-1, -1, -1]]
    for row, rec in zip(rows, main):  # token-exact: the engine's ids and log-probs
        assert row["sample_id"] == f"{rec.record_id}/rl"
        assert row["prompt_ids"] == rec.prompt_ids and row["response_ids"] == rec.response_ids
        assert row["rollout_logprobs"] == pytest.approx(rec.response_logprobs, abs=1e-6)
        assert row["policy_version"] == rec.policy_version == 0
    assert json.loads(rows[0]["next_state"]) == [
        {"role": "user", "content": "Thanks, perfect. And 3+3?"}]


def test_affinity_headers_tool_call_and_derived_session(client, served):
    # OpenClaw's session-affinity option, and a tool call whose id the client rewrites
    aff = f"aff-{uuid.uuid4().hex[:6]}:0"
    h = {"session_id": aff, "x-session-affinity": aff}
    m = [SYS, {"role": "user", "content": "Please CALL_TOOL and list the workspace."}]
    a1, _ = ask(client, served, m, h, tools=TOOLS)
    assert a1.get("tool_calls"), a1
    m += [a1, {"role": "tool", "tool_call_id": a1["tool_calls"][0]["id"],
               "content": "README.md\nsrc/"}]
    ask(client, served, m, {**h, "X-Session-Done": "true"}, tools=TOOLS)
    rows = served.samples(expected=2, session_id=aff)
    assert [(r["turn"], r["judge_status"], r["reward"]) for r in rows] == [
        (1, "judged", 1.0), (2, "no_next_state", 0.0)]
    assert json.loads(rows[0]["next_state"])[0]["role"] == "tool"

    # no session id at all: a key derived from the conversation's first messages
    first = {"role": "user", "content": f"Hello {uuid.uuid4().hex[:6]}, what is 5+5?"}
    b1, _ = ask(client, served, [SYS, first])
    ask(client, served, [SYS, first, b1, {"role": "user", "content": "great, thank you"}])
    # Other tests leave derived records too: wait for this conversation's own.
    deadline = time.time() + 60
    while True:
        # (theirs may have no system message, or none at all: match on the content anywhere)
        recs = [r for r in served.records(expected=1, session_id_source="derived")
                if any(m.get("content") == first["content"] for m in r.messages)]
        if len(recs) >= 2 or time.time() > deadline:
            break
        time.sleep(0.1)
    sid = recs[0].session_id
    assert sid.startswith("derived-")
    rows = served.samples(expected=1, session_id=sid, turn=1)
    assert [(r["judge_status"], r["reward"]) for r in rows] == [("judged", 1.0)]


def test_idle_timeout_finalizes_last_turn(client, served):
    sid = f"live-idle-{uuid.uuid4().hex[:6]}"
    idle = served.config.sessions_cfg.idle_timeout_s
    started = time.monotonic()
    ask(client, served, [SYS, {"role": "user", "content": "One question only."}],
        {"X-Session-Id": sid})
    rows = served.samples(expected=1, session_id=sid, timeout_s=idle + 90)
    assert time.monotonic() - started >= idle  # finalized by the idle timeout, not before
    assert [(r["turn"], r["judge_status"], set(r["loss_mask"])) for r in rows] == [
        (1, "no_next_state", {0})]


def test_a_key_reaches_only_its_own_sessions(client, served):
    """Two API keys send the same X-Session-Id and the same opening: the second can neither
    rate the first's turn or session (404, as for an id that does not exist) nor end its
    session; each key's turns become rows of its own tenant, numbered in its own session."""
    from clawray.serve.auth import tenant_of_key
    from tests.support.common import OTHER_KEY

    other = openai.OpenAI(base_url=served.base_url, api_key=OTHER_KEY, max_retries=0)
    sid = f"live-tenant-{uuid.uuid4().hex[:6]}"
    h = {"X-Session-Id": sid}
    m = [SYS, {"role": "user", "content": "Name a fruit."}]
    a1, rid = ask(client, served, m, h)
    url = served.base_url + "/feedback"
    mine = {"Authorization": f"Bearer {served.api_key}"}
    theirs = {"Authorization": f"Bearer {OTHER_KEY}"}
    deadline = time.time() + 60
    while True:  # the owner's feedback is applied once the record reached its hub
        r = httpx.post(url, json={"response_id": rid, "rating": "up"}, headers=mine)
        if r.status_code != 404 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200 and r.json()["session_id"] == sid, r.text
    for body in ({"response_id": rid, "rating": "down"}, {"session_id": sid, "rating": "down"}):
        r = httpx.post(url, json=body, headers=theirs)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", (body, r.text)
    # the other key "ends" the session id with the same opening: only its own session ends
    _, other_rid = ask(other, served, m, {**h, "X-Session-Done": "1"})
    ask(client, served, m + [a1, {"role": "user", "content": "Thanks!"}],
        {**h, "X-Session-Done": "1"})
    rows = served.samples(expected=3, session_id=sid)
    by_tenant = {}
    for row in rows:
        by_tenant.setdefault(row["tenant"], []).append(row)
    assert set(by_tenant) == {tenant_of_key(served.api_key), tenant_of_key(OTHER_KEY)}
    a_rows = by_tenant[tenant_of_key(served.api_key)]
    assert [(r["turn"], r["judge_status"], r["outcome"]) for r in a_rows] == [
        (1, "feedback", 1), (2, "no_next_state", None)]
    b_rows = by_tenant[tenant_of_key(OTHER_KEY)]
    assert [(r["turn"], r["judge_status"]) for r in b_rows] == [(1, "no_next_state")]
    assert b_rows[0]["sample_id"].startswith(other_rid)
    records = {r.record_id: r for r in served.records(expected=3, session_id=sid)}
    assert records[other_rid].tenant == tenant_of_key(OTHER_KEY)
    assert records[rid].tenant == tenant_of_key(served.api_key)


def test_a_hub_killed_mid_session_resumes_its_pending_turns(client, served):
    """Turn 1 waits in its hub for its next state when the hub crashes; the restarted hub
    resumes it from its journal: each served turn yields exactly one row."""
    import ray

    from clawray.records import session_key
    from clawray.serve.auth import tenant_of_key
    from clawray.sessions.hub import shard_of
    from clawray.sessions.pipeline import journal_path

    sid = f"live-crash-{uuid.uuid4().hex[:6]}"
    h = {"X-Session-Id": sid}
    m = [SYS, {"role": "user", "content": "Pick a number."}]
    a1, rid1 = ask(client, served, m, h)
    pipe = served.pipeline()
    shard = shard_of(session_key(tenant_of_key(served.api_key), None, sid), len(pipe.hubs))
    journal = Path(journal_path(served.config, served.app_name, shard))
    deadline = time.time() + 60
    while rid1 not in (journal.read_text() if journal.exists() else ""):
        assert time.time() < deadline, "turn 1 never reached its hub's journal"
        time.sleep(0.1)
    ray.kill(pipe.hubs[shard], no_restart=False)  # a crash: the hub restarts empty...
    m += [a1, {"role": "user", "content": "Thanks!"}]
    _, rid2 = ask(client, served, m, {**h, "X-Session-Done": "1"})
    rows = served.samples(expected=2, session_id=sid)
    # ...and resumes turn 1 from its journal, which turn 2's request then continues
    assert [(r["turn"], r["judge_status"]) for r in rows] == [(1, "judged"), (2, "no_next_state")]
    assert [r["sample_id"] for r in rows] == [f"{rid1}/rl", f"{rid2}/rl"]
    assert ray.get(pipe.hubs[shard].stats.remote())["replayed"] >= 1


def test_feedback_endpoint(client, served):
    sid = f"live-fb-{uuid.uuid4().hex[:6]}"
    h = {"X-Session-Id": sid}
    m = [SYS, {"role": "user", "content": "Name a colour."}]
    a1, rid = ask(client, served, m, h)
    auth = {"Authorization": f"Bearer {served.api_key}"}
    url = served.base_url + "/feedback"
    deadline = time.time() + 60
    while True:  # the record reaches its hub asynchronously
        r = httpx.post(url, json={"response_id": rid, "rating": "down", "text": "boring"},
                       headers=auth)
        if r.status_code != 404 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "applied" and r.json()["session_id"] == sid
    r = httpx.post(url, json={"response_id": "chatcmpl-nope", "rating": 1}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.post(url, json={"response_id": rid, "rating": 5}, headers=auth)
    assert r.status_code == 400 and "rating" in r.json()["error"]["message"]
    assert httpx.post(url, json={"response_id": rid, "rating": 1}).status_code == 401
    m += [a1, {"role": "user", "content": "Thanks!"}]
    ask(client, served, m, {**h, "X-Session-Done": "1"})
    rows = served.samples(expected=2, session_id=sid)
    assert (rows[0]["judge_status"], rows[0]["reward"], rows[0]["outcome"],
            rows[0]["feedback_text"], rows[0]["votes"]) == ("feedback", -1.0, -1, "boring", [1, 1, 1])
    r = httpx.post(url, json={"response_id": rid, "rating": "up"}, headers=auth)
    assert r.status_code == 409 and r.json()["error"]["code"] == "feedback_too_late"
