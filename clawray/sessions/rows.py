"""Training rows from finished live turns (docs/sessions.md, "Rewards and masks").

Per turn, for each kind in ``sessions.sample_kinds``:

- ``rl`` (Binary RL): reward = the majority vote; ``loss_mask`` all 1 when the reward is
  non-zero, else all 0. Explicit feedback on the turn overrides the vote (the user is the
  ground truth) and the regenerate rule; a regenerated reply gets
  ``sessions.regenerate_reward``; an at-least-one row
  gets the soft score (mean of valid votes). Session-level feedback fills ``outcome`` only.
  With ``sessions.reward_rule: rlanything`` the turn is one RLAnything step instead: its m
  PRM votes are the step scores and explicit feedback (on the turn, else on the session) is
  the outcome, ``R = O + (λ/m) Σ S`` (``core.live_turn_reward``; O = 0 without feedback, an
  unparseable vote counts 0). A live turn is never replayed, so there is no group of rollouts
  to standardize over: ``R`` is the row's reward, as the single-rollout ``raw`` rule of the
  environments has it (docs/rlanything.md, "Live sessions").
- ``opd``: only when a hint was selected and teacher log-probs exist; mask all 1.
- ``combine``: one row with both the reward and (when present) the teacher log-probs; the
  learner computes ``w_opd·(teacher − rollout) + w_rl·r``.

Every turn yields at least one row (an ``rl`` row with mask 0 when nothing else applies), so
the sample log holds every main turn, trainable or not.
"""

from __future__ import annotations

import json
from typing import Any

from clawray.rlanything.core import live_turn_reward
from clawray.samples import make_row
from clawray.sessions.core import FinishedTurn, SessionRules, score_of


def rl_reward(fin: FinishedTurn, rules: SessionRules) -> float:
    rated = fin.outcome_scope == "turn" and fin.outcome is not None
    if fin.status == "regenerated" and not rated:  # the user's own rating outranks the rule
        return float(rules.regenerate_reward or 0.0)
    if rules.reward_rule == "rlanything":
        votes = fin.verdict.votes if fin.verdict is not None else []
        return live_turn_reward(fin.outcome, votes, rules.step_score_weight)
    if rated:
        return float(fin.outcome)
    if fin.status == "regenerated":
        return float(rules.regenerate_reward or 0.0)
    if fin.status == "judged" and fin.verdict is not None:
        score = score_of(fin.verdict.votes)
        if score == 0 and fin.at_least_one:
            return float(fin.soft_score or 0.0)
        return float(score)
    return 0.0


def rows_of(fin: FinishedTurn, kinds: list[str], rules: SessionRules) -> list[dict[str, Any]]:
    rec = fin.record
    n = len(rec.response_ids)
    verdict = fin.verdict
    reward = rl_reward(fin, rules)
    teacher = verdict.teacher_logprobs if verdict and verdict.hint else None
    base = {
        "source": "live",
        "session_id": rec.session_id,
        "tenant": rec.tenant,
        "user": rec.user,
        "policy_user": rec.policy_user,
        "turn": fin.turn,
        "prompt_ids": rec.prompt_ids,
        "response_ids": rec.response_ids,
        "rollout_logprobs": rec.response_logprobs,
        "policy_version": rec.policy_version,
        "policy_version_end": rec.policy_version_end,
        "token_versions": rec.response_versions,
        "votes": [v for v in (verdict.votes if verdict else []) if v is not None],
        "vote_parse_failures": sum(v is None for v in verdict.votes) if verdict else 0,
        "judge_status": "feedback" if fin.outcome_scope == "turn" else fin.status,
        "outcome": fin.outcome,
        "feedback_text": fin.feedback_text,
        "next_state": json.dumps(fin.next_state, ensure_ascii=False) if fin.next_state else None,
        "finish_reason": rec.finish_reason,
        "at_least_one": fin.at_least_one,
        "created_at": rec.finished_at or rec.created_at,
        "judged_at": fin.judged_at,
    }
    rows = []
    for kind in kinds:
        if kind == "rl":
            rows.append({**base, "kind": "rl", "reward": reward,
                         "loss_mask": [1 if reward != 0 else 0] * n})
        elif kind == "opd" and teacher is not None:
            rows.append({**base, "kind": "opd", "reward": 0.0, "loss_mask": [1] * n,
                         "teacher_logprobs": teacher, "hint": verdict.hint})  # type: ignore[union-attr]
        elif kind == "combine":
            useful = teacher is not None or reward != 0
            rows.append({**base, "kind": "combine", "reward": reward,
                         "loss_mask": [1 if useful else 0] * n, "teacher_logprobs": teacher,
                         "hint": verdict.hint if teacher is not None else None})  # type: ignore[union-attr]
    if not rows:
        rows.append({**base, "kind": "rl", "reward": 0.0, "loss_mask": [0] * n})
    return [make_row(sample_id=f"{rec.record_id}/{r['kind']}", **r) for r in rows]
