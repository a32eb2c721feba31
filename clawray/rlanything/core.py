"""RLAnything's rules as plain functions: step rewards, advantages, RM rewards, task filters,
environment adaptation and Theorem 1 (docs/rlanything.md). No Ray, no torch: numpy only.

Notation: a task is rolled out several times; rollout ``τ`` has steps ``i = 0, 1, …``; the
step-wise reward model (RM) scores each step ``m`` times, ``S[τ,i,j] ∈ {−1, +1}`` (``None``
when the RM's output could not be parsed); ``O_τ ∈ {−1, +1}`` is the rollout's outcome.

- Step reward ``R[τ,i] = O_τ + (λ/m) Σ_j S[τ,i,j]``, unparseable scores counting 0, so
  ``R ∈ [−1−λ, 1+λ]`` (``[−2, 2]`` at λ = 1).
- Policy advantage at step ``i``: ``R`` standardized over the rollouts of the same task that
  have a step ``i`` (population std); std ≈ 0 gives 0. A step that only one rollout reaches
  gets 0 by default (``single="zero"``, see ``step_advantages``). Zero-advantage steps are not
  trained on (``trained_steps`` lists the others).
- RM consistency reward ``R_S[τ,i,j] = R[τ,i] · S[τ,i,j]`` (raw ``R``), −2 for an unparseable
  scoring, standardized over the ``m`` scorings of the step; zero variance → skipped (None).
- Task filters: policy data from tasks with accuracy in [1/8, 7/8], RM data from tasks with
  accuracy in [0.2, 0.8], both bounds inclusive.
- Environment adaptation: accuracy ≥ 0.8 → rewrite "harder", ≤ 0.2 → "easier", from a critique
  of the steps every RM score marked −1; the candidate is accepted iff ``acc′ > 0`` and
  (harder: ``acc′ < acc`` and ``acc′ ≥ 0.2``; easier: ``acc′ > acc`` and ``acc′ ≤ 0.8``).

Accuracies are fractions ``k/n``; comparisons between them allow ``ACC_EPS`` of float slack so
that, say, ``0.1 * 8`` still counts as reaching 0.8.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

STD_EPS = 1e-6
ACC_EPS = 1e-9
POLICY_BAND = (1 / 8, 7 / 8)
RM_BAND = (0.2, 0.8)
UNPARSEABLE_RM_REWARD = -2.0

Score = int | None
Direction = Literal["harder", "easier"]
SingleRule = Literal["zero", "raw"]


# ---------------------------------------------------------------------------- rewards
def _check_scores(scores: Sequence[Score], where: str) -> None:
    if len(scores) == 0:
        raise ValueError(f"{where}: needs at least one RM score, got an empty list")
    for j, s in enumerate(scores):
        if s is not None and (isinstance(s, bool) or s not in (-1, 1)):
            raise ValueError(f"{where}, score {j}: must be -1, 1 or None (unparseable), "
                             f"got {s!r}")


def step_rewards(outcome: int, scores: Sequence[Sequence[Score]],
                 lam: float = 1.0) -> list[float]:
    """``R_i = O + (lam / m_i) Σ_j S_ij`` for every step ``i`` of one rollout.

    ``scores[i]`` holds the RM's ``m_i`` scores of step ``i`` (``m_i`` may differ per step, e.g.
    when a scoring request was lost); ``None`` (unparseable) counts 0 but still counts in
    ``m_i``, so an RM that fails to answer pulls ``R`` toward the outcome, never past it.
    """
    if isinstance(outcome, bool) or outcome not in (-1, 1):
        raise ValueError(f"outcome must be +1 (success) or -1 (failure), got {outcome!r}")
    rewards = []
    for i, step in enumerate(scores):
        _check_scores(step, f"step {i}")
        total = sum(s for s in step if s is not None)
        rewards.append(float(outcome + lam * total / len(step)))
    return rewards


def live_turn_reward(outcome: int | None, votes: Sequence[int | None],
                     lam: float = 1.0) -> float:
    """A live turn as one RLAnything step: ``R = O + (lam / m) Σ_j S_j``, its m PRM votes the
    scores and explicit feedback the outcome ``O`` (``None``: no feedback, so ``O = 0`` and the
    votes alone decide). A live PRM vote may also be 0 (the rubric's "ambiguous"); like an
    unparseable vote (``None``) it adds nothing but counts in m. No votes: ``R = O``."""
    if outcome is not None and (isinstance(outcome, bool) or outcome not in (-1, 1)):
        raise ValueError(f"outcome must be +1, -1 or None (no feedback), got {outcome!r}")
    for j, v in enumerate(votes):
        if v is not None and (isinstance(v, bool) or v not in (-1, 0, 1)):
            raise ValueError(f"vote {j}: must be -1, 0, 1 or None (unparseable), got {v!r}")
    o = float(outcome or 0)
    return o + lam * sum(v for v in votes if v is not None) / len(votes) if votes else o


def step_advantages(rewards_per_rollout: Sequence[Sequence[float]],
                    single: SingleRule = "zero") -> list[list[float]]:
    """Per-step advantages of one task's rollouts (``rewards_per_rollout[τ][i] = R[τ,i]``).

    At step ``i``, ``R`` is standardized over the rollouts that have a step ``i``
    (``(R - mean) / std``, population std); std < ``STD_EPS`` gives 0 for all of them.

    When only one rollout reaches step ``i``: ``single="zero"`` (default) gives 0, so the step
    is not trained; ``"raw"`` keeps its raw ``R`` (the reference's choice). Zero is the default
    because a lone step has nothing to be compared with: its raw ``R`` (up to ±2) is on another
    scale than the unit-variance advantages around it, and the steps only one rollout reaches
    are mostly the tail of a long failed rollout, so keeping them would weigh failures by their
    length.
    """
    if single not in ("zero", "raw"):
        raise ValueError(f"single must be 'zero' or 'raw', got {single!r}")
    advantages: list[list[float]] = [[0.0] * len(r) for r in rewards_per_rollout]
    longest = max((len(r) for r in rewards_per_rollout), default=0)
    for i in range(longest):
        having = [k for k, r in enumerate(rewards_per_rollout) if len(r) > i]
        values = np.asarray([rewards_per_rollout[k][i] for k in having], dtype=np.float64)
        if len(having) == 1:
            advantages[having[0]][i] = float(values[0]) if single == "raw" else 0.0
            continue
        std = values.std()
        if std < STD_EPS:
            continue
        for k, a in zip(having, (values - values.mean()) / std):
            advantages[k][i] = float(a)
    return advantages


def trained_steps(advantages: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """``(rollout, step)`` of every step with a non-zero advantage: the only ones trained on."""
    return [(k, i) for k, adv in enumerate(advantages) for i, a in enumerate(adv) if a != 0.0]


def rm_consistency_rewards(step_reward: float, scores: Sequence[Score],
                           unparseable: float = UNPARSEABLE_RM_REWARD) -> list[float] | None:
    """The RM's reward for each of its ``m`` scorings of one step, or None to skip the step.

    ``R_S_j = R · S_j`` (raw step reward: a scoring agreeing with a clearly good or bad step
    earns most), ``unparseable`` (−2) for a scoring that gave no valid score, then standardized
    over the ``m`` scorings (population std). Zero variance (all scorings rewarded alike, or
    ``m = 1``) carries no signal: None.
    """
    _check_scores(scores, "rm_consistency_rewards")
    raw = np.asarray([step_reward * s if s is not None else unparseable for s in scores],
                     dtype=np.float64)
    std = raw.std()
    if std < STD_EPS:
        return None
    return ((raw - raw.mean()) / std).tolist()


# ---------------------------------------------------------------------------- task filters
def accuracy(rewards: Sequence[float]) -> float:
    """The fraction of a task's rollouts that succeeded: rewards (or outcomes) ``> 0``, so
    both 1/0 rewards and +1/−1 outcomes work."""
    if len(rewards) == 0:
        raise ValueError("accuracy of an empty list of rollouts is undefined")
    return sum(1 for r in rewards if r > 0) / len(rewards)


def in_band(acc: float, low: float, high: float) -> bool:
    """``low ≤ acc ≤ high`` (inclusive, with ``ACC_EPS`` slack)."""
    return low - ACC_EPS <= acc <= high + ACC_EPS


def policy_task_filter(acc: float, low: float = POLICY_BAND[0],
                       high: float = POLICY_BAND[1]) -> bool:
    """Whether a task's rollouts are policy training data: accuracy in [1/8, 7/8]."""
    return in_band(acc, low, high)


def rm_task_filter(acc: float, low: float = RM_BAND[0], high: float = RM_BAND[1]) -> bool:
    """Whether a task's rollouts are RM training data: accuracy in [0.2, 0.8]."""
    return in_band(acc, low, high)


# ---------------------------------------------------------------------------- environment
def adaptation_direction(acc: float, harder_at: float = 0.8,
                         easier_at: float = 0.2) -> Direction | None:
    """"harder" when ``acc ≥ harder_at``, "easier" when ``acc ≤ easier_at``, else None."""
    if acc >= harder_at - ACC_EPS:
        return "harder"
    if acc <= easier_at + ACC_EPS:
        return "easier"
    return None


def accept_candidate(direction: Direction, acc_before: float, acc_candidate: float,
                     low: float = 0.2, high: float = 0.8) -> bool:
    """Whether a rewritten task replaces the active one (RLAnything's acceptance rule).

    Accepted iff ``acc′ > 0`` (a task nobody solves teaches nothing and may be unsolvable) and
    harder: ``acc′ < acc`` and ``acc′ ≥ low``; easier: ``acc′ > acc`` and ``acc′ ≤ high``.
    """
    if acc_candidate <= ACC_EPS:
        return False
    if direction == "harder":
        return acc_candidate < acc_before - ACC_EPS and acc_candidate >= low - ACC_EPS
    if direction == "easier":
        return acc_candidate > acc_before + ACC_EPS and acc_candidate <= high + ACC_EPS
    raise ValueError(f"direction must be 'harder' or 'easier', got {direction!r}")


def failure_steps(scores_per_step: Sequence[Sequence[Score]]) -> list[int]:
    """Indices of the steps that every one of their RM scores marked −1 (an unparseable score
    is not a −1, so such a step is not a failure step). The critique is built from these."""
    return [i for i, scores in enumerate(scores_per_step)
            if scores and all(s == -1 for s in scores)]


def programmatic_critique(steps: Sequence[Mapping[str, str]], failed_indices: Sequence[int],
                          max_chars: int = 160, max_items: int = 8) -> str:
    """A short, deterministic summary of a rollout's failed steps, for families whose task
    rewriting is rule-based. ``steps[i]`` has "action" and "observation" texts; each is put on
    one line and cut to ``max_chars``; at most ``max_items`` steps are listed."""
    for i in failed_indices:
        if not 0 <= i < len(steps):
            raise ValueError(f"failed step index {i} out of range for {len(steps)} steps")
    if not failed_indices:
        return f"No step of {len(steps)} was marked a failure by every RM score."
    lines = [f"{len(failed_indices)} of {len(steps)} steps failed (every RM score -1):"]
    for i in list(failed_indices)[:max_items]:
        action = _one_line(steps[i].get("action", ""), max_chars)
        observation = _one_line(steps[i].get("observation", ""), max_chars)
        lines.append(f"- step {i}: action {action!r} -> observation {observation!r}")
    if len(failed_indices) > max_items:
        lines.append(f"- … {len(failed_indices) - max_items} more")
    return "\n".join(lines)


def _one_line(text: str, max_chars: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"


# ---------------------------------------------------------------------------- Theorem 1
def precision_bound(m: int, mu: float) -> float:
    """Theorem 1's lower bound on the precision of ``m`` RM scores: ``1 − exp(−m(μ−1)²/4)``.

    The theorem holds for ``μ > 1`` only; for ``μ ≤ 1`` more scores do not help (precision does
    not tend to 1) and the bound is 0.0, the trivial one.
    """
    if m < 1:
        raise ValueError(f"m must be at least 1, got {m}")
    if mu <= 1.0:
        return 0.0
    return 1.0 - math.exp(-m * (mu - 1.0) ** 2 / 4.0)


def simulate_precision(p_plus: float, p_minus: float, m: int, trials: int,
                       seed: int) -> float:
    """Monte Carlo of Theorem 1's precision ``A = P(S₊ > S₋)`` of an RM scoring a step ``m`` times.

    ``S₊`` is the sum of the ``m`` scores (±1) of a good step, each +1 with probability
    ``p_plus``; ``S₋`` that of a bad step, each −1 with probability ``p_minus``, all independent.
    ``A`` is the probability that a good step outscores a bad one, ties counted half (the
    ranking the advantage uses: ``E[S₊ − S₋] = 2m(μ − 1)`` with ``μ = p₊ + p₋``). ``A → 1`` as
    ``m`` grows iff ``μ > 1``, with ``A ≥ 1 − exp(−m(μ−1)²/4)``; ``A = ½`` for every ``m`` at
    ``μ = 1``. (Majority-vote accuracy on one step is ``simulate_majority_accuracy``.)
    """
    _check_rates(p_plus, p_minus, m, trials)
    rng = np.random.default_rng(seed)
    good = rng.binomial(m, p_plus, trials)  # +1 scores of a good step
    bad = rng.binomial(m, 1.0 - p_minus, trials)  # +1 scores of a bad step
    return float(np.mean(good > bad) + 0.5 * np.mean(good == bad))


def simulate_majority_accuracy(p_plus: float, p_minus: float, m: int, trials: int,
                               seed: int) -> float:
    """Monte Carlo accuracy of the majority of ``m`` scores on one step (not Theorem 1's ``A``).

    True labels are ±1 with probability 1/2 each; for a +1 step each score is +1 with
    probability ``p_plus``, for a −1 step each is −1 with probability ``p_minus``, independently.
    A trial is right when the majority of the ``m`` scores matches the label; a tie (even
    ``m``) counts as wrong. Unlike ``A``, it tends to 1 only when both rates exceed ½ (p₊ = 1,
    p₋ = 0.2 gives μ = 1.2 but accuracy → ½).
    """
    _check_rates(p_plus, p_minus, m, trials)
    rng = np.random.default_rng(seed)
    positive = rng.random(trials) < 0.5
    p_right = np.where(positive, p_plus, p_minus)
    right = rng.binomial(m, p_right)  # scores matching the true label
    return float(np.mean(2 * right > m))


def _check_rates(p_plus: float, p_minus: float, m: int, trials: int) -> None:
    for name, p in (("p_plus", p_plus), ("p_minus", p_minus)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be a probability in [0, 1], got {p}")
    if m < 1 or trials < 1:
        raise ValueError(f"m and trials must be at least 1, got m={m}, trials={trials}")
