"""``clawray rla-table`` (clawray/experiments/rla_table.py): the rows' settings, the summary over seeds
and the table, from hand-made run results (the runs themselves need minutes per step; their
numbers are in docs/rlanything.md)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from clawray import ledger
from clawray.config import ClawRayConfig
from clawray.experiments.rla_table import (FULL, ROWS, SMALL, plot_table, summarize,
                                           table_config, table_markdown)


def test_rows_switch_rm_cotraining_and_env_adaptation_and_share_the_rest(tmp_path):
    cfgs = {row: table_config(ClawRayConfig(), tmp_path, row, 3, "/p", "/rm") for row in ROWS}
    switches = {row: (c.rlanything_cfg.co_train_rm, c.rlanything_cfg.adapt_env)
                for row, c in cfgs.items()}
    assert switches == {"policy": (False, False), "policy+rm": (True, False),
                        "policy+rm+env": (True, True)}
    for row, c in cfgs.items():
        assert c.training_cfg.mode == "rlanything" and c.model_cfg.path == "/p"
        assert c.rlanything_cfg.rm_model_path == "/rm" and c.rlanything_cfg.rm_backend == "server"
        assert c.environments_cfg.seed == 3 and c.environments_cfg.family == "household"
        # Each row writes under its own folder: no row reads another's buffer or adapter.
        assert Path(c.buffer_cfg.path).parent == tmp_path / "seed3" / row.replace("+", "_")
    assert len({c.buffer_cfg.path for c in cfgs.values()}) == 3
    assert (c.rlanything_cfg.slots, c.environments_cfg.group_size) == (FULL.slots,
                                                                        FULL.group_size)
    small = table_config(ClawRayConfig(), tmp_path, "policy", 3, "/p", "/rm", SMALL)
    assert (small.rlanything_cfg.slots, small.environments_cfg.group_size) == (2, 4)
    assert (c.environments_cfg.num_runners, small.environments_cfg.num_runners) == (2, 1)
    with pytest.raises(ValueError, match="unknown row 'rm-only'"):
        table_config(ClawRayConfig(), tmp_path, "rm-only", 0, "/p", "/rm")
    assert c.rlanything_cfg.slots_per_step == 0  # every slot every step, as measured
    cycled = table_config(ClawRayConfig(), tmp_path, "policy", 3, "/p", "/rm",
                          dataclasses.replace(FULL, slots=36, slots_per_step=6))
    assert (cycled.rlanything_cfg.slots, cycled.rlanything_cfg.slots_per_step) == (36, 6)
    with pytest.raises(ValueError, match="slots_per_step"):
        table_config(ClawRayConfig(), tmp_path, "policy", 3, "/p", "/rm",
                     dataclasses.replace(FULL, slots=6, slots_per_step=7))


def run(success: tuple[float, float], rm: tuple[float, float], accepted: list[int]) -> dict:
    def m(s: float, a: float) -> dict:  # p+ = a, p- = a - 0.2: balanced a - 0.1
        return {"success": s, "rm": {"step_acc": a, "majority_acc": a + 0.05, "plus_acc": a,
                                     "minus_acc": a - 0.2}}
    return {"before": m(success[0], rm[0]), "after": m(success[1], rm[1]),
            "steps": [{"step": i + 1, "env_accepted": n} for i, n in enumerate(accepted)],
            "accepted_total": sum(accepted)}


def test_summary_gives_mean_spread_and_standard_error_over_seeds_and_a_table(tmp_path):
    runs = {"policy": {"0": run((0.2, 0.3), (0.7, 0.7), [0, 0]),
                       "1": run((0.2, 0.1), (0.7, 0.7), [0, 0])},
            "policy+rm+env": {"0": run((0.2, 0.4), (0.7, 0.8), [1, 2])}}
    s = summarize(runs, [0, 1], 2, 0.2, 10.0)
    p = s["rows"]["policy"]
    assert p["success_after"]["mean"] == pytest.approx(0.2)
    assert p["success_after"]["std"] == pytest.approx(0.1)  # population std of 0.3 and 0.1
    assert p["success_after"]["se"] == pytest.approx(0.1)  # sample std 0.1414 / sqrt(2)
    assert p["rm_balanced_acc_after"]["mean"] == pytest.approx(0.6)
    assert p["success_after"]["values"] == [0.3, 0.1] and p["seeds"] == ["0", "1"]
    e = s["rows"]["policy+rm+env"]
    assert e["accepted_rewrites"]["mean"] == 3 and e["success_after"]["n"] == 1
    assert e["rm_majority_acc_after"]["mean"] == pytest.approx(0.85)
    md = table_markdown(s)
    assert "| policy | 20.0 % ± 0.0 % | 20.0 % ± 10.0 % | 0.600 ± 0.000 | 0.600 ± 0.000 " \
        "| 0.700 ± 0.000 | 0.500 ± 0.000 |" in md
    assert "| policy+rm+env | 20.0 % | 40.0 % | 0.600 | 0.700 | 0.800 | 0.600 |" in md  # no ±
    # a summary written before balanced accuracy existed is re-summarized from its runs
    old = {**s, "rows": {k: {m: v for m, v in t.items() if "balanced" not in m}
                         for k, t in s["rows"].items()}}
    assert table_markdown(old) == md
    # Paired: change per seed, and each row against the policy row of the same seed.
    assert p["success_change"]["values"] == pytest.approx([0.1, -0.1])
    assert e["success_vs_policy"]["values"] == pytest.approx([0.1])  # seed 0: 0.4 - 0.3
    assert p["success_vs_policy"]["n"] == 0
    assert e["rm_balanced_change"]["mean"] == pytest.approx(0.1)
    assert "| policy+rm+env | 20.0 % | 10.0 % | 0.100 | - |" in md
    plot_table(s, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_theorem_1_table_gives_the_rms_mu_and_the_consistency_targets_agreement():
    """Per seed the mean over steps of the trained target's per-class agreement (a step
    without a class is left out), then mean and standard error over seeds; no table where no
    run measured it."""
    a, b = run((0.2, 0.3), (0.7, 0.8), [0, 0]), run((0.2, 0.1), (0.7, 0.6), [0, 0])
    a["steps"][0] |= {"trained_target_plus_acc": 0.2, "trained_target_minus_acc": 1.0,
                      "trained_target_balanced_acc": 0.6}
    a["steps"][1] |= {"trained_target_plus_acc": 0.4, "trained_target_minus_acc": 0.8,
                      "trained_target_balanced_acc": 0.6}
    b["steps"][0] |= {"trained_target_plus_acc": None, "trained_target_minus_acc": 0.9,
                      "trained_target_balanced_acc": None}
    s = summarize({"policy+rm": {"0": a, "1": b}}, [0, 1], 2, 0.0, 1.0)
    t = s["rows"]["policy+rm"]
    assert t["target_plus_acc"]["values"] == pytest.approx([0.3])  # seed 1 had no progress step
    assert t["target_minus_acc"]["values"] == pytest.approx([0.9, 0.9])
    assert t["rm_mu_before"]["mean"] == pytest.approx(1.2)  # p+ 0.7 + p- 0.5
    md = table_markdown(s)
    assert ("| policy+rm | 1.200 ± 0.000 | - | 0.300 | 0.900 ± 0.000 | 0.600 | 0.000 ± 0.100 "
            "| - |") in md
    assert "Theorem 1" not in table_markdown(summarize({"policy": {"0": run(
        (0.2, 0.3), (0.7, 0.7), [0])}}, [0], 1, 0.0, 1.0))


def test_theorem_1_against_the_outcome_is_paired_per_seed_and_in_the_table():
    """The RM against the trajectory outcome (Theorem 1's mu) on the held-out steps, before and
    after, paired per seed; a run without the measure (older results) leaves it out."""
    a, b = run((0.2, 0.3), (0.7, 0.8), [0, 0]), run((0.2, 0.1), (0.7, 0.6), [0, 0])
    a["before"]["rm_outcome"] = {"plus_acc": 0.6, "minus_acc": 0.8}  # mu 1.4, balanced 0.7
    a["after"]["rm_outcome"] = {"plus_acc": 0.8, "minus_acc": 0.8}  # balanced 0.8
    a["steps"][0]["rm_outcome_mu"], a["steps"][1]["rm_outcome_mu"] = 1.2, 1.4
    s = summarize({"policy+rm": {"0": a, "1": b}}, [0, 1], 2, 0.0, 1.0)
    t = s["rows"]["policy+rm"]
    assert t["rm_outcome_mu_before"]["values"] == pytest.approx([1.4])
    assert t["rm_outcome_balanced_acc_after"]["values"] == pytest.approx([0.8])
    assert t["rm_outcome_balanced_change"]["values"] == pytest.approx([0.1])
    assert t["rm_outcome_mu_batches"]["values"] == pytest.approx([1.3])
    md = table_markdown(s)
    assert "| policy+rm | 1.200 ± 0.000 | 1.400 | - | - | - | 0.000 ± 0.100 | 0.100 |" in md


def test_a_measure_nobody_could_take_is_a_dash_not_a_crash():
    none = {"success": 0.0, "rm": {"step_acc": None, "majority_acc": None, "plus_acc": None,
                                   "minus_acc": None}}
    runs = {"policy": {"0": {"before": none, "after": none, "steps": [], "accepted_total": 0}}}
    md = table_markdown(summarize(runs, [0], 0, 0.0, 0.0))
    assert "| policy | 0.0 % | 0.0 % | - | - | - | - | 0.000 |" in md


def test_parallel_rows_record_every_row_under_its_own_app_and_write_the_table(tmp_path,
                                                                             monkeypatch):
    """``run_table(parallel=True)`` with the rows' runs replaced by hand-made results (the real
    ones need a cluster and minutes): each row is run once, at once, in its own Serve app, and
    lands under its name in the summary and the files."""
    import contextlib
    import threading

    from clawray.experiments import rla_table as experiment

    started: dict[str, str] = {}
    barrier = threading.Barrier(len(ROWS), timeout=60)  # fails unless the rows run at once

    def fake_row(cfg, steps, tasks, contexts, before, log, t0):
        assert before is None and steps == SMALL.steps and len(tasks) == 2 * SMALL.eval_tasks
        started[cfg.training_cfg.app] = cfg.model_cfg.path
        barrier.wait()
        ok = 0.5 if cfg.rlanything_cfg.adapt_env else 0.25
        return run((0.2, ok), (0.6, 0.6), [0, 1 if cfg.rlanything_cfg.adapt_env else 0])

    monkeypatch.setenv(ledger.LEDGER_ENV, str(tmp_path / "ledger.jsonl"))
    monkeypatch.setattr(experiment, "warm_starts", lambda *a, **k: ("/p", "/rm"))
    monkeypatch.setattr(experiment, "cluster", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(experiment, "_run_row", fake_row)
    monkeypatch.setattr(experiment, "held_out_tasks", lambda cfg, n, seed, pool: list(range(n)))
    monkeypatch.setattr(experiment, "collect_steps", lambda *a: [])
    s = experiment.run_table(ClawRayConfig(), tmp_path, [0], scale=SMALL, parallel=True,
                             log=lambda m: None)
    assert sorted(started) == ["rla-table-policy", "rla-table-policy-rm",
                               "rla-table-policy-rm-env"]
    assert set(started.values()) == {"/p"}
    assert s["parallel"] and s["scale"]["slots"] == SMALL.slots
    assert s["rows"]["policy+rm+env"]["success_after"]["mean"] == 0.5
    assert s["rows"]["policy"]["accepted_rewrites"]["mean"] == 0
    saved = json.loads((tmp_path / "rla_table.json").read_text())
    assert list(saved["rows"]) == list(ROWS)
    assert "| policy+rm+env | 20.0 % | 50.0 % |" in (tmp_path / "rla_table.md").read_text()
    # each row measured its own "before": all its figures are on the ledger, under its name
    lines = ledger.read(tmp_path / "ledger.jsonl")
    assert {(x["experiment"], x["seed"], x["pool"]) for x in lines} == {
        ("rla-table-small-warm2", 0, "test")}
    after = {x["arm"]: x["value"] for x in lines if x["metric"] == "success_after"}
    assert after == {"policy": 0.25, "policy+rm": 0.25, "policy+rm+env": 0.5}
    assert sum(x["metric"] == "success_before" for x in lines) == 3


def table(runs: dict, **over) -> dict:
    """A result as ``run_table`` writes it, from hand-made runs."""
    s = summarize(runs, sorted({int(k) for r in runs.values() for k in r}), 2, 0.0, 5.0)
    return {**s, "policy": "/p", "rm": "/rm", "sft_seed": 0, "eval_pool": "test",
            "parallel": False, "scale": dataclasses.asdict(FULL), **over}


def test_merge_makes_one_table_of_rows_run_apart_and_pairs_them_per_seed(tmp_path):
    """The policy row run once, the RM rows later (``--rows``): one table, rows in the paper's
    order, each row against the policy row of its seed; the same run's times add up."""
    from clawray.experiments.rla_table import merge_tables

    policy = table({"policy": {"0": run((0.2, 0.3), (0.7, 0.7), [0]),
                               "1": run((0.1, 0.3), (0.6, 0.6), [0])}})
    rm_rows = table({"policy+rm+env": {"1": run((0.1, 0.5), (0.6, 0.7), [2]),
                                       "0": run((0.2, 0.4), (0.7, 0.8), [1])},
                     "policy+rm": {"0": run((0.2, 0.2), (0.7, 0.75), [0])}})
    s = merge_tables([rm_rows, policy])
    assert list(s["runs"]) == list(ROWS) and list(s["runs"]["policy+rm+env"]) == ["0", "1"]
    assert s["seeds"] == [0, 1] and s["seconds"] == 10.0 and s["merged_from"] == 2
    assert s["before_differs"] == [] and s["policy"] == "/p" and s["eval_pool"] == "test"
    env = s["rows"]["policy+rm+env"]
    assert env["success_vs_policy"]["values"] == pytest.approx([0.1, 0.2])
    assert s["rows"]["policy+rm"]["success_vs_policy"]["values"] == pytest.approx([-0.1])
    assert "Merged from 2 runs" in table_markdown(s)


def test_merge_refuses_results_that_are_not_one_table_and_shows_unequal_befores():
    from clawray.experiments.rla_table import merge_tables

    a = table({"policy": {"0": run((0.2, 0.3), (0.7, 0.7), [0])}})
    b = table({"policy+rm": {"0": run((0.2, 0.3), (0.7, 0.7), [0])}})
    with pytest.raises(ValueError, match="differs from result 1 in 'rm'"):
        merge_tables([a, {**b, "rm": "/other-rm"}])
    with pytest.raises(ValueError, match="differs from result 1 in 'scale'"):
        merge_tables([a, {**b, "scale": dataclasses.asdict(SMALL)}])
    with pytest.raises(ValueError, match="row 'policy', seed 0 appears in two results"):
        merge_tables([a, a])
    with pytest.raises(ValueError, match="at least two"):
        merge_tables([a])
    # Seeded "before" measurements should agree; where they do not, the table says so.
    c = table({"policy+rm": {"0": run((0.25, 0.3), (0.7, 0.7), [0])}})
    s = merge_tables([a, c])
    assert [d["seed"] for d in s["before_differs"]] == ["0"]
    assert "seed 0: the rows' before measurements differ (held-out success policy 0.2, " \
        "policy+rm 0.25)" in table_markdown(s)


def test_cli_merge_writes_the_table_and_a_bad_source_is_a_clear_error(tmp_path, capsys):
    from clawray.apps.cli import main

    for name, row in (("a", "policy"), ("b", "policy+rm")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rla_table.json").write_text(json.dumps(
            table({row: {"0": run((0.2, 0.3), (0.7, 0.7), [0])}})))
    out = tmp_path / "merged"
    assert main(["rla-table", "--merge", str(tmp_path / "a"), str(tmp_path / "b" /
                 "rla_table.json"), "--out", str(out)]) == 0
    assert list(json.loads((out / "rla_table.json").read_text())["runs"]) == ["policy",
                                                                              "policy+rm"]
    assert (out / "rla_table.png").read_bytes()[:4] == b"\x89PNG"
    assert "Merged from 2 runs" in (out / "rla_table.md").read_text()
    capsys.readouterr()
    assert main(["rla-table", "--merge", str(tmp_path / "a"), str(tmp_path / "nothing"),
                 "--out", str(out)]) != 0
    assert f"--merge: no rla_table.json at {tmp_path / 'nothing'}" in capsys.readouterr().err


def test_per_seed_lines_give_rollouts_rm_rows_rewrites_and_both_rm_labels():
    r = run((0.185, 0.17), (0.8, 0.9), [1, 2])
    r["steps"][0] |= {"rla_success": 0.1, "rla_rm_rows": 60, "env_proposed": 4}
    r["steps"][1] |= {"rla_success": 0.3, "rla_rm_rows": 30, "env_proposed": 5}
    r["before"]["rm_outcome"] = {"plus_acc": 0.6, "minus_acc": 0.8}
    md = table_markdown(summarize({"policy+rm+env": {"2": r}}, [2], 2, 0.0, 1.0))
    # p+ = a, p- = a - 0.2 (run's convention); no outcome measure after: a dash
    assert ("| policy+rm+env | 2 | 18.5 % → 17.0 % | 20.0 % | 90 | 3 of 9 "
            "| 0.700 (0.80, 0.60) → 0.800 (0.90, 0.70) | 0.700 (0.60, 0.80) → - |") in md


def test_rows_run_one_after_another_record_the_shared_before_once(tmp_path, monkeypatch):
    """Sequential rows share the first row's "before": only that row records it; the others
    record their after and changes paired with it, naming the row that measured it."""
    import contextlib

    from clawray.experiments import rla_table as experiment

    def fake_row(cfg, steps, tasks, contexts, before, log, t0):
        r = run((0.2, 0.5 if cfg.rlanything_cfg.co_train_rm else 0.3), (0.7, 0.8), [0])
        r["before"] = before or r["before"]
        for when in ("before", "after"):
            r[when]["episodes"], r[when]["rm"]["n_steps"] = 8, 40
        if not cfg.rlanything_cfg.co_train_rm:  # against the outcome: after only
            r["after"]["rm_outcome"] = {"plus_acc": 0.6, "minus_acc": 0.8, "n_steps": 30}
        if before is None:  # the first row: valid actions and the rule, from its own before
            r["before"]["rm_valid"] = {"plus_acc": 0.5, "minus_acc": 0.5, "n_steps": 12}
            r["before"]["rule"] = {"plus_acc": 1.0, "minus_acc": 0.8, "n_steps": 40}
            r["before"]["rule_valid"] = {"plus_acc": 1.0, "minus_acc": 0.0, "n_steps": 12}
        r["after"]["rm_valid"] = {"plus_acc": 0.9, "minus_acc": 0.5, "n_steps": 12}
        return r

    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(ledger.LEDGER_ENV, str(path))
    monkeypatch.setattr(experiment, "warm_starts", lambda *a, **k: ("/p", "/rm"))
    monkeypatch.setattr(experiment, "cluster", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(experiment, "_run_row", fake_row)
    monkeypatch.setattr(experiment, "held_out_tasks", lambda cfg, n, seed, pool: list(range(n)))
    monkeypatch.setattr(experiment, "collect_steps", lambda *a: [])
    experiment.run_table(ClawRayConfig(), tmp_path, [4], ["policy", "policy+rm"],
                         scale=SMALL, log=lambda m: None, eval_pool="validation")
    got = {(x["arm"], x["metric"]): (round(x["value"], 9), x["n"], x.get("before_from"))
           for x in ledger.read(path)}
    assert got == {
        ("policy", "success_before"): (0.2, 8, None),
        ("policy", "success_after"): (0.3, 8, None),
        ("policy", "success_change"): (0.1, 8, None),
        ("policy", "rm_balanced_acc_before"): (0.6, 40, None),
        ("policy", "rm_balanced_acc_after"): (0.7, 40, None),
        ("policy", "rm_balanced_acc_change"): (0.1, 40, None),
        ("policy", "rm_plus_acc_before"): (0.7, 40, None),
        ("policy", "rm_minus_acc_before"): (0.5, 40, None),
        ("policy", "rm_plus_acc_after"): (0.8, 40, None),
        ("policy", "rm_minus_acc_after"): (0.6, 40, None),
        ("policy", "rm_outcome_balanced_acc_after"): (0.7, 30, None),
        ("policy", "rm_valid_balanced_acc_before"): (0.5, 12, None),
        ("policy", "rm_valid_balanced_acc_after"): (0.7, 12, None),
        ("policy", "rm_valid_balanced_acc_change"): (0.2, 12, None),
        ("policy", "rule_balanced_acc"): (0.9, 40, None),
        ("policy", "rule_valid_balanced_acc"): (0.5, 12, None),
        ("policy+rm", "rm_valid_balanced_acc_after"): (0.7, 12, "policy"),
        ("policy+rm", "rm_valid_balanced_acc_change"): (0.2, 12, "policy"),
        ("policy+rm", "success_after"): (0.5, 8, "policy"),
        ("policy+rm", "success_change"): (0.3, 8, "policy"),
        ("policy+rm", "rm_balanced_acc_after"): (0.7, 40, "policy"),
        ("policy+rm", "rm_balanced_acc_change"): (0.1, 40, "policy"),
        ("policy+rm", "rm_plus_acc_after"): (0.8, 40, "policy"),
        ("policy+rm", "rm_minus_acc_after"): (0.6, 40, "policy")}
    assert {(x["experiment"], x["seed"], x["pool"], x["steps"]) for x in ledger.read(path)} \
        == {("rla-table-small-warm2", 4, "validation", SMALL.steps)}


def test_the_experiment_names_the_scale_and_label_noise_so_runs_of_other_sizes_stay_apart():
    from clawray.experiments.rla_table import TINY, experiment_name

    def name(scale, noise=0.0):
        return experiment_name({"scale": dataclasses.asdict(scale), "rm_label_noise": noise})

    assert name(FULL) == "rla-table" and name(TINY) == "rla-table-tiny"
    assert name(dataclasses.replace(SMALL, steps=4)) == "rla-table-small-steps4"
    assert name(dataclasses.replace(FULL, eval_tasks=50), 0.2) == \
        "rla-table-eval_tasks50-noise0.2"
    # the policy warm start's recipe: the summaries before recipe 2 carry none
    assert experiment_name({"scale": dataclasses.asdict(FULL), "rm_label_noise": 0.0,
                            "warm_start": 2}) == "rla-table-warm2"


def test_the_rm_is_measured_on_valid_actions_and_beside_the_one_cue_rule(monkeypatch):
    """``measure`` scores the RM on valid actions only (the invalid-action cue gone) and the
    rule "-1 iff nothing happens" on all steps and on valid ones; the table pairs the RM's
    valid-action change per seed and shows the rule beside it."""
    from clawray.experiments import rla_table as experiment
    from clawray.rlanything.steps import StepContext

    def step(progress, valid, votes):
        obs = "You pick up the mug." if valid else "nothing happens."
        return StepContext("task", [], "act", obs, progress, valid, 0, None), votes

    steps = [step(True, True, [1, 1, 1]), step(True, True, [-1, -1, -1]),
             step(False, True, [-1, -1, 1]), step(False, True, [1, 1, 1]),
             step(False, False, [-1, -1, -1]), step(False, False, [-1, -1, -1])]

    class Scorer:
        def __init__(self, cfg, app):
            pass

        async def score_steps(self, contexts, seed):
            return [type("S", (), {"scores": votes})() for _, votes in steps]

    monkeypatch.setattr(experiment, "StepScorer", Scorer)
    monkeypatch.setattr(experiment, "held_out_success",
                        lambda trainer, cfg, tasks: {"success": 0.25, "stderr": 0.1, "n": 4})
    trainer = type("T", (), {"app": "a", "version": 3})()
    m = experiment.measure(trainer, ClawRayConfig(), [], [c for c, _ in steps])
    # valid actions: p+ 3 of 6 votes, p- 2 of 6 (one step -1,-1,+1, one +1,+1,+1)
    assert m["rm_valid"]["n_steps"] == 4
    assert (m["rm_valid"]["plus_acc"], m["rm_valid"]["minus_acc"]) == pytest.approx((0.5, 1 / 3))
    # all steps: p- adds the two invalid steps' six right votes: 8 of 12
    assert m["rm"]["minus_acc"] == pytest.approx(8 / 12)
    # the rule: +1 on every valid action, -1 on both invalid ones
    assert (m["rule"]["plus_acc"], m["rule"]["minus_acc"]) == (1.0, 0.5)
    assert (m["rule_valid"]["plus_acc"], m["rule_valid"]["minus_acc"]) == (1.0, 0.0)
    assert m["rule_valid"]["balanced_acc"] == 0.5

    a, b = run((0.2, 0.3), (0.7, 0.8), [0]), run((0.2, 0.1), (0.7, 0.6), [0])
    a["before"] |= {"rm_valid": {"plus_acc": 0.5, "minus_acc": 0.5}, "rule": m["rule"],
                    "rule_valid": m["rule_valid"]}
    a["after"]["rm_valid"] = {"plus_acc": 0.7, "minus_acc": 0.5}
    s = summarize({"policy+rm": {"0": a, "1": b}}, [0, 1], 1, 0.0, 1.0)
    t = s["rows"]["policy+rm"]
    assert t["rm_valid_balanced_change"]["values"] == pytest.approx([0.1])  # seed 1 has none
    assert t["rule_balanced_acc"]["values"] == pytest.approx([0.75])
    md = table_markdown(s)
    assert ("| policy+rm | 0.600 ± 0.000 | 0.600 ± 0.100 | 0.750 | 0.500 | 0.600 | 0.100 "
            "| 0.700 | 0.500 | 0.500 |") in md
    assert "valid actions" not in table_markdown(summarize({"policy": {"0": run(
        (0.2, 0.3), (0.7, 0.7), [0])}}, [0], 1, 0.0, 1.0))
