"""One RLAnything step's rows from scored rollouts (``loop.task_result``; no Ray)."""

from __future__ import annotations

import asyncio

import pytest

from clawray.config import RLAnythingConfig
from clawray.envs import make_family
from clawray.envs.rollout import play_episode
from clawray.inference.engine import SamplingParams
from clawray.rlanything.loop import ScoredStep, task_result
from clawray.rlanything.steps import step_contexts

from tests.support.env_policies import expert_policy, scripted

PARAMS = SamplingParams(max_tokens=48)


def _episodes(tokenizer, n_expert, n_bad, bad_steps=3):
    family = make_family("household")
    task = family.generate([0.3] * 4, seed=5)
    eps = [asyncio.run(play_episode(family, task, expert_policy(family, task, tokenizer),
                                    tokenizer, PARAMS)) for _ in range(n_expert)]
    eps += [asyncio.run(play_episode(family, task, scripted(tokenizer, lambda _p: "go nowhere"),
                                     tokenizer, PARAMS, max_steps=bad_steps))
            for _ in range(n_bad)]
    return eps


def _scored(episodes, score_for, with_samples=True):
    """Every step scored by ``score_for(ctx) -> list of m scores``; fake RM samples."""
    out = []
    for ep in episodes:
        steps = []
        for ctx in step_contexts(ep):
            scores = score_for(ctx)
            samples = [{"text": f"\\boxed{{{s}}}", "prompt_ids": [1, 2, 3], "token_ids": [4, 5],
                        "logprobs": [-0.1, -0.2], "finish_reason": "stop",
                        "policy_version": 0} for s in scores] if with_samples else None
            steps.append(ScoredStep(ctx, scores, samples))
        out.append(steps)
    return out


def test_rows_carry_step_rewards_and_per_step_advantages(tiny_tokenizer):
    eps = _episodes(tiny_tokenizer, 2, 2)
    oracle = lambda c: [1 if c.progress else -1] * 3  # noqa: E731
    res = task_result(eps, _scored(eps, oracle), RLAnythingConfig(), train_rm=True)
    assert res.accuracy == 0.5
    assert res.rm_right == res.rm_scored and res.majority_right == res.majority_n
    # Expert steps: R = 1 + 1 = 2; bad steps: R = -1 - 1 = -2; at steps 0-2 both kinds
    # exist (2 vs 2: advantages +1 / -1).
    by = {(r["trajectory_id"], r["step"]): r for r in res.policy_rows}
    for ep in eps:
        for i in range(3):
            row = by[(ep.trajectory_id, i)]
            assert row["reward"] == (2.0 if ep.success else -2.0)
            assert row["advantage"] == pytest.approx(1.0 if ep.success else -1.0)
            assert row["outcome"] == (1 if ep.success else -1)
    # Steps only the two experts reach have equal R: advantage 0, not trained.
    longest = max(len(ep.steps) for ep in eps)
    assert all(r["step"] < 3 for r in res.policy_rows) and longest > 3
    # The oracle RM agrees with itself: every scoring is rewarded alike -> no RM rows.
    assert res.rm_rows == []
    assert res.critique is not None and "failed" in res.critique


def test_a_disagreeing_rm_gets_consistency_rows_and_unparseable_scores_are_counted(tiny_tokenizer):
    eps = _episodes(tiny_tokenizer, 2, 2)
    res = task_result(eps, _scored(eps, lambda c: [1, -1, None]), RLAnythingConfig(),
                      train_rm=True)
    assert res.rm_unparseable == sum(len(ep.steps) for ep in eps)
    assert res.rm_rows and all(r["kind"] == "rm" for r in res.rm_rows)
    # Success step: R = 1 + (1 - 1 + 0)/3 = 1, raw [1, -1, -2]; failure step: R = -1, raw
    # [-1, 1, -2]. Both standardize (mean -2/3, std sqrt(14/9)) to one of these three values.
    assert {round(r["advantage"], 4) for r in res.rm_rows} == {1.3363, -0.2673, -1.069}
    assert len(res.rm_rows) == 3 * sum(len(ep.steps) for ep in eps)


def test_tasks_outside_the_bands_give_no_rows(tiny_tokenizer):
    eps = _episodes(tiny_tokenizer, 4, 0)  # accuracy 1: outside both bands
    res = task_result(eps, _scored(eps, lambda c: [1, -1, 1]), RLAnythingConfig(),
                      train_rm=True)
    assert res.accuracy == 1.0 and res.policy_rows == [] and res.rm_rows == []
    assert res.critique is None
    eps = _episodes(tiny_tokenizer, 1, 7)  # accuracy 1/8: inside the policy band only
    res = task_result(eps, _scored(eps, lambda c: [1, -1, 1]), RLAnythingConfig(),
                      train_rm=True)
    assert res.policy_rows and res.rm_rows == []


def test_without_rm_training_or_samples_there_are_no_rm_rows(tiny_tokenizer):
    eps = _episodes(tiny_tokenizer, 2, 2)
    res = task_result(eps, _scored(eps, lambda c: [1, -1, 1]), RLAnythingConfig(),
                      train_rm=False)
    assert res.policy_rows and res.rm_rows == []
    res = task_result(eps, _scored(eps, lambda c: [1, -1, 1], with_samples=False),
                      RLAnythingConfig(), train_rm=True)
    assert res.rm_rows == []


def test_rm_and_consistency_target_accuracy_per_class(tiny_tokenizer):
    """p+ / p- of the RM's scorings and of the consistency target sign(R), per step oracle
    class: an RM that always says -1 has p+ 0, p- 1 (balanced 1/2, mu 1) however often it is
    'right'; the target is the outcome (or nothing), so it follows the oracle only partly."""
    from clawray.rlanything.loop import class_accuracy

    eps = _episodes(tiny_tokenizer, 2, 2)
    flat = [c for ep in eps for c in step_contexts(ep)]
    n_plus = sum(c.progress for c in flat)
    assert 0 < n_plus < len(flat)
    always = task_result(eps, _scored(eps, lambda c: [-1] * 3), RLAnythingConfig(), True)
    m = class_accuracy([always], "rm")
    assert m == {"rm_plus_acc": 0.0, "rm_minus_acc": 1.0, "rm_balanced_acc": 0.5, "rm_mu": 1.0}
    assert always.rm_plus == (0, 3 * n_plus)
    # Its target: R = O - 1 is 0 on successful rollouts (no target) and -2 on failed ones.
    assert always.target_plus[0] == 0 and always.target_minus[0] == always.target_minus[1]
    oracle = task_result(eps, _scored(eps, lambda c: [1 if c.progress else -1] * 3),
                         RLAnythingConfig(), True)
    m = class_accuracy([oracle], "rm") | class_accuracy([oracle], "target")
    assert m["rm_balanced_acc"] == 1.0 and m["rm_mu"] == 2.0
    # The target is the sign of O + mean score: right on every progress step of a successful
    # rollout, and on every no-progress step of a failed one.
    assert m["target_balanced_acc"] > 0.5 and m["target_plus_acc"] > 0
    # Unanimous scorings are rewarded alike: the co-trainer trains on none of these steps.
    assert oracle.trained_target_plus == oracle.trained_target_minus == (0, 0)
    # Split scorings are trained on toward sign(R), in rows that train the RM or not.
    split = [task_result(eps, _scored(eps, lambda c: [1, -1, 1]), RLAnythingConfig(), t)
             for t in (True, False)]
    assert split[0].trained_target_plus == split[1].trained_target_plus
    n_trained = split[0].trained_target_plus[1] + split[0].trained_target_minus[1]
    assert n_trained > 0 and n_trained == len(split[0].rm_rows) // 3  # m = 3 rows a step
    assert split[1].rm_rows == []
    assert class_accuracy([], "rm")["rm_balanced_acc"] is None
    # Which way co-training pushes overall: R = O + 1/3 > 0 on the expert's (successful)
    # rollouts, O + 1/3 < 0 on the failed ones, so the positive share is the successful
    # rollouts' share of the trained steps.
    up, n = split[0].trained_target_positive
    assert n == n_trained and up == sum(len(step_contexts(ep)) for ep in eps if ep.success)
    assert 0 < up < n
    assert oracle.trained_target_positive == (0, 0)  # nothing trained, nothing pushed


def test_rm_accuracy_against_the_trajectory_outcome(tiny_tokenizer):
    """Theorem 1's mu is the RM's agreement with the trajectory outcome, not the step oracle:
    an RM that answers the outcome is right on every scoring; the step oracle is wrong on the
    failed episodes' progress steps."""
    from clawray.rlanything.loop import class_accuracy

    eps = _episodes(tiny_tokenizer, 2, 1)
    # An expert cut off after two steps: progress steps in a failed episode.
    family = make_family("household")
    task = eps[0].task
    eps.append(asyncio.run(play_episode(family, task, expert_policy(family, task, tiny_tokenizer),
                                        tiny_tokenizer, PARAMS, max_steps=2)))
    assert not eps[-1].success
    contexts = [c for ep in eps for c in step_contexts(ep)]
    assert [c.outcome for c in contexts] == [ep.success for ep in eps for _ in ep.steps]
    n_ok = sum(len(ep.steps) for ep in eps if ep.success)
    n_failed = sum(len(ep.steps) for ep in eps if not ep.success)
    scored = [[ScoredStep(s.ctx, [1 if ep.success else -1] * 3, s.samples) for s in steps]
              for ep, steps in zip(eps, _scored(eps, lambda c: [0] * 3))]
    res = task_result(eps, scored, RLAnythingConfig(), True)
    assert res.rm_outcome_plus == (3 * n_ok, 3 * n_ok)
    assert res.rm_outcome_minus == (3 * n_failed, 3 * n_failed)
    assert class_accuracy([res], "rm_outcome")["rm_outcome_mu"] == 2.0
    oracle = task_result(eps, _scored(eps, lambda c: [1 if c.progress else -1] * 3),
                         RLAnythingConfig(), True)
    m = class_accuracy([oracle], "rm_outcome")
    assert m["rm_outcome_plus_acc"] == 1.0  # the experts' steps all make progress
    failed_progress = sum(c.progress for c in contexts if not c.outcome)
    assert failed_progress == 2
    assert oracle.rm_outcome_minus == (3 * (n_failed - failed_progress), 3 * n_failed)
