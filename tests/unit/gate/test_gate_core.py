"""The policy gate's rules: shadow rejection, canary promotion and rollback, sticky canary
sessions, operator rollback to a kept version, abandoned lines, persistence."""

import random

import pytest

from clawray.gate.core import BASE, GateCore, GateSettings, adapter_name, canary_bucket
from clawray.gate.health import health

HEALTHY = ["Hello! How can I help you today?"] * 10
OK_HEALTH = health(HEALTHY, [8] * 10)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def gate(**kw) -> GateCore:
    return GateCore(settings=GateSettings(**kw), clock=Clock())


def to_canary(g: GateCore, version: int) -> None:
    g.propose(version)
    ev = g.shadow_report(version, [1.0] * 10, [1.0] * 10, OK_HEALTH, OK_HEALTH)
    assert ev["event"] == "canary"


def test_a_degenerate_candidate_is_rejected_at_shadow_evaluation_and_its_line_abandoned():
    g = gate()
    assert g.propose(1)["event"] == "candidate"
    assert g.propose(2)["event"] == "queued"  # trained on while 1 is pending
    gibberish = health(['",",",",",",",",",",'] * 10, [12] * 10)
    ev = g.shadow_report(1, [0.0] * 10, [0.0] * 10, gibberish, OK_HEALTH)
    assert ev["event"] == "rejected" and "readable replies 0%" in ev["reason"]
    assert g.incumbent == BASE and g.candidate is None and g.route("anyone") == BASE
    assert g.abandoned == {1, 2} and g.line == 1  # 2 descends from 1: abandoned too
    assert g.kept == []
    # the trainer restarts from the incumbent; its next version is a fresh candidate
    assert g.propose(3)["event"] == "candidate" and g.candidate == 3


def test_shadow_rejects_a_lower_held_out_score_beyond_the_margin_and_passes_within_it():
    g = gate(shadow_margin=0.1)
    g.propose(1)
    ev = g.shadow_report(1, [0.0] * 6 + [1.0] * 4, [1.0] * 10, OK_HEALTH, OK_HEALTH)
    assert ev["event"] == "rejected" and "lower by 0.600" in ev["reason"]
    g.propose(2)
    ev = g.shadow_report(2, [1.0] * 9 + [0.0], [1.0] * 10, OK_HEALTH, OK_HEALTH)
    assert ev["event"] == "canary" and g.phase == "canary"
    long_replies = health(["word " * 60] * 10, [60] * 10)
    g2 = gate()
    g2.propose(1)
    ev = g2.shadow_report(1, [1.0] * 10, [1.0] * 10, long_replies, OK_HEALTH)
    assert ev["event"] == "rejected" and "median reply length 60" in ev["reason"]


def test_sampling_noise_alone_does_not_reject_a_candidate():
    g = gate(shadow_margin=0.05)
    g.propose(1)
    # 40 paired prompts: 6 lost, 3 won (seeded sampling differs where weights differ)
    inc = [1.0] * 20 + [0.0] * 20
    cand = [0.0] * 6 + [1.0] * 14 + [1.0] * 3 + [0.0] * 17
    ev = g.shadow_report(1, cand, inc, OK_HEALTH, OK_HEALTH)
    assert ev["event"] == "canary", ev  # lower by 0.075 > margin, but not significantly
    assert ev["evidence"]["difference"] == pytest.approx(-0.075)


def test_a_version_trained_on_an_abandoned_line_is_discarded():
    g = gate()
    g.propose(1, line=0)
    g.shadow_report(1, [0.0] * 10, [1.0] * 10, OK_HEALTH, OK_HEALTH)  # rejected: line 1
    # the trainer had trained version 2 on the abandoned line before it saw the rejection
    ev = g.propose(2, line=0)
    assert ev["event"] == "discarded" and g.candidate is None and 2 in g.abandoned
    assert g.kept == [] and g.published == 2
    assert g.propose(3, line=1)["event"] == "candidate"  # after its restart


def test_the_held_out_score_cannot_creep_down_version_by_version():
    """40 prompts: 0.2 below a fixed anchor of 1.0 is significant there (one-sample t-test,
    p = 0.002); on 10 prompts 8/10 against 1.0 is not (p = 0.08)."""
    g = gate(shadow_margin=0.15)
    g.propose(1)  # 0.1 below the incumbent (the reference): within the margin
    nine = [1.0] * 36 + [0.0] * 4
    assert g.shadow_report(1, nine, [1.0] * 40, OK_HEALTH, OK_HEALTH)["event"] == "canary"
    g.promote()
    g.propose(2)  # 0.1 below the incumbent again, but 0.2 below the reference
    ev = g.shadow_report(2, [1.0] * 32 + [0.0] * 8, nine, OK_HEALTH, OK_HEALTH)
    assert ev["event"] == "rejected" and "against the reference's 1.000" in ev["reason"]
    assert ev["evidence"]["p_below_reference"] < 0.01


def test_readability_cannot_creep_down_version_by_version():
    g = gate(canary_min_turns=2, canary_margin=1.0, min_readable=0.8)
    def rate(r):  # replies of which a share r reads as text
        n = round(r * 20)
        return health(["Fine, thanks."] * n + ["checkcheckcheckreadreadfind"] * (20 - n), [4] * 20)
    incumbent = rate(0.75)  # the base itself reads 75% on this set
    for v, r in ((1, 0.7), (2, 0.66)):  # each within 10 points of the base's 75%
        g.propose(v)
        assert g.shadow_report(v, [0.0], [0.0], rate(r), incumbent)["event"] == "canary"
        g.promote()
        incumbent = rate(r)
    g.propose(3)  # 10 points below the last incumbent, 15 below the reference: rejected
    ev = g.shadow_report(3, [0.0], [0.0], rate(0.6), incumbent)
    assert ev["event"] == "rejected" and "reference's 75%" in ev["reason"]
    assert g.to_dict()["reference_readable"] == 0.75


def test_canary_sessions_are_sticky_and_about_the_configured_share():
    g = gate(canary_share=0.2)
    to_canary(g, 1)
    keys = [f"tenant/user/session-{i}" for i in range(4000)]
    first = {k: g.route(k) for k in keys}
    assert set(first.values()) == {BASE, 1}
    share = sum(v == 1 for v in first.values()) / len(keys)
    assert 0.17 < share < 0.23
    for _ in range(3):  # the same session is routed the same way every time
        assert all(g.route(k) == v for k, v in first.items())
    r = g.routing()
    assert r["candidate_adapter"] == adapter_name(1) and r["incumbent_adapter"] is None
    # replicas route with the routing table alone: the same answer as the gate
    assert all((canary_bucket(k, r["salt"]) < r["share"]) == (v == 1) for k, v in first.items())


def test_a_candidate_as_good_as_the_incumbent_is_promoted_after_enough_turns():
    g = gate(canary_min_turns=100, canary_margin=0.3)
    to_canary(g, 1)
    g.propose(2)  # queued behind 1
    rng = random.Random(0)
    for _ in range(100):
        g.observe(BASE, rng.choice([1.0, 1.0, 1.0, 1.0, -1.0]))
    for _ in range(99):
        assert g.observe(1, rng.choice([1.0, 1.0, 1.0, 1.0, -1.0])) is None
    ev = g.observe(1, 1.0)
    assert ev["event"] == "promoted" and "non-inferior at look 1" in ev["reason"]
    assert g.incumbent == 1 and g.route("any") in (1, 2)
    assert g.candidate == 2 and g.phase == "shadow"  # the queued version is next
    assert g.line == 0 and not g.abandoned


def test_a_worse_candidate_is_rolled_back_at_canary():
    g = gate(canary_min_turns=20)
    to_canary(g, 1)
    for _ in range(20):
        g.observe(BASE, 1.0)
        g.observe(BASE, 0.0)
    evs = [g.observe(1, -1.0) for _ in range(20)]
    assert evs[-1]["event"] == "rolled_back" and "worse at look 1" in evs[-1]["reason"]
    assert g.incumbent == BASE and g.abandoned == {1} and g.line == 1
    assert g.route("anyone") == BASE and g.routing()["share"] == 0.0


def test_turns_outside_the_canary_do_not_count():
    g = gate(canary_min_turns=5)
    g.propose(1)
    assert g.observe(1, -1.0) is None  # shadow phase: nobody is served by 1 yet
    g.shadow_report(1, [1.0], [1.0], OK_HEALTH, OK_HEALTH)
    started = g.canary_started
    assert g.observe(BASE, -1.0, served_at=started - 5) is None  # served before the canary
    assert g.observe(7, 1.0) is None  # neither side
    assert g.arms["candidate"].n == 0 and g.arms["incumbent"].n == 0


def test_undecided_canaries_roll_back_after_the_last_look():
    g = gate(canary_min_turns=10, canary_looks=2, canary_margin=0.0)
    to_canary(g, 1)
    rng = random.Random(1)
    for _ in range(10):
        g.observe(BASE, rng.choice([1.0, -1.0]))
    events = [g.observe(1, rng.choice([1.0, -1.0])) for _ in range(20)]
    decided = [e for e in events if e is not None]
    assert [e["event"] for e in decided] == ["look", "rolled_back"]
    assert "not shown non-inferior after 2 looks" in decided[-1]["reason"]


def test_the_operator_rolls_back_to_a_kept_version_without_the_trainer():
    g = gate(canary_min_turns=2, canary_margin=1.0)
    for v in (1, 2, 3):
        to_canary(g, v)
        for _ in range(2):
            g.observe(g.incumbent, 1.0)
        for _ in range(2):
            ev = g.observe(v, 1.0)
        assert ev["event"] == "promoted" and g.incumbent == v
    to_canary(g, 4)
    assert g.kept == [1, 2, 3, 4]
    ev = g.rollback(2)
    assert ev["event"] == "rolled_back" and g.incumbent == 2 and g.candidate is None
    assert g.abandoned == {3, 4} and g.kept == [1, 2] and g.line == 1
    assert g.route("x") == 2
    with pytest.raises(ValueError, match="version 3 is not kept"):
        g.rollback(3)
    assert g.rollback(BASE)["event"] == "rolled_back" and g.incumbent == BASE


def test_pinning_holds_new_versions_until_unpinned():
    g = gate()
    g.rollback(BASE, pin=True)
    assert g.propose(1)["event"] == "held" and g.candidate is None
    g.unpin()
    assert g.propose(2)["event"] == "candidate"


def test_operator_promote_and_reject():
    g = gate()
    g.propose(1)
    assert g.promote()["event"] == "promoted" and g.incumbent == 1
    g.propose(2)
    ev = g.reject("looks off")
    assert ev["event"] == "rejected" and "looks off" in ev["reason"] and g.incumbent == 1
    with pytest.raises(ValueError, match="no candidate"):
        g.promote()


def test_only_spare_versions_beyond_keep_are_dropped():
    g = gate(keep=2, canary_min_turns=2, canary_margin=1.0)
    for v in (1, 2, 3):
        g.propose(v)
        g.promote()
    g.propose(4)  # pending
    assert g.kept == [1, 2, 3, 4]
    drop = g.to_drop()
    assert drop == [1, 2] and 3 not in drop and 4 not in drop  # incumbent, candidate kept
    g.dropped(drop)
    assert g.kept == [3, 4]


def test_the_state_survives_a_restart():
    g = gate(canary_min_turns=50)
    to_canary(g, 1)
    g.observe(BASE, 1.0)
    g.observe(1, -1.0)
    d = g.to_dict()
    import json

    g2 = GateCore.from_dict(json.loads(json.dumps(d)), g.settings)
    assert g2.to_dict() == d
    assert all(g2.route(f"k{i}") == g.route(f"k{i}") for i in range(200))


def test_versions_must_increase():
    g = gate()
    g.propose(3)
    with pytest.raises(ValueError, match="not newer"):
        g.propose(3)


def test_keep_line_sets_the_rejected_candidate_aside_and_the_line_goes_on():
    g = gate(on_reject="keep_line", canary_min_turns=20)
    assert g.propose(1)["event"] == "candidate"
    assert g.propose(2)["event"] == "queued"
    gibberish = health(['",",",",",",",",",",'] * 10, [12] * 10)
    ev = g.shadow_report(1, [0.0] * 10, [0.0] * 10, gibberish, OK_HEALTH)
    assert ev["event"] == "rejected" and ev["rejected"] == [1] and ev["abandoned"] == []
    # the trainer's line is unchanged (no restart, its rows kept); 2 is the next candidate
    assert g.line == 0 and g.abandoned == set() and g.rejected == {1}
    assert g.candidate == 2 and g.phase == "shadow" and g.kept == [2]
    g.shadow_report(2, [1.0] * 10, [1.0] * 10, OK_HEALTH, OK_HEALTH)
    g.propose(3)  # queued behind 2's canary
    for _ in range(20):
        g.observe(BASE, 1.0)
        g.observe(BASE, 0.0)
    evs = [g.observe(2, -1.0) for _ in range(20)]
    assert evs[-1]["event"] == "rolled_back" and g.line == 0 and g.rejected == {1, 2}
    assert g.incumbent == BASE and g.candidate == 3 and g.route("anyone") == BASE
    assert g.propose(4, line=0)["event"] == "queued"  # the same line: not discarded
    # an operator's rollback abandons the line even so
    g.rollback(BASE)
    assert g.line == 1 and g.abandoned == {3, 4}
    restored = GateCore.from_dict(g.to_dict(), g.settings)
    assert restored.rejected == {1, 2} and restored.abandoned == {3, 4}


def test_restart_is_the_default_and_keep_line_is_validated():
    from pydantic import ValidationError

    from clawray.config import GateConfig

    assert GateConfig().on_reject == "restart" and GateSettings.of(GateConfig()).on_reject \
        == "restart"
    assert GateSettings.of(GateConfig(on_reject="keep_line")).on_reject == "keep_line"
    with pytest.raises(ValidationError, match="on_reject"):
        GateConfig(on_reject="retrain")


def serving(requests: int, errors: int, s_per_token: float, spread: float = 0.001) -> dict:
    timed = requests - errors
    # sum and sum of squares of `timed` values alternating s_per_token +- spread
    vals = [s_per_token + (spread if k % 2 else -spread) for k in range(timed)]
    return {"requests": requests, "errors": errors, "timed": timed,
            "s_per_token": sum(vals), "s_per_token_sq": sum(v * v for v in vals)}


def test_a_candidate_with_more_server_errors_is_rolled_back_by_the_replicas_report():
    g = gate(canary_min_turns=20)
    to_canary(g, 1)
    assert g.serving_report({"candidate": serving(10, 9, 0.01),
                             "incumbent": serving(10, 0, 0.01)}) is None  # too few yet
    ev = g.serving_report({"candidate": serving(40, 8, 0.01), "incumbent": serving(40, 0, 0.01)})
    assert ev["event"] == "rolled_back" and "server errors 20.0% against 0.0%" in ev["reason"]
    assert g.incumbent == BASE and g.abandoned == {1}


def test_latency_and_error_noise_within_the_allowance_do_not_roll_back():
    g = gate(canary_min_turns=20)
    to_canary(g, 1)
    assert g.serving_report({"candidate": serving(100, 1, 0.012),
                             "incumbent": serving(100, 0, 0.010)}) is None  # 1.2x, 1%
    ev = g.serving_report({"candidate": serving(100, 0, 0.020),
                           "incumbent": serving(100, 0, 0.010)})
    assert ev["event"] == "rolled_back" and "2.00x > 1.5x" in ev["reason"]
    st = ev["evidence"]
    assert st["candidate"]["serving"]["requests"] == 100  # the evidence keeps the signals


def test_regenerated_turns_roll_a_candidate_back_at_its_look_and_feedback_is_reported():
    g = gate(canary_min_turns=20, canary_margin=1.0)  # the reward test alone would promote
    to_canary(g, 1)
    for k in range(20):
        g.observe(BASE, 0.0)
        g.observe(1, -1.0 if k % 2 else 0.0, status="regenerated" if k % 2 else "judged")
    ev = g.events[-1]
    assert ev["event"] == "rolled_back" and "regenerated 50.0% of turns against 0.0%" \
        in ev["reason"]
    g2 = gate(canary_min_turns=20)
    to_canary(g2, 1)
    for _ in range(20):
        g2.observe(BASE, 0.0)
        g2.observe(1, 1.0, status="feedback")
    assert g2.incumbent == 1
    st = g2.events[-1]["evidence"]
    assert st["candidate"]["feedback"] == 20 and st["candidate"]["feedback_mean"] == 1.0


def test_replica_tallies_merge_per_canary_and_ignore_other_canaries():
    from clawray.gate.core import ServingTally, merge_serving

    a, b = ServingTally(), ServingTally()
    a.add("canary-v1", "candidate", seconds=1.0, tokens=10)
    a.add("canary-v1", "incumbent", error=True)
    b.add("canary-v1", "candidate", seconds=2.0, tokens=10)
    b.add("canary-v2", "candidate", seconds=9.0, tokens=1)
    b.add("", "candidate", seconds=9.0, tokens=1)  # no canary: not counted
    m = merge_serving([a.snapshot(), b.snapshot()], "canary-v1")
    assert m["candidate"]["requests"] == 2 and m["candidate"]["timed"] == 2
    assert m["candidate"]["s_per_token"] == pytest.approx(0.3)
    assert m["incumbent"]["errors"] == 1 and m["incumbent"]["timed"] == 0
    for k in range(6):
        a.add(f"canary-v{k + 10}", "candidate")
    assert len(a.snapshot()) == ServingTally.KEPT


def test_every_decision_is_counted_in_the_gates_metrics():
    from clawray.gate.actor import GateMetrics

    class Metric:
        def __init__(self, kind, name, description, tag_keys):
            self.name, self.tag_keys, self.values = name, tag_keys, {}

        def inc(self, n, tags):
            key = tuple(tags[k] for k in self.tag_keys)
            self.values[key] = self.values.get(key, 0) + n

        def set(self, v, tags):
            self.values[tuple(tags[k] for k in self.tag_keys)] = v

    made = {}
    m = GateMetrics("app", lambda *a: made.setdefault(a[1], Metric(*a)))
    g = gate(canary_min_turns=20)
    to_canary(g, 1)
    g.observe(BASE, 1.0)
    m.record(g.events, g)
    assert made["clawray_gate_decisions_total"].values == {("app", "candidate"): 1,
                                                          ("app", "canary"): 1}
    assert made["clawray_gate_candidate"].values == {("app",): 1}
    assert made["clawray_gate_canary_turns"].values == {("app", "candidate"): 0,
                                                       ("app", "incumbent"): 1}
    g.reject("bad")
    m.record(g.events[-1:], g)
    assert made["clawray_gate_decisions_total"].values[("app", "rejected")] == 1
    assert made["clawray_gate_candidate"].values == {("app",): -1}
    assert made["clawray_gate_incumbent"].values == {("app",): 0}
