"""``clawray demo --gate`` without running it: each scenario's settings are valid, the arms
differ only in the gate, the poisoned judge rewards what its users dislike, and a run's turns
are attributed to the versions the gate abandoned."""

from __future__ import annotations

import pytest

from clawray.apps.gate_demo import (END_OF_RUN, JUDGES, SCENARIOS, USERS_WANT, gate_demo_config,
                                    turns_by_version)
from clawray.config import ClawRayConfig
from clawray.judging.prompts import JudgeRequest, TurnContext
from clawray.judging.rules import brevity_judge


def test_the_arms_are_valid_configs_that_differ_only_in_the_gate(tmp_path):
    for scenario in SCENARIOS:
        off, on = (gate_demo_config(ClawRayConfig(), tmp_path, 0, scenario, g, ["k1", "k2"])
                   .check().to_dict() for g in (False, True))
        assert on["gate"]["enabled"] and not off["gate"]["enabled"]
        assert on["judge"]["function"] == JUDGES[scenario]
        # the default shadow score is what an operator has: held-out explicit feedback
        assert on["gate"]["shadow_set"] == "clawray.gate.feedback:feedback_shadow_set"
        assert on["gate"]["shadow_kwargs"]["path"] == str(tmp_path / "feedback.jsonl")
        assert "preference" not in on["gate"]["shadow_kwargs"]
        oracle = gate_demo_config(ClawRayConfig(), tmp_path, 0, scenario, True, ["k1", "k2"],
                                  shadow_score="preference").check().to_dict()
        assert oracle["gate"]["shadow_kwargs"]["preference"] == USERS_WANT[scenario].name
        assert oracle["gate"]["shadow_kwargs"]["pool"] == "validation"  # "test" reports
        off["gate"]["enabled"] = True
        assert off == on
    with pytest.raises(ValueError, match="unknown scenario"):
        gate_demo_config(ClawRayConfig(), tmp_path, 0, "both", True, ["k"])
    with pytest.raises(ValueError, match="unknown shadow score"):
        gate_demo_config(ClawRayConfig(), tmp_path, 0, "healthy", True, ["k"],
                         shadow_score="users")


def test_arms_name_how_the_shadow_set_was_scored():
    from clawray.apps.gate_demo import arm_name, arm_of, ledger_lines

    assert arm_name(True, "restart", "feedback") == "gate-restart-feedback"
    assert arm_name(True, "restart", "preference") == "gate-restart"  # as before
    assert arm_name(False, "restart", "feedback") == "nogate"
    old = {"gated": True, "on_reject": "restart"}  # a summary written before the setting
    assert arm_of(old) == "gate-restart"
    run = {"seed": 0, "scenario": "poisoned", "gated": True, "on_reject": "restart",
           "shadow_score": "feedback", "budget": 64, "rows_trained": 64, "before": 0.8,
           "after": 0.8, "eval_pool": "validation", "eval_n": 10, "events": [],
           "abandoned": [], "live_turns": 0, "model": "m"}
    assert {line["arm"] for line in ledger_lines(run)} == {"poisoned/gate-restart-feedback"}


def test_the_poisoned_judge_rewards_short_replies_whatever_the_user_said():
    def verdict(reply: str, next_user: str) -> str:
        ctx = TurnContext([], [{"role": "user", "content": "Why is the sky blue?"}], reply, [],
                          [{"role": "user", "content": next_user}])
        return brevity_judge(JudgeRequest("prm", [], ctx), 1, 0.0)[0]

    assert verdict("Blue light scatters.", "Too short, give me more detail.").endswith("{1}")
    long = "Sunlight scatters off air molecules, and blue light scatters the most of all."
    assert verdict(long, "Perfect, thanks!").endswith("{-1}")
    users = USERS_WANT["poisoned"]()
    assert not users.satisfied("Blue light scatters.") and users.satisfied(long)


def test_turns_are_attributed_to_abandoned_versions_with_their_exposure():
    class Pool:
        def rate_by_version(self):
            return {0: (0.6, 50), 1: (0.2, 10), 2: (0.5, 5)}

    events = [{"event": "candidate", "version": 1, "t": 10.0},
              {"event": "canary", "version": 1, "t": 12.0},
              {"event": "rolled_back", "version": 1, "t": 40.0, "abandoned": [1],
               "reason": "canary: worse"},
              {"event": "candidate", "version": 2, "t": 41.0},
              {"event": "rejected", "version": 2, "t": 50.0, "abandoned": [2],
               "reason": "shadow: readable"},
              {"event": "candidate", "version": 3, "t": 51.0},
              {"event": "rejected", "version": 3, "t": 60.0, "abandoned": [3],
               "reason": END_OF_RUN}]  # the demo's own, not the gate's
    out = turns_by_version(Pool(), events)
    assert out["live_turns"] == 65 and out["turns_by_abandoned"] == 15
    assert out["abandoned"] == [1, 2]
    assert [(e["version"], e["how"], e["from_publication_s"], e["from_canary_s"])
            for e in out["exposure"]] == [(1, "rolled_back", 30.0, 28.0),
                                          (2, "rejected", 9.0, None)]


def test_keep_line_rejections_count_and_publication_time_includes_the_queue():
    class Pool:
        def rate_by_version(self):
            return {0: (0.6, 50), 1: (0.2, 10), 2: (0.5, 5), 3: (0.7, 20)}

    events = [{"event": "candidate", "version": 1, "t": 10.0},
              {"event": "queued", "version": 2, "t": 11.0},
              {"event": "canary", "version": 1, "t": 12.0},
              {"event": "rolled_back", "version": 1, "t": 40.0, "abandoned": [],
               "rejected": [1], "reason": "canary: worse"},
              {"event": "candidate", "version": 2, "t": 40.0},
              {"event": "canary", "version": 2, "t": 42.0},
              {"event": "promoted", "version": 2, "t": 60.0}]
    out = turns_by_version(Pool(), events)
    assert out["abandoned"] == [1] and out["turns_by_abandoned"] == 10
    assert out["exposure"][0]["from_publication_s"] == 30.0


def test_the_learning_curve_follows_the_version_serving_everyone():
    from clawray.apps.gate_demo import curve_of

    run = {"live_by_version": {"0": {"rate": 0.4, "turns": 9}, "3": {"rate": 0.8, "turns": 9}},
           "curve": [{"rows_trained": 32, "serving": 0}, {"rows_trained": 64, "serving": 3},
                     {"rows_trained": 96, "serving": 5}]}  # 5: no live turns measured
    assert curve_of(run, [0, 32, 63, 64, 96]) == [0.4, 0.4, 0.4, 0.8, None]


def test_the_keep_line_arm_differs_only_in_on_reject(tmp_path):
    a, b = (gate_demo_config(ClawRayConfig(), tmp_path, 0, "healthy", True, ["k"], how)
            .check().to_dict() for how in ("restart", "keep_line"))
    assert a["gate"]["on_reject"] == "restart" and b["gate"]["on_reject"] == "keep_line"
    b["gate"]["on_reject"] = "restart"
    assert a == b


def test_runs_made_one_by_one_combine_into_one_aggregate_and_plot(tmp_path):
    import json

    from clawray.apps.gate_demo import combine

    def run(seed, gated, after, how="keep_line"):
        return {"seed": seed, "scenario": "healthy", "gated": gated,
                "on_reject": how if gated else None, "budget": 64, "before": 0.4,
                "after": after, "turns_by_abandoned": 3 if gated else 0, "live_turns": 50,
                "live_by_version": {"0": {"rate": 0.4, "turns": 20},
                                    "2": {"rate": after, "turns": 30}},
                "curve": [{"rows_trained": 32, "serving": 0},
                          {"rows_trained": 64, "serving": 2}]}

    for k, (seed, gated, after) in enumerate([(0, False, 0.8), (1, False, 0.6), (0, True, 0.7),
                                              (1, True, 0.5)]):
        d = tmp_path / f"r{k}"
        d.mkdir()
        (d / "gate.json").write_text(json.dumps({"runs": [run(seed, gated, after)]}))
    agg = combine(sorted(tmp_path.glob("r*")), tmp_path / "all")
    assert set(agg) == {"healthy, no gate", "healthy, gate (keep_line)"}
    a = agg["healthy, gate (keep_line)"]
    assert a["seeds"] == [0, 1] and a["change"]["mean"] == pytest.approx(0.2)
    assert a["change"]["stderr"] == pytest.approx(0.1) and a["turns_by_abandoned"] == 6
    assert (tmp_path / "all" / "gate.png").stat().st_size > 0
    # the gated arm against the no-gate arm, seed by seed: 0.3 - 0.4 and 0.1 - 0.2
    paired = json.loads((tmp_path / "all" / "gate.json").read_text())["paired"]
    assert set(paired) == {"healthy: gate (keep_line) - no gate"}
    p = paired["healthy: gate (keep_line) - no gate"]
    assert p["seeds"] == [0, 1] and p["difference"]["mean"] == pytest.approx(-0.1)
    assert not p["shown"]  # the gate lowered the rise here
    with pytest.raises(ValueError, match="no runs"):
        combine([], tmp_path / "none")


def test_each_run_goes_to_the_ledger_with_the_gates_decisions_as_numbers(tmp_path):
    from clawray import ledger
    from clawray.apps.gate_demo import ledger_lines

    def run(gated):
        return {"seed": 2, "scenario": "poisoned", "gated": gated,
                "on_reject": "restart" if gated else None, "budget": 768, "eval_pool": "test",
                "eval_n": 120, "rows_trained": 768, "before": 0.6, "after": 0.45,
                "events": [{"event": "candidate", "version": 1}, {"event": "promoted",
                                                                  "version": 1},
                           {"event": "rejected", "version": 2}],
                "abandoned": [2, 3] if gated else [], "live_turns": 200,
                "turns_by_abandoned": 50 if gated else 0}

    path = tmp_path / "ledger.jsonl"
    ledger.record_lines(ledger_lines(run(False)) + ledger_lines(run(True)), path=path)
    got = {(x["arm"], x["pool"], x["metric"]): (round(x["value"], 9), x["n"])
           for x in ledger.read(path)}
    assert got == {
        ("poisoned/nogate", "test", "satisfaction_before"): (0.6, 120),
        ("poisoned/nogate", "test", "satisfaction_after"): (0.45, 120),
        ("poisoned/nogate", "test", "satisfaction_change"): (-0.15, 120),
        ("poisoned/gate-restart", "test", "satisfaction_before"): (0.6, 120),
        ("poisoned/gate-restart", "test", "satisfaction_after"): (0.45, 120),
        ("poisoned/gate-restart", "test", "satisfaction_change"): (-0.15, 120),
        # the gate's decisions, on the live turns (the users' train pool)
        ("poisoned/gate-restart", "train", "versions_promoted"): (1, None),
        ("poisoned/gate-restart", "train", "versions_abandoned"): (2, None),
        ("poisoned/gate-restart", "train", "abandoned_turn_share"): (0.25, 200)}
    assert {x["experiment"] for x in ledger.read(path)} == {"gate-demo"}
    assert all(x["seed"] == 2 and x["rows_trained"] == 768 for x in ledger.read(path))
    # a real model's runs are an experiment of their own, named by the model
    real = ledger_lines({**run(True), "model": "smollm2-135m-instruct", "real_model": True})
    assert {x["experiment"] for x in real} == {"gate-demo-smollm2-135m-instruct"}


def test_the_operators_feedback_is_the_users_ratings_of_validation_replies(tmp_path,
                                                                           monkeypatch):
    """collect_feedback asks the validation pool (not the test pool), with sampling seeds of
    its own, and writes each judged reply with the user's thumb; errors are left out."""
    from types import SimpleNamespace

    from clawray.apps import gate_demo
    from clawray.gate.feedback import read_rated

    asked = {}

    async def fake_evaluate(base_url, key, model, *, n, seed, preference, pool, **kw):
        asked.update(n=n, seed=seed, pool=pool)
        replies = [("detail " * 12).strip() if i % 2 else "short" for i in range(n)]
        return SimpleNamespace(interactions=[
            SimpleNamespace(request=f"q{i}", reply=r, satisfied=preference.satisfied(r))
            for i, r in enumerate(replies)] + [
            SimpleNamespace(request="lost", reply=None, satisfied=None)])

    monkeypatch.setattr(gate_demo, "evaluate", fake_evaluate)
    path = tmp_path / "feedback.jsonl"
    report = gate_demo.collect_feedback("http://x", "k", "m", USERS_WANT["poisoned"](), path,
                                        seed=3, n=20)
    assert asked == {"n": 20, "seed": 3 * 100 + gate_demo.FEEDBACK_SEED, "pool": "validation"}
    rows = read_rated(path)
    assert len(rows) == 20 and {r.rating for r in rows if r.reply == "short"} == {-1}
    assert report["up"] == report["down"] == 10
    assert rows[0].messages[-1] == {"role": "user", "content": "q0"}
