"""``clawray env-demo``'s settings (seeds, ``--set`` overrides) and its plot; the run itself
takes ~14 min on 2 cores (its measured numbers: docs/environments.md)."""

from __future__ import annotations

import pytest

from clawray.config import ClawRayConfig, ConfigError
from clawray.apps.env_demo import env_demo_config, plot_env_progress


def test_seed_seeds_the_run_and_sft_seed_the_warm_start(tmp_path):
    c = env_demo_config(ClawRayConfig(), tmp_path, seed=2)
    assert (c.environments_cfg.seed, c.training_cfg.seed, c.sft_cfg.seed) == (2, 2, 2)
    c = env_demo_config(ClawRayConfig(), tmp_path, seed=2, sft_seed=0)
    assert (c.environments_cfg.seed, c.training_cfg.seed, c.sft_cfg.seed) == (2, 2, 0)
    assert c.buffer_cfg.path == str(tmp_path / "samples")
    e = c.environments_cfg  # chosen on the validation pool (docs/environments.md)
    assert (e.negative_scale, e.episode_weight, e.step_weight) == (1.0, 0.0, 1.0)


def test_sets_override_the_demo_settings_last(tmp_path):
    c = env_demo_config(ClawRayConfig(), tmp_path, sets=[
        "curriculum.sampler=uniform", "curriculum.sampler_kwargs={}", "training.lr=2e-4",
        "environments.negative_scale=0"])
    assert c.curriculum_cfg.sampler == "uniform" and c.curriculum_cfg.sampler_kwargs == {}
    assert c.training_cfg.lr == pytest.approx(2e-4)
    assert c.environments_cfg.negative_scale == 0.0
    assert c.environments_cfg.family == "household"  # the rest stays the demo's
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE"):
        env_demo_config(ClawRayConfig(), tmp_path, sets=["training.lr"])
    with pytest.raises(ConfigError):
        env_demo_config(ClawRayConfig(), tmp_path, sets=["training.lr=fast"])


def test_progress_plot_draws_evals_training_and_the_curriculum(tmp_path):
    summary = {"evals": [{"iteration": 0, "success": 0.2, "n": 200},
                         {"iteration": 10, "success": 0.3, "n": 200}],
               "train": [{"iteration": i, "env_success": 0.25} for i in range(1, 11)],
               "curriculum": {"trajectory": [[64, 0.15, 0.2], [128, 0.16, 0.3]]},
               "sampler": "uniform"}
    plot_env_progress(summary, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def summary(seed: int, curve: list[float]) -> dict:
    evals = [{"iteration": 10 * i, "success": s, "n": 200} for i, s in enumerate(curve)]
    return {"seed": seed, "evals": evals, "before": evals[0], "after": evals[-1]}


def test_seeds_are_summarized_by_their_rises_and_plotted(tmp_path):
    from clawray.apps.env_demo import aggregate_seeds, plot_seeds

    agg = aggregate_seeds([summary(0, [0.2, 0.3]), summary(1, [0.2, 0.25, 0.1]),
                           summary(2, [0.3, 0.4])])
    assert [p["rise"] for p in agg["seeds"]] == pytest.approx([0.1, -0.1, 0.1])
    assert agg["rise"]["mean"] == pytest.approx(0.1 / 3) and agg["rise"]["min"] == -0.1
    assert agg["rose_in"] == 2 and agg["runs"] == 3
    assert agg["before"]["mean"] == pytest.approx(0.7 / 3)
    # sample std of (0.1, -0.1, 0.1) is 0.11547; over sqrt(3) seeds
    assert agg["rise_stderr"] == pytest.approx(0.11547 / 3 ** 0.5, rel=1e-3)
    assert agg["seeds"][1]["curve"] == [[0, 0.2], [10, 0.25], [20, 0.1]]
    plot_seeds(agg, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 10_000


def test_every_held_out_evaluation_goes_to_the_ledger_with_its_iteration(tmp_path,
                                                                         monkeypatch):
    from clawray import ledger
    from clawray.apps.env_demo import ledger_lines

    path = tmp_path / "ledger.jsonl"
    monkeypatch.setenv(ledger.LEDGER_ENV, str(path))
    s = {**summary(1, [0.2, 0.25, 0.35]), "eval_pool": "validation", "iterations": 20,
         "sft_seed": 0, "sets": []}
    ledger.record_lines(ledger_lines(s))
    lines = ledger.read(path)
    got = {x["metric"]: (round(x["value"], 9), x["iteration"], x["n"]) for x in lines}
    assert got == {"success_before": (0.2, 0, 200), "success_after": (0.35, 20, 200),
                   "success_change": (0.15, 20, 200), "success_iter10": (0.25, 10, 200)}
    assert {(x["experiment"], x["arm"], x["seed"], x["pool"], x["sft_seed"])
            for x in lines} == {("env-demo", "default", 1, "validation", 0)}
    # a later warm-start recipe's runs go to an experiment of their own
    assert {x["experiment"] for x in ledger_lines({**s, "warm_start": 2})} == {"env-demo-warm2"}
    s["sets"] = ["environments.step_weight=0", "environments.episode_weight=1"]
    assert {x["arm"] for x in ledger_lines(s)} == {
        "environments.step_weight=0 environments.episode_weight=1"}
