"""Sample rows of finished turns (Binary RL, OPD, Combine) and the judging of one turn."""

from __future__ import annotations

import asyncio
import pytest

from clawray.config import JudgeConfig
from clawray.judging.voters import VoterPool
from clawray.records import TurnRecord
from clawray.samples import rows_to_batch
from clawray.sessions.core import FinishedTurn, JudgeJob, SessionRules, Verdict
from clawray.sessions.rows import rows_of

SYS = {"role": "system", "content": "sys"}


def record(n=3) -> TurnRecord:
    return TurnRecord("chatcmpl-1", "s", "header", "main", False, "m", [1, 2, 3], list(range(n)),
                      [-0.5] * n, "stop", 2, 3, [SYS, {"role": "user", "content": "hi"}], None, {},
                      "hello", [], finished_at=10.0, started_at=9.0)


def fin(status="judged", votes=(1, 1, None), hint=None, teacher=None, **kw) -> FinishedTurn:
    v = Verdict("judged", list(votes), hint, teacher) if status in ("judged", "unjudged") else None
    return FinishedTurn(record(), 1, status, [{"role": "user", "content": "thanks"}], v,
                        judged_at=11.0, **kw)


RULES = SessionRules()


@pytest.mark.parametrize("f,reward,mask", [
    (fin(votes=(1, 1, None)), 1.0, 1),
    (fin(votes=(1, -1, None)), 0.0, 0),
    (fin(votes=(-1, -1, 1)), -1.0, 1),
    (fin("no_next_state"), 0.0, 0),
    (fin("regenerated"), -1.0, 1),
    (fin(votes=(1, 0, 0), at_least_one=True, soft_score=1 / 3), 1 / 3, 1),
    (fin(votes=(1, 1, 1), outcome=-1, outcome_scope="turn"), -1.0, 1),
    (fin(votes=(1, 1, 1), outcome=-1, outcome_scope="session"), 1.0, 1),
    # the user's own thumbs-up on a reply they then regenerated outranks the regenerate rule
    (fin("regenerated", outcome=1, outcome_scope="turn"), 1.0, 1),
    (fin("regenerated", outcome=1, outcome_scope="session"), -1.0, 1),
])
def test_rl_reward_and_mask(f, reward, mask):
    (row,) = rows_of(f, ["rl"], RULES)
    assert row["reward"] == pytest.approx(reward) and row["loss_mask"] == [mask] * 3
    assert row["policy_version"] == 2 and row["policy_version_end"] == 3
    rows_to_batch([row])  # a valid row of the schema


def test_every_row_of_a_turn_names_whose_policy_served_it():
    import dataclasses

    rec = dataclasses.replace(record(), tenant="key-a", user="ann", policy_user="key-a/ann")
    f = FinishedTurn(rec, 1, "judged", [{"role": "user", "content": "thanks"}],
                     Verdict("judged", [1, 1, None], "hint", [-0.1, -0.2, -0.3]), judged_at=11.0)
    rows = rows_of(f, ["rl", "opd", "combine"], RULES)
    assert [(r["tenant"], r["user"], r["policy_user"]) for r in rows] == \
        [("key-a", "ann", "key-a/ann")] * 3


def test_a_rated_regenerated_turn_is_marked_feedback():
    (row,) = rows_of(fin("regenerated", outcome=1, outcome_scope="turn"), ["rl"], RULES)
    assert (row["judge_status"], row["outcome"], row["reward"]) == ("feedback", 1, 1.0)


def test_regenerate_reward_can_be_disabled():
    (row,) = rows_of(fin("regenerated"), ["rl"], SessionRules(regenerate_reward=None))
    assert row["reward"] == 0 and row["loss_mask"] == [0, 0, 0]


def test_opd_and_combine_rows():
    f = fin(votes=(-1, -1, -1), hint="Answer in French.", teacher=[-0.1, -0.2, -0.3])
    rl, opd, comb = rows_of(f, ["rl", "opd", "combine"], RULES)
    assert (opd["kind"], opd["teacher_logprobs"], opd["hint"], opd["loss_mask"]) == (
        "opd", pytest.approx([-0.1, -0.2, -0.3]), "Answer in French.", [1, 1, 1])
    assert (comb["kind"], comb["reward"], comb["teacher_logprobs"]) == (
        "combine", -1.0, pytest.approx([-0.1, -0.2, -0.3]))
    assert len({rl["sample_id"], opd["sample_id"], comb["sample_id"]}) == 3
    # no hint: OPD yields nothing; combine keeps the score term only; a 0 score masks it
    rows = rows_of(fin(votes=(1, -1, 0)), ["opd", "combine"], RULES)
    assert [(r["kind"], r["loss_mask"], r["teacher_logprobs"]) for r in rows] == [
        ("combine", [0, 0, 0], None)]
    # nothing configured applies: the turn is still stored, untrainable
    rows = rows_of(fin(votes=(1, 1, 1)), ["opd"], RULES)
    assert [(r["kind"], r["loss_mask"]) for r in rows] == [("rl", [0, 0, 0])]


class _Voter:
    """Stands in for a PRMVoter actor handle: ``.complete.remote(...)`` is awaitable."""

    def __init__(self, prm, opd, teacher):
        outer = self

        class _M:
            def __init__(self, fn):
                self.fn = fn

            def remote(self, *args):
                return asyncio.ensure_future(self.fn(*args))

        async def complete(request, n, temperature, max_tokens):
            outer.calls.append((request.kind, n))
            return (prm if request.kind == "prm" else opd)[:n]

        async def teacher_logprobs(messages, tools, response_ids):
            outer.teacher_messages = messages
            return teacher(response_ids)

        self.calls = []
        self.complete = _M(complete)
        self.teacher_logprobs = _M(teacher_logprobs)


def _job():
    rec = record()
    return JudgeJob(1, "s", rec, [], rec.messages[1:], [{"role": "user", "content": "no, in French"}],
                    rec.messages)


def test_pool_judges_with_one_n_equals_m_call_and_builds_aligned_opd():
    voter = _Voter(prm=["\\boxed{-1}", "\\boxed{-1}", "garbage"],
                   opd=["\\boxed{1} [HINT_START]Answer in French.[HINT_END]"] * 2 + ["\\boxed{-1}"],
                   teacher=lambda ids: [-0.25] * len(ids))
    pool = VoterPool([voter], JudgeConfig(m=3, opd_min_agree=2), ["rl", "opd"])
    verdict = asyncio.run(pool.judge(_job()))
    assert voter.calls == [("prm", 3), ("opd", 3)]
    assert verdict.votes == [-1, -1, None] and pool.counters["parse_failures"] == 1
    assert verdict.hint == "Answer in French."
    assert verdict.teacher_logprobs == [-0.25] * 3  # one per sampled response id
    assert voter.teacher_messages[-1]["content"].endswith("Answer in French.")
    assert voter.teacher_messages[-1]["role"] == "user"


def test_pool_drops_hint_when_teacher_misaligned_or_votes_disagree():
    bad_teacher = _Voter(prm=["\\boxed{1}"] * 3,
                         opd=["\\boxed{1} [HINT_START]Be brief.[HINT_END]"] * 3,
                         teacher=lambda ids: [-0.1] * (len(ids) + 1))
    pool = VoterPool([bad_teacher], JudgeConfig(), ["opd"])
    v = asyncio.run(pool.judge(_job()))
    assert v.hint is None and v.teacher_logprobs is None
    assert pool.counters["teacher_failures"] == 1
    lone = _Voter(prm=["\\boxed{1}"] * 3,
                  opd=["\\boxed{1} [HINT_START]Be brief.[HINT_END]", "\\boxed{-1}", "\\boxed{-1}"],
                  teacher=lambda ids: [-0.1] * len(ids))
    v = asyncio.run(VoterPool([lone], JudgeConfig(opd_min_agree=2), ["opd"]).judge(_job()))
    assert v.hint is None  # a single vote is not enough agreement


RLA = SessionRules(reward_rule="rlanything", step_score_weight=1.0)


@pytest.mark.parametrize("f,reward,mask", [
    # R = O + (λ/m) Σ S: no feedback, O = 0; an unparseable vote counts 0 but counts in m.
    (fin(votes=(1, 1, None)), 2 / 3, 1),
    (fin(votes=(1, -1, None)), 0.0, 0),
    # Turn feedback is the outcome and the votes still add (the majority rule lets it override).
    (fin(votes=(1, 1, 1), outcome=-1, outcome_scope="turn"), 0.0, 0),
    (fin(votes=(-1, 1, 1), outcome=1, outcome_scope="turn"), 1 + 1 / 3, 1),
    # Session feedback is the outcome of every turn it reaches (majority: outcome column only).
    (fin(votes=(-1, -1, -1), outcome=-1, outcome_scope="session"), -2.0, 1),
    (fin("no_next_state"), 0.0, 0),
    (fin("no_next_state", outcome=1, outcome_scope="session"), 1.0, 1),
    (fin("regenerated"), -1.0, 1),
])
def test_rlanything_rule_makes_a_turn_one_step_with_feedback_as_outcome(f, reward, mask):
    (row,) = rows_of(f, ["rl"], RLA)
    assert row["reward"] == pytest.approx(reward) and row["loss_mask"] == [mask] * 3
    rows_to_batch([row])


def test_rlanything_rule_weighs_the_votes_by_lambda():
    f = fin(votes=(1, 1, -1), outcome=-1, outcome_scope="turn")
    (row,) = rows_of(f, ["rl"], SessionRules(reward_rule="rlanything", step_score_weight=0.5))
    assert row["reward"] == pytest.approx(-1 + 0.5 / 3)


def _said(text: str) -> JudgeJob:
    rec = record()
    return JudgeJob(1, "s", rec, [], rec.messages[1:], [{"role": "user", "content": text}],
                    rec.messages)


def test_the_judge_controls_hide_the_reply_or_give_each_turn_another_turns_next_state():
    from clawray.judging.voters import HIDDEN_REPLY

    voter = _Voter(prm=["\\boxed{1}"] * 3, opd=[], teacher=None)
    plain = VoterPool([voter], JudgeConfig(), ["rl"])
    ctx = plain.context(_said("thanks"))
    assert (ctx.response_text, ctx.next_state[0]["content"]) == ("hello", "thanks")

    hidden = VoterPool([voter], JudgeConfig(control="reply_hidden"), ["rl"])
    ctx = hidden.context(_said("thanks"))
    assert ctx.response_text == HIDDEN_REPLY and ctx.response_tool_calls == []
    assert ctx.next_state[0]["content"] == "thanks"

    shuffled = VoterPool([voter], JudgeConfig(control="shuffled_feedback"), ["rl"])
    said = [f"message {i}" for i in range(200)]
    seen = [shuffled.context(_said(t)).next_state for t in said]
    assert seen[0] == []  # nothing earlier to give the first turn
    got = [s[0]["content"] for s in seen[1:]]
    # every turn reads an earlier turn's next state, never its own
    assert all(int(g.split()[1]) < i + 1 for i, g in enumerate(got))
    assert not any(g == t for g, t in zip(got, said[1:]))
    assert len(set(got)) > 50  # drawn from many earlier turns, not one
    with pytest.raises(ValueError):
        JudgeConfig(control="swap")
