"""Faults on the live path: a hanging or failing judge, a killed SampleBuffer, a session burst.

Users must keep being answered, and no turn may be lost or duplicated in the sample log.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import openai
import pytest
import ray

from clawray.config import ClawRayConfig, JudgeConfig
from clawray.records import TurnRecord
from tests.support.common import API_KEY

pytestmark = pytest.mark.ray
SYS = {"role": "system", "content": "You are an agent."}


def _turns(client, model, sid, n_turns=2, done=True, answered=None):
    """A session of ``n_turns`` user turns; returns each request's latency (s), and appends the
    wall-clock time each answer arrived to ``answered`` if given."""
    msgs, latencies = [SYS], []
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"question {t}? thanks" if t else "question 0?"})
        last = t == n_turns - 1
        start = time.perf_counter()
        r = client.chat.completions.create(
            model=model, messages=msgs, temperature=0, max_tokens=12,
            extra_headers={"X-Session-Id": sid, **({"X-Session-Done": "1"} if last and done else {})})
        latencies.append(time.perf_counter() - start)
        if answered is not None:
            answered.append(time.time())
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
    return latencies


@pytest.fixture(scope="module")
def faulty(served, tmp_path_factory):
    """A second app on the same cluster whose judge never answers."""
    from ray import serve

    from clawray.serve.app import build_app
    from tests.support.common import Served

    cfg = (ClawRayConfig().inference(engine="hf")
           .serving(api_keys=[API_KEY], record_sink=["hub"], default_max_tokens=16)
           .sessions(max_sessions=50, idle_timeout_s=30, feedback_window_s=0, flush_interval_s=0.2)
           .judge(function="clawray.judging.rules:hanging_judge", timeout_s=1.5, retries=1)
           .buffer(path=str(tmp_path_factory.mktemp("faulty-samples")), seal_age_s=0.2))
    serve.run(build_app(cfg), name="faulty", route_prefix="/faulty")
    port = served.base_url.split(":")[2].split("/")[0]
    yield Served(f"http://127.0.0.1:{port}/faulty/v1", API_KEY, "clawray-tiny", None, "faulty",
                 cfg.buffer_cfg.path, cfg)
    serve.delete("faulty")


def test_hanging_judge_never_slows_users_and_turns_are_kept_unjudged(served, faulty):
    ok = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0)
    bad = openai.OpenAI(base_url=faulty.base_url, api_key=API_KEY, max_retries=0)
    _turns(bad, faulty.model, "warmup")
    normal = _turns(ok, served.model, f"normal-{uuid.uuid4().hex[:6]}", 3)
    sid = f"hang-{uuid.uuid4().hex[:6]}"
    answered: list[float] = []
    hanging = _turns(bad, faulty.model, sid, 3, answered=answered)
    rows = faulty.samples(expected=3, timeout_s=90, session_id=sid)
    assert [(r["turn"], r["judge_status"], set(r["loss_mask"])) for r in rows] == [
        (1, "unjudged", {0}), (2, "unjudged", {0}), (3, "no_next_state", {0})]
    # Turn t's judge call starts when turn t + 1 arrives and ends (given up: 2 x 1.5 s) long
    # after: had a request waited on it, its answer would come after that verdict. Every
    # answer came before the verdicts on the turns before it.
    gave_up = {r["turn"]: r["judged_at"] for r in rows[:2]}
    assert answered[1] < gave_up[1] and answered[2] < gave_up[2], (answered, gave_up)
    stats = ray.get(faulty.pipeline().hubs[0].stats.remote())
    assert stats["voters"]["timeouts"] >= 4 and stats["unjudged"] >= 2
    print(f"latency p50 normal {statistics.median(normal):.3f}s, hanging judge "
          f"{statistics.median(hanging):.3f}s")


def test_failing_judge_gives_unjudged_verdict(ray_cluster):
    from clawray.judging.voters import PRMVoter, VoterPool
    from clawray.sessions.core import JudgeJob

    cfg = JudgeConfig(function="clawray.judging.rules:failing_judge", retries=2, timeout_s=5)
    voter = PRMVoter.remote(cfg.model_dump())
    pool = VoterPool([voter], cfg, ["rl"])
    rec = TurnRecord("r1", "s", "header", "main", False, "m", [1], [2], [-0.5], "stop", 0, None,
                     [SYS, {"role": "user", "content": "hi"}], None, {}, "hello", [])
    job = JudgeJob(1, "s", rec, [], rec.messages[1:], [{"role": "user", "content": "thanks"}],
                   rec.messages)
    import asyncio

    verdict = asyncio.run(pool.judge(job))
    assert verdict.status == "unjudged" and "failing_judge" in verdict.error
    assert pool.counters["call_failures"] == 3 and pool.counters["unjudged"] == 1


def test_session_burst_keeps_hub_memory_bounded_and_loses_nothing(faulty):
    hub = faulty.pipeline().hubs[0]
    tag = uuid.uuid4().hex[:6]
    n = 1000
    refs = []
    for i in range(n):
        rec = TurnRecord(f"burst-{tag}-{i}", f"burst-{tag}-{i}", "header", "main", False, "m",
                         [1, 2, 3], [4, 5], [-0.1, -0.2], "stop", 0, None,
                         [SYS, {"role": "user", "content": f"q{i}"}], None, {}, "a", [],
                         finished_at=time.time(), started_at=time.time())
        refs.append(hub.submit.remote(rec.to_dict()))
    ray.get(refs)
    stats = ray.get(hub.stats.remote())
    assert stats["sessions"] <= 50 and stats["sessions_capped"] >= n - 50
    # the 50 still open are finalized by a session_done of their own id... or the cap: close them
    for i in range(n - 60, n):
        sid = f"burst-{tag}-{i}"
        ray.get(hub.submit.remote(TurnRecord(
            f"{sid}-end", sid, "header", "side", True, "m", [1], [2], [-0.1], "stop", 0, None,
            [SYS], None, {}, "", []).to_dict()))
    rows = faulty.samples(expected=n, timeout_s=60,
                          where=lambda r: r["sample_id"].startswith(f"burst-{tag}-"))
    ids = [r["sample_id"] for r in rows]
    assert len(ids) == n == len(set(ids))


def test_killed_sample_buffer_loses_and_duplicates_nothing(served):
    client = openai.OpenAI(base_url=served.base_url, api_key=API_KEY, max_retries=0)
    tag = uuid.uuid4().hex[:6]
    sids = [f"kill-{tag}-{i}" for i in range(12)]
    errors = []

    def drive(chunk):
        try:
            for sid in chunk:
                _turns(client, served.model, sid, 2)
        except Exception as e:  # surfaced below
            errors.append(e)

    from clawray.records import read_jsonl_records

    ours = set(sids)
    threads = [threading.Thread(target=drive, args=(sids[i::3],)) for i in range(3)]
    for t in threads:
        t.start()
    # mid-stream by count, not after a fixed 1.5 s: 6 of the 24 turns served before the kill,
    # the other 18 (six a thread, one after another) after it
    deadline = time.time() + 120
    while sum(r.session_id in ours for r in read_jsonl_records(served.records_path)) < 6:
        assert time.time() < deadline and not errors, errors
        time.sleep(0.2)
    pipe = served.pipeline()
    ray.kill(pipe.buffer, no_restart=False)  # crash it mid-stream; it restarts from its log
    for t in threads:
        t.join()
    assert not errors
    expected = {f"{r.record_id}/rl" for sid in sids
                for r in served.records(expected=2, session_id=sid)}
    assert len(expected) == 2 * len(sids)
    # Wait for this test's rows (the WAL holds the whole session's, so a count alone is met at
    # once): the hub resends what the killed buffer had not logged once the buffer is back.
    rows = served.samples(expected=len(expected), timeout_s=60,
                          where=lambda r: r["session_id"] in ours)
    got = [r["sample_id"] for r in rows]
    assert sorted(got) == sorted(expected)  # every turn once: none lost, none duplicated
    restarted = ray.get(pipe.buffer.__ray_call__.remote(
        lambda self: ray.get_runtime_context().was_current_actor_reconstructed))
    assert restarted  # it really crashed and came back
