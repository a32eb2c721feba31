"""Simulated users against the live app: their feedback becomes the rewards of their sessions'
samples (feedback → heuristic judge → reward), and side-turn evaluation trains on nothing.

Real Ray + Serve, the embedded model and the ``served`` app of tests/conftest.py.
"""

from __future__ import annotations

import pytest

from clawray.sim import BriefReplies, evaluate, run_users
from clawray.sim.users import MESSAGE_TYPES

pytestmark = pytest.mark.ray


async def test_sim_feedback_becomes_the_rewards_of_the_sessions_samples(served):
    for seed in (7, 8, 9):  # requests are seeded: on the initial weights seed 7 is mixed
        seen = []
        out = await run_users(served.base_url, served.api_key, served.model, num_users=2,
                              sessions_per_user=1, turns_per_session=2, seed=seed,
                              # the served app judges with the heuristic: its keywords
                              preference=BriefReplies(phrasing="keywords"),
                              on_interaction=seen.append)
        if {i.satisfied for i in out} == {True, False, None}:
            break
    assert len(seen) == len(out) and {id(i) for i in seen} == {id(i) for i in out}
    assert len(out) == 6 and [i.error for i in out] == [None] * 6
    assert all(i.policy_version is not None for i in out)
    sessions = sorted({i.session_id for i in out})
    assert len(sessions) == 2
    # The users were both pleased and displeased, so both rewards are checked.
    assert {i.satisfied for i in out} == {True, False, None}
    for sid in sessions:
        mine = sorted((i for i in out if i.session_id == sid), key=lambda i: i.turn)
        rows = [r for r in served.samples(expected=3, session_id=sid) if r["kind"] == "rl"]
        assert [r["turn"] for r in rows] == [1, 2, 3]
        for row, inter in zip(rows[:2], mine[:2]):  # judged by the user's next message
            assert row["judge_status"] == "judged"
            assert row["reward"] == (1.0 if inter.satisfied else -1.0), (inter, row["next_state"])
            assert row["policy_version"] == inter.policy_version
        # The closing message carries only feedback and ends the session: nothing judges it.
        assert mine[2].message_type == "closing" and mine[2].satisfied is None
        assert rows[2]["judge_status"] == "no_next_state" and rows[2]["reward"] == 0.0


async def test_evaluate_uses_side_turns_and_is_repeatable(served):
    first = await evaluate(served.base_url, served.api_key, served.model, n=20, seed=3,
                           concurrency=4)
    assert first.errors == 0 and first.n == 20 and 0.0 <= first.rate <= 1.0
    assert first.policy_versions and set(first.per_type) <= set(MESSAGE_TYPES)
    again = await evaluate(served.base_url, served.api_key, served.model, n=20, seed=3,
                           concurrency=4)
    # Fixed messages and per-request seeds: the same weights give the same replies.
    assert [i.reply for i in again.interactions] == [i.reply for i in first.interactions]
    sid = first.interactions[0].session_id
    records = served.records(expected=20, session_id=sid)
    assert len(records) == 20 and {r.turn_type for r in records} == {"side"}
    assert served.samples(expected=1, timeout_s=1.0, session_id=sid) == []
