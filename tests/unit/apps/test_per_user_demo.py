"""``clawray demo --per-user`` without running it: both modes' settings are valid and differ
only in per-user training, every simulated user has a key of their own, and the seeds'
figures aggregate to means and standard errors per mode and group."""

from __future__ import annotations

import math

import pytest

from clawray.apps.per_user_demo import (GROUPS, MODES, aggregate, make_members,
                                        per_user_demo_config, plot)
from clawray.config import ClawRayConfig


def test_both_modes_are_valid_configs_that_differ_only_in_per_user_training(tmp_path):
    members = make_members(0, 2)
    keys = [k for _, _, k in members]
    assert [g for g, _, _ in members] == ["brief", "brief", "detailed", "detailed"]
    assert len(set(keys)) == 4 and len(set(make_members(0, 2)) & set(members)) == 0
    cfgs = {m: per_user_demo_config(ClawRayConfig(), tmp_path, 0, m, keys).check()
            for m in MODES}
    shared, per_user, control, hidden, frozen = (cfgs[m].to_dict() for m in MODES)
    assert frozen == per_user  # training off is per_user's settings; run_once trains nothing
    assert per_user["training"]["per_user"] and not shared["training"]["per_user"]
    for cfg in (shared, per_user):
        assert cfg["training"]["lora_rank"] > 0 and cfg["serving"]["api_keys"] == keys
        assert cfg["judge"]["control"] == "none"
    # the control: adapters per user, each turn judged on another turn's feedback
    assert control["training"]["per_user"] and control["judge"]["control"] == \
        "shuffled_feedback"
    # the second control: the judge reads the reaction without the reply
    assert hidden["training"]["per_user"] and hidden["judge"]["control"] == "reply_hidden"
    control["judge"]["control"] = hidden["judge"]["control"] = "none"
    assert control == per_user and hidden == per_user
    shared["training"]["per_user"] = True
    assert shared == per_user  # the same budget, learner, buffer and judge otherwise
    with pytest.raises(ValueError, match="unknown mode"):
        per_user_demo_config(ClawRayConfig(), tmp_path, 0, "both", keys)


def summary(seed: int, mode: str, before: dict, after: dict) -> dict:
    ev = lambda g: {"groups": g, "users": {}, "errors": 0}  # noqa: E731
    return {"seed": seed, "mode": mode, "budget": 100, "rows_trained": 100, "steps": 4,
            "eval_pool": "test", "eval_n_per_user": 60, "users_per_group": 2, "lr": 1e-3,
            "lora_rank": 8, "judge": "function", "before": ev(before), "after": ev(after),
            "curve": [{"step": 1, "rows_trained": 50, "live": {"brief": 0.4, "detailed": None}},
                      {"step": 2, "rows_trained": 100, "live": {"brief": 0.6, "detailed": 0.5}}],
            "user_errors": 0}


def test_seeds_aggregate_per_mode_and_group_with_standard_errors(tmp_path):
    runs = [summary(s, "per_user", {"brief": 0.4, "detailed": 0.6},
                    {"brief": 0.4 + r, "detailed": 0.7}) for s, r in enumerate((0.2, 0.3, 0.4))]
    runs.append(summary(0, "shared", {"brief": 0.4, "detailed": 0.6},
                        {"brief": 0.5, "detailed": 0.5}))
    agg = aggregate(runs)
    brief = agg["modes"]["per_user"]["groups"]["brief"]
    assert brief["rise"]["values"] == pytest.approx([0.2, 0.3, 0.4])
    assert brief["rise"]["mean"] == pytest.approx(0.3)
    assert brief["rise"]["stderr"] == pytest.approx(0.1 / math.sqrt(3))  # sd 0.1, n - 1
    assert agg["modes"]["shared"]["groups"]["detailed"]["rise"]["mean"] == pytest.approx(-0.1)
    assert agg["modes"]["shared"]["groups"]["detailed"]["rise"]["stderr"] is None  # one seed
    assert set(agg["modes"]["per_user"]["groups"]) == set(GROUPS)
    plot(agg, runs, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_each_group_of_each_mode_goes_to_the_ledger_before_after_and_change(tmp_path,
                                                                             monkeypatch):
    from clawray import ledger
    from clawray.apps.per_user_demo import ledger_lines

    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(ledger.LEDGER_ENV, str(path))
    users = {f"{g}-{i}": {"group": g, "n": 60} for g in GROUPS for i in range(2)}
    s = summary(3, "per_user", {"brief": 0.4, "detailed": 0.6}, {"brief": 0.7, "detailed": 0.5})
    s.update(judge="function clawray.judging.rules:heuristic_judge", kl_coef=1.0,
             eval_pool="validation")
    s["after"]["users"] = users
    ledger.record_lines(ledger_lines(s))
    lines = ledger.read(path)
    assert {(x["experiment"], x["arm"], x["seed"], x["pool"], x["n"]) for x in lines} == {
        ("per-user-demo", f"per_user/{g}", 3, "validation", 120) for g in GROUPS}
    got = {(x["arm"], x["metric"]): x["value"] for x in lines}
    assert got == pytest.approx({
        ("per_user/brief", "satisfaction_before"): 0.4,
        ("per_user/brief", "satisfaction_after"): 0.7,
        ("per_user/brief", "satisfaction_change"): 0.3,
        ("per_user/detailed", "satisfaction_before"): 0.6,
        ("per_user/detailed", "satisfaction_after"): 0.5,
        ("per_user/detailed", "satisfaction_change"): -0.1})
    assert len(lines) == 6 and lines[0]["budget"] == 100 and lines[0]["lr"] == 1e-3
    s.update(judge="server judge-sft (m=3, T=0.6)", mode="shared")
    assert {x["experiment"] for x in ledger_lines(s)} == {"per-user-demo-judge-model"}
    assert {x["arm"] for x in ledger_lines(s)} == {"shared/brief", "shared/detailed"}
    # a real model's runs are their own experiment, never later runs of the embedded model's
    s.update(model="smollm2-135m-instruct", real_model=True)
    assert {x["experiment"] for x in ledger_lines(s)} == {
        "per-user-demo-judge-model-smollm2-135m-instruct"}


def test_per_user_is_paired_by_seed_against_the_shared_policy_and_its_control(tmp_path):
    import json

    from clawray.apps.per_user_demo import combine

    rise = {"per_user": (0.2, 0.3, 0.25), "shared": (0.0, 0.1, -0.05),
            "per_user_shuffled": (0.0, 0.02, 0.01), "per_user_hidden": (0.1, 0.1, 0.1),
            "per_user_frozen": (0.0, 0.0, 0.01)}
    folders = []
    for k, mode in enumerate(MODES):  # each mode run on its own, as runs made one by one
        for seed, r in enumerate(rise[mode]):
            d = tmp_path / f"run{k}" / f"{mode}-seed{seed}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps(summary(
                seed, mode, {"brief": 0.1, "detailed": 0.8},
                {"brief": 0.1 + r, "detailed": 0.8})))
        folders.append(tmp_path / f"run{k}")
    agg = combine(folders, tmp_path / "all")
    vs_shared = agg["paired"]["per_user - shared"]["brief"]
    assert vs_shared["seeds"] == [0, 1, 2]
    assert vs_shared["difference"]["mean"] == pytest.approx(0.2333333)
    assert vs_shared["shown"] and vs_shared["p_value"] < 0.05
    vs_control = agg["paired"]["per_user - per_user_shuffled"]["brief"]
    assert vs_control["difference"]["mean"] == pytest.approx(0.24)
    vs_hidden = agg["paired"]["per_user - per_user_hidden"]["brief"]
    assert vs_hidden["difference"]["mean"] == pytest.approx(0.15)
    vs_frozen = agg["paired"]["per_user - per_user_frozen"]["brief"]
    assert vs_frozen["difference"]["mean"] == pytest.approx(0.2466667)
    # the detailed group did not move in any arm: no difference, nothing shown
    assert not agg["paired"]["per_user - shared"]["detailed"]["shown"]
    assert (tmp_path / "all" / "per_user.png").stat().st_size > 10_000
    # a seed met twice is refused (the first registered run is the one reported)
    with pytest.raises(ValueError, match="per_user seed 0 is also"):
        combine([folders[1], folders[1]], tmp_path / "twice")
    with pytest.raises(ValueError, match="no runs"):
        combine([tmp_path / "none"], tmp_path / "x")
