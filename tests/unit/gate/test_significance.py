"""Each of the gate's rules, run many times on a candidate exactly as good as the incumbent:
the share it rejects (its false-rejection rate) must not exceed its alpha by more than the
Monte-Carlo error (three standard errors of a rate at ``SIMS`` runs), and where the test is
exact for the data (Student's t on normal scores) it must not fall far below it either.

These tests can fail: the shadow rule's former normal quantile (1.645 where Student's t with 9
degrees of freedom gives 1.833) rejects 6.7 % of equal candidates on 10 prompts at alpha 0.05
in theory, and rejected 6.1 % of this test's simulated ones (the t-test: 4.8 %), above the
bound here (0.05 + 3 × 0.0034 = 0.060)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from clawray.gate.core import BASE, GateCore, GateSettings
from clawray.gate.health import health

SIMS = 4000
OK_HEALTH = health(["Hello! How can I help you today?"] * 10, [8] * 10)


def bound(alpha: float) -> float:
    return alpha + 3 * math.sqrt(alpha * (1 - alpha) / SIMS)


def floor(alpha: float) -> float:
    return alpha - 3 * math.sqrt(alpha * (1 - alpha) / SIMS)


def gate(**kw) -> GateCore:
    return GateCore(settings=GateSettings(**kw), clock=lambda: 1000.0)


@pytest.mark.parametrize("n", [10, 40])
def test_the_shadow_rule_rejects_an_equal_candidate_at_most_alpha_of_the_time(n):
    rng = np.random.default_rng(n)
    rejected = 0
    for _ in range(SIMS):
        g = gate(shadow_margin=0.0, shadow_alpha=0.05)  # significance alone decides
        g.propose(1)
        # paired scores: a prompt's difficulty is shared, the noise of each side is its own
        difficulty = rng.normal(0, 1, n)
        cand = (difficulty + rng.normal(0, 0.5, n)).tolist()
        inc = (difficulty + rng.normal(0, 0.5, n)).tolist()
        rejected += g.shadow_report(1, cand, inc, OK_HEALTH, OK_HEALTH)["event"] == "rejected"
    rate = rejected / SIMS
    print(f"shadow rule, n={n}: {rate:.4f} of equal candidates rejected (alpha 0.05)")
    assert floor(0.05) <= rate <= bound(0.05), rate


def test_the_reference_rule_rejects_a_candidate_at_the_reference_at_most_alpha_of_the_time():
    rng = np.random.default_rng(1)
    rejected = 0
    for _ in range(SIMS):
        g = gate(shadow_margin=0.0, shadow_alpha=0.05)
        g.reference_score = 0.0  # a fixed anchor from an earlier evaluation
        g.propose(1)
        cand = rng.normal(0, 1, 10).tolist()
        inc = (np.asarray(cand) - 1.0).tolist()  # far below: only the reference can reject
        ev = g.shadow_report(1, cand, inc, OK_HEALTH, OK_HEALTH)
        rejected += ev["event"] == "rejected" and "reference" in ev["reason"]
    rate = rejected / SIMS
    print(f"reference rule: {rate:.4f} rejected (alpha 0.05)")
    assert floor(0.05) <= rate <= bound(0.05), rate


def test_the_canary_rolls_back_an_equal_candidate_as_worse_at_most_alpha_of_the_time():
    """Five looks of 20 turns a side, each one-sided at alpha / 5 (Bonferroni): peeking does
    not raise the rate of "worse" rollbacks above alpha. Rewards are ±1 judge votes."""
    rng = random.Random(2)
    worse = 0
    looks = 5
    for _ in range(SIMS):
        g = gate(canary_min_turns=20, canary_looks=looks, canary_alpha=0.05, canary_margin=0.1)
        g.propose(1)
        g.shadow_report(1, [1.0] * 10, [1.0] * 10, OK_HEALTH, OK_HEALTH)
        ev = None
        for _ in range(looks * 20):
            g.observe(BASE, rng.choice((1.0, 1.0, -1.0)))
            ev = g.observe(1, rng.choice((1.0, 1.0, -1.0))) or ev
            if g.phase is None:
                break
        worse += bool(ev) and ev["event"] == "rolled_back" and "worse" in ev["reason"]
    rate = worse / SIMS
    print(f"canary, 5 looks: {rate:.4f} rolled back as worse (alpha 0.05)")
    assert rate <= bound(0.05), rate


def serving(requests, errors, seconds):
    return {"requests": requests, "errors": errors, "timed": len(seconds),
            "s_per_token": float(sum(seconds)), "s_per_token_sq": float(sum(x * x for x in seconds))}


def _guard_rate(make_report, **settings) -> float:
    hits = 0
    for _ in range(SIMS):
        g = gate(canary_min_turns=40, canary_looks=5, canary_alpha=0.05, **settings)
        g.propose(1)
        g.shadow_report(1, [1.0] * 10, [1.0] * 10, OK_HEALTH, OK_HEALTH)
        g.serving = make_report()
        hits += bool(g.guard_problems())
    return hits / SIMS


def test_the_error_guard_flags_equal_error_rates_at_most_alpha_of_the_time():
    rng = np.random.default_rng(3)

    def report():
        return {side: serving(200, int(rng.binomial(200, 0.05)), [0.01] * 40)
                for side in ("candidate", "incumbent")}
    rate = _guard_rate(report, canary_max_error_increase=0.0)
    print(f"error guard: {rate:.4f} flagged (alpha 0.01 a check)")
    assert rate <= bound(0.05 / 5), rate


def test_the_latency_guard_flags_equal_latencies_at_most_alpha_of_the_time():
    rng = np.random.default_rng(4)

    def report():  # seconds per token: skewed, as latencies are
        return {side: serving(60, 0, rng.lognormal(np.log(0.01), 0.5, 60).tolist())
                for side in ("candidate", "incumbent")}
    rate = _guard_rate(report, canary_max_latency_ratio=0.0)
    print(f"latency guard: {rate:.4f} flagged (alpha 0.01 a check)")
    assert rate <= bound(0.05 / 5), rate


def test_the_regenerate_guard_flags_equal_regenerate_rates_at_most_alpha_of_the_time():
    rng = random.Random(5)
    hits = 0
    for _ in range(SIMS):
        g = gate(canary_min_turns=60, canary_looks=5, canary_alpha=0.05,
                 canary_max_regenerate_increase=0.0)
        g.propose(1)
        g.shadow_report(1, [1.0] * 10, [1.0] * 10, OK_HEALTH, OK_HEALTH)
        for side in ("candidate", "incumbent"):
            for _ in range(60):
                g.arms[side].add(1.0, "regenerated" if rng.random() < 0.1 else "judged")
        hits += bool(g.guard_problems())
    print(f"regenerate guard: {hits / SIMS:.4f} flagged (alpha 0.01 a check)")
    assert hits / SIMS <= bound(0.05 / 5), hits / SIMS
