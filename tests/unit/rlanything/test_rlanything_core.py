"""RLAnything's rules (docs/rlanything.md) and the step-wise RM prompt, against hand-computed
values."""

from __future__ import annotations

import itertools
import math
import re

import pytest

from clawray.judging.prompts import EXAMPLES_END, EXAMPLES_START
from clawray.judging.step_rm import (
    STEP_RM_SYSTEM,
    build_step_rm_prompt,
    parse_step_score,
)
from clawray.rlanything.core import (
    accept_candidate,
    accuracy,
    adaptation_direction,
    failure_steps,
    in_band,
    policy_task_filter,
    precision_bound,
    programmatic_critique,
    rm_consistency_rewards,
    rm_task_filter,
    simulate_majority_accuracy,
    simulate_precision,
    step_advantages,
    step_rewards,
    trained_steps,
)

SQRT_1_5 = 1.224744871391589  # 1 / sqrt(2/3): step 0 of the 3-rollout example below


# ---------------------------------------------------------------------------- step rewards
def test_step_reward_is_outcome_plus_mean_score_with_unparseable_as_zero():
    # +1 + (1+1+1)/3 = 2;  +1 + (1-1+0)/3 = 1;  +1 + (-3)/3 = 0
    assert step_rewards(1, [[1, 1, 1], [1, -1, None], [-1, -1, -1]]) == [2.0, 1.0, 0.0]
    # -1 - 3/3 = -2;  -1 + 0 = -1 (all unparseable);  -1 + (1-1)/2 = -1
    assert step_rewards(-1, [[-1, -1, -1], [None, None, None], [1, -1]]) == [-2.0, -1.0, -1.0]
    # λ = 0.5: +1 + 0.5 * 2/2 = 1.5;  -1 + 0.5 * (1 + 0)/2 = -0.75
    assert step_rewards(1, [[1, 1]], lam=0.5) == [1.5]
    assert step_rewards(-1, [[1, None]], lam=0.5) == [-0.75]
    assert step_rewards(1, []) == []


def test_step_rewards_stay_in_minus_two_to_two_at_lambda_one():
    extremes = step_rewards(1, [[1] * 5]) + step_rewards(-1, [[-1] * 5])
    assert extremes == [2.0, -2.0]
    for outcome in (1, -1):
        for scores in ([1, -1, 1], [None, 1, 1], [-1, None, -1], [1]):
            (r,) = step_rewards(outcome, [scores])
            assert -2.0 <= r <= 2.0


def test_at_lambda_one_the_consistency_target_is_the_outcome_or_nothing():
    """sign(R) is O or 0 for every m-tuple of scores at λ = 1 (so on a failed rollout the RM
    is never pushed toward +1, docs/rlanything.md "Theorem 1 in the co-training data"); a
    larger λ lets unanimous scores outvote the outcome."""
    for outcome in (1, -1):
        for scores in itertools.product((1, -1, None), repeat=3):
            (r,) = step_rewards(outcome, [list(scores)])
            assert math.copysign(1, r) == outcome or r == 0, (outcome, scores, r)
    assert step_rewards(-1, [[1, 1, 1]]) == [0.0]
    assert step_rewards(-1, [[1, 1, 1]], lam=2.0) == [1.0]
    assert step_rewards(1, [[-1, -1, -1]], lam=2.0) == [-1.0]


@pytest.mark.parametrize("outcome, scores, message", [
    (0, [[1]], "outcome must be +1 (success) or -1 (failure), got 0"),
    (True, [[1]], "outcome must be +1 (success) or -1 (failure), got True"),
    (1, [[1], [1, 0]], "step 1, score 1: must be -1, 1 or None (unparseable), got 0"),
    (1, [[1], [2]], "step 1, score 0: must be -1, 1 or None (unparseable), got 2"),
    (-1, [[1], []], "step 1: needs at least one RM score, got an empty list"),
])
def test_step_rewards_reject_bad_input_with_a_precise_message(outcome, scores, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        step_rewards(outcome, scores)


# ---------------------------------------------------------------------------- advantages
def test_advantages_standardize_over_the_rollouts_that_have_the_step():
    # lengths 3, 2, 1.  step 0: R = 2, 0, 1 → mean 1, std sqrt(2/3) → ±1.2247, 0
    #                   step 1: R = 0, 2 (rollout 2 has no step 1) → mean 1, std 1 → -1, +1
    #                   step 2: only rollout 0 → 0 (default rule)
    adv = step_advantages([[2.0, 0.0, 1.0], [0.0, 2.0], [1.0]])
    assert [len(a) for a in adv] == [3, 2, 1]
    assert adv[0] == pytest.approx([SQRT_1_5, -1.0, 0.0])
    assert adv[1] == pytest.approx([-SQRT_1_5, 1.0])
    assert adv[2] == pytest.approx([0.0])


def test_advantage_is_zero_when_the_rewards_at_a_step_are_equal():
    adv = step_advantages([[1.5, 1.0], [1.5, -1.0], [1.5 + 1e-8, 0.0]])
    assert [a[0] for a in adv] == [0.0, 0.0, 0.0]  # std ≈ 1e-8 < 1e-6
    # step 1: R = 1, -1, 0 → mean 0, std sqrt(2/3) → ±1.2247, 0
    assert [a[1] for a in adv] == pytest.approx([SQRT_1_5, -SQRT_1_5, 0.0])


def test_a_step_only_one_rollout_reaches_gets_zero_or_its_raw_reward():
    rewards = [[2.0, 0.0, 1.0], [0.0, 2.0], [1.0]]
    assert step_advantages(rewards, single="zero")[0][2] == 0.0
    raw = step_advantages(rewards, single="raw")
    assert raw[0] == pytest.approx([SQRT_1_5, -1.0, 1.0])  # step 2 keeps R = 1.0
    assert raw[1] == pytest.approx([-SQRT_1_5, 1.0])
    # a task rolled out once: every step is a lone step
    assert step_advantages([[-2.0, -1.5]], single="raw") == [[-2.0, -1.5]]
    assert step_advantages([[-2.0, -1.5]]) == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="single must be 'zero' or 'raw', got 'mean'"):
        step_advantages(rewards, single="mean")  # type: ignore[arg-type]


def test_zero_advantage_steps_are_left_out_of_training():
    adv = step_advantages([[2.0, 0.0, 1.0], [0.0, 2.0], [1.0]])
    # rollout 0 step 2 (lone) and rollout 2 step 0 (R equals the mean) have advantage 0
    assert trained_steps(adv) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert trained_steps(step_advantages([[1.0], [1.0]])) == []
    assert step_advantages([]) == [] and step_advantages([[], []]) == [[], []]


# ---------------------------------------------------------------------------- RM rewards
def test_rm_consistency_reward_uses_raw_step_reward_and_minus_two_for_unparseable():
    # R = 1, S = (1, -1, None) → raw (1, -1, -2): mean -2/3, std sqrt(14)/3
    # → (5, -1, -4) / sqrt(14): an unparseable scoring is worse than a wrong one
    assert rm_consistency_rewards(1.0, [1, -1, None]) == pytest.approx(
        [1.3363062095621219, -0.2672612419124244, -1.0690449676496976])
    # R = 2, S = (1, 1, -1) → raw (2, 2, -2): mean 2/3, std 4·sqrt(2)/3 → (1, 1, -2) / sqrt(2)
    assert rm_consistency_rewards(2.0, [1, 1, -1]) == pytest.approx(
        [0.7071067811865476, 0.7071067811865476, -1.4142135623730951])
    # R = -1, S = (1, -1, -1) → raw (-1, 1, 1): agreeing with a bad step's -1 is rewarded
    assert rm_consistency_rewards(-1.0, [1, -1, -1]) == pytest.approx(
        [-1.4142135623730951, 0.7071067811865476, 0.7071067811865476])
    # R = 2, S = (1, -1, None) → raw (2, -2, -2): the -2 of a wrong score equals unparseable
    assert rm_consistency_rewards(2.0, [1, -1, None]) == pytest.approx(
        [1.4142135623730951, -0.7071067811865476, -0.7071067811865476])


def test_rm_step_with_zero_variance_is_skipped():
    assert rm_consistency_rewards(1.0, [1, 1, 1]) is None
    assert rm_consistency_rewards(0.0, [1, -1, 1]) is None  # R = 0: every R·S is 0
    assert rm_consistency_rewards(2.0, [None, None, None]) is None
    assert rm_consistency_rewards(-2.0, [1]) is None  # m = 1
    with pytest.raises(ValueError, match="score 1: must be -1, 1 or None"):
        rm_consistency_rewards(1.0, [1, 0])


# ---------------------------------------------------------------------------- task filters
def test_task_bands_are_inclusive_at_both_edges():
    assert accuracy([1, 0, 0, 0, 0]) == 0.2 and accuracy([1, 1, 1, 1, -1]) == 0.8
    assert accuracy([1, -1, -1, -1, -1, -1, -1, -1]) == 0.125
    for acc, rm in [(0.0, False), (0.125, False), (0.19, False), (0.2, True), (0.5, True),
                    (0.8, True), (0.81, False), (1.0, False)]:
        assert rm_task_filter(acc) is rm, acc
    for acc, pol in [(0.0, False), (0.12, False), (0.125, True), (0.5, True), (0.875, True),
                     (0.88, False), (1.0, False)]:
        assert policy_task_filter(acc) is pol, acc
    assert rm_task_filter(0.7 + 0.1)  # 0.7999999999999999 still counts as 0.8
    assert in_band(0.3, 0.3, 0.3) and not in_band(0.31, 0.3, 0.3)
    with pytest.raises(ValueError, match="empty"):
        accuracy([])


def test_adaptation_triggers_at_or_above_point_eight_and_at_or_below_point_two():
    for acc, direction in [(1.0, "harder"), (0.8, "harder"), (0.7 + 0.1, "harder"),
                           (0.79, None), (0.5, None), (0.21, None), (0.2, "easier"),
                           (0.0, "easier")]:
        assert adaptation_direction(acc) == direction, acc


@pytest.mark.parametrize("direction, before, after, accepted", [
    ("harder", 0.9, 0.5, True),
    ("harder", 0.9, 0.2, True),  # acc' = 0.2 is the lowest accepted
    ("harder", 0.9, 0.1, False),  # too hard
    ("harder", 0.9, 0.9, False),  # not harder
    ("harder", 0.8, 1.0, False),  # easier than before
    ("harder", 0.9, 0.0, False),
    ("easier", 0.1, 0.5, True),
    ("easier", 0.1, 0.8, True),  # acc' = 0.8 is the highest accepted
    ("easier", 0.1, 0.9, False),  # too easy
    ("easier", 0.1, 0.1, False),  # not easier
    ("easier", 0.2, 0.1, False),  # harder than before
    ("easier", 0.0, 0.0, False),  # still unsolved
])
def test_candidate_acceptance_rule(direction, before, after, accepted):
    assert accept_candidate(direction, before, after) is accepted


def test_candidate_nobody_solves_is_rejected_even_when_the_band_allows_it():
    assert not accept_candidate("harder", 0.5, 0.0, low=0.0)
    assert accept_candidate("harder", 0.5, 0.25, low=0.0)
    with pytest.raises(ValueError, match="direction must be 'harder' or 'easier', got 'same'"):
        accept_candidate("same", 0.5, 0.5)  # type: ignore[arg-type]


def test_failure_steps_are_those_every_rm_score_marked_minus_one():
    scores = [[-1, -1, -1], [-1, None, -1], [1, -1, -1], [-1, -1, -1], [], [-1]]
    assert failure_steps(scores) == [0, 3, 5]


def test_programmatic_critique_is_a_deterministic_summary_of_failed_steps():
    steps = [{"action": "go to desk 1", "observation": "You arrive at desk 1."},
             {"action": "take  mug\n1", "observation": "Nothing happens."},
             {"action": "open drawer 2", "observation": "x" * 50}]
    text = programmatic_critique(steps, [1, 2], max_chars=20)
    assert text == ("2 of 3 steps failed (every RM score -1):\n"
                    "- step 1: action 'take mug 1' -> observation 'Nothing happens.'\n"
                    "- step 2: action 'open drawer 2' -> observation '" + "x" * 19 + "…'")
    assert programmatic_critique(steps, [1, 2], max_chars=20) == text
    assert programmatic_critique(steps, [0, 1, 2], max_items=1).endswith("\n- … 2 more")
    assert programmatic_critique(steps, []) == (
        "No step of 3 was marked a failure by every RM score.")
    with pytest.raises(ValueError, match="failed step index 3 out of range for 3 steps"):
        programmatic_critique(steps, [3])


# ---------------------------------------------------------------------------- Theorem 1
TRIALS = 20_000
MS = (1, 3, 9, 21)


def _tolerance(p: float = 0.5) -> float:
    return 3 * math.sqrt(p * (1 - p) / TRIALS)  # 3 standard errors (p = 0.5: the widest)


def test_precision_bound_values():
    assert precision_bound(1, 1.6) == pytest.approx(0.08606881472877181)  # 1 - e^-0.09
    assert precision_bound(21, 1.6) == pytest.approx(0.8489281911636292)  # 1 - e^-1.89
    assert precision_bound(9, 1.0) == 0.0 and precision_bound(9, 0.8) == 0.0
    with pytest.raises(ValueError, match="m must be at least 1, got 0"):
        precision_bound(0, 1.6)


def exact_precision(p_plus: float, p_minus: float, m: int) -> float:
    """Theorem 1's A = P(S+ > S-) + P(S+ = S-)/2, exactly: S+ counts Binomial(m, p+) +1 scores
    of a good step, S- Binomial(m, 1 - p-) of a bad one."""
    def pmf(p: float) -> list[float]:
        return [math.comb(m, k) * p ** k * (1 - p) ** (m - k) for k in range(m + 1)]
    good, bad = pmf(p_plus), pmf(1 - p_minus)
    return sum(g * b * (1.0 if i > j else 0.5 if i == j else 0.0)
               for i, g in enumerate(good) for j, b in enumerate(bad))


def test_more_scores_raise_precision_above_the_bound_when_mu_exceeds_one():
    for p_plus, p_minus in ((0.8, 0.8), (1.0, 0.3), (0.65, 0.7)):  # mu = 1.6, 1.3, 1.35
        mu = p_plus + p_minus
        measured = [simulate_precision(p_plus, p_minus, m, TRIALS, seed=m) for m in MS]
        for m, a in zip(MS, measured):
            assert abs(a - exact_precision(p_plus, p_minus, m)) <= _tolerance(), (m, a)
            assert a >= precision_bound(m, mu) - _tolerance(), (m, a)
        assert all(b >= a - _tolerance() for a, b in itertools.pairwise(measured))
    assert exact_precision(0.8, 0.8, 21) > 0.999 and exact_precision(1.0, 0.3, 101) > 0.99


def test_more_scores_lower_precision_when_mu_is_below_one():
    for p_plus, p_minus in ((0.4, 0.4), (0.9, 0.0)):  # mu = 0.8, 0.9
        measured = [simulate_precision(p_plus, p_minus, m, TRIALS, seed=100 + m) for m in MS]
        for m, a in zip(MS, measured):
            assert abs(a - exact_precision(p_plus, p_minus, m)) <= _tolerance(), (m, a)
        assert all(b < a for a, b in itertools.pairwise(measured)) and measured[0] < 0.5


def test_precision_stays_at_one_half_when_mu_is_one():
    for p_plus, p_minus in ((0.5, 0.5), (0.9, 0.1)):
        for m in MS:
            a = simulate_precision(p_plus, p_minus, m, TRIALS, seed=200 + m)
            assert abs(a - 0.5) <= _tolerance(), (p_plus, p_minus, m, a)


def test_majority_accuracy_is_not_precision_and_counts_ties_as_wrong():
    # m = 2 at p = 0.5: right only when both scores match the label, 1/4
    assert abs(simulate_majority_accuracy(0.5, 0.5, 2, TRIALS, seed=7) - 0.25) <= \
        _tolerance(0.25)
    assert simulate_majority_accuracy(1.0, 1.0, 4, 100, seed=0) == 1.0
    # mu = 1.3 > 1: precision tends to 1, the majority's accuracy on one step stays near 1/2
    assert simulate_majority_accuracy(1.0, 0.3, 101, TRIALS, seed=1) < 0.55
    assert simulate_precision(1.0, 0.3, 101, TRIALS, seed=1) > 0.99
    assert simulate_precision(0.3, 0.6, 5, 1000, seed=3) == simulate_precision(
        0.3, 0.6, 5, 1000, seed=3)
    for f in (simulate_precision, simulate_majority_accuracy):
        with pytest.raises(ValueError, match="p_minus must be a probability in"):
            f(0.5, 1.5, 3, 10, seed=0)


# ---------------------------------------------------------------------------- step RM prompt
def test_step_rm_prompt_shows_task_history_action_and_observation_in_order():
    history = [{"role": "user", "content": "You are in a kitchen."},
               {"role": "assistant", "content": "go to fridge 1"},
               {"role": "user", "content": "You arrive at fridge 1."}]
    system, user = build_step_rm_prompt("put a cool apple in the microwave", history,
                                        "open fridge 1", "You open fridge 1. It holds an apple.")
    assert system == {"role": "system", "content": STEP_RM_SYSTEM}
    assert user["role"] == "user"
    body = user["content"]
    for part in ("put a cool apple in the microwave", "[assistant]\ngo to fridge 1",
                 "open fridge 1", "You open fridge 1. It holds an apple."):
        assert part in body
    assert (body.index("cool apple") < body.index("go to fridge 1")
            < body.index("## The action") < body.index("It holds an apple"))
    assert "omitted" not in body
    first = build_step_rm_prompt("t", [], "look", "")[1]["content"]
    assert "(none: this is the first step)" in first and "(no observation)" in first


def test_step_rm_prompt_drops_oldest_history_first_with_a_note():
    history = [{"role": "user", "content": f"observation {k} " + "." * 80} for k in range(10)]
    body = build_step_rm_prompt("t", history, "look", "ok", max_history_chars=310)[1]["content"]
    # each message renders to "[user]\n" + "observation k " + 80 dots = 101 chars: 3 fit
    assert "[… 7 earlier messages omitted]" in body
    assert "observation 9" in body and "observation 7" in body
    assert "observation 6 " not in body and "observation 0 " not in body


def test_step_rm_prompt_examples_are_never_read_as_a_score():
    assert parse_step_score(STEP_RM_SYSTEM) is None
    head, rest = STEP_RM_SYSTEM.split(EXAMPLES_START)
    assert "\\boxed" not in head and "\\boxed" not in rest.split(EXAMPLES_END)[1]


@pytest.mark.parametrize("text, score", [
    ("The drawer opened, as needed.\n\\boxed{1}", 1),
    ("\\boxed{-1}", -1),
    ("Neither, really. \\boxed{0}", None),
    ("\\boxed{2}", None),
    ("no box at all", None),
    ("", None),
])
def test_parse_step_score(text, score):
    assert parse_step_score(text) == score


def test_parse_step_score_reads_the_verdict_after_quoted_examples():
    examples = STEP_RM_SYSTEM[STEP_RM_SYSTEM.index(EXAMPLES_START):]
    text = f"The prompt says:\n{examples}\nNothing happened after the action.\n\\boxed{{-1}}"
    assert parse_step_score(text) == -1
    assert parse_step_score(f"{examples}\nIt found the apple. \\boxed{{1}}") == 1


def test_live_turn_reward_is_outcome_plus_weighted_mean_vote():
    from clawray.rlanything.core import live_turn_reward

    assert live_turn_reward(None, [1, 1, -1]) == pytest.approx(1 / 3)
    assert live_turn_reward(1, [1, 0, None], lam=2.0) == pytest.approx(1 + 2 / 3)
    assert live_turn_reward(-1, []) == -1.0 and live_turn_reward(None, []) == 0.0
    with pytest.raises(ValueError, match="outcome must be"):
        live_turn_reward(0, [1])
    with pytest.raises(ValueError, match="vote 1: must be"):
        live_turn_reward(None, [1, 2])
