"""The live demo's multi-seed summary: per-seed rises and their mean ± standard error."""

from __future__ import annotations

import pytest


def summary(seed: int, before: float, after: float) -> dict:
    return {"seed": seed, "iterations": 40, "users": 8, "eval_pool": "test",
            "before": {"rate": before, "n": 150, "per_type": {"question": before}},
            "after": {"rate": after, "n": 150, "per_type": {"question": after}}}


def test_demo_seeds_aggregate_rises_with_standard_errors(tmp_path):
    from clawray.apps.demo import EVAL_POOL, aggregate_demo_seeds, plot_demo_seeds

    assert EVAL_POOL == "test"  # the demo reports on the held-out pool
    agg = aggregate_demo_seeds([summary(0, 0.4, 0.7), summary(1, 0.42, 0.32),
                                summary(2, 0.38, 0.68)])
    assert [p["rise"] for p in agg["seeds"]] == pytest.approx([0.3, -0.1, 0.3])
    assert agg["rise"]["mean"] == pytest.approx(0.5 / 3) and agg["rise"]["min"] == \
        pytest.approx(-0.1)
    # sample std of (0.3, -0.1, 0.3) is 0.23094; over sqrt(3) seeds
    assert agg["rise"]["stderr"] == pytest.approx(0.23094 / 3 ** 0.5, rel=1e-3)
    assert agg["before"]["mean"] == pytest.approx(0.4) and agg["rose_in"] == 2
    assert agg["eval_pool"] == "test" and agg["runs"] == 3
    plot_demo_seeds(agg, tmp_path / "d.png")
    assert (tmp_path / "d.png").stat().st_size > 10_000


def test_the_demo_judge_decides_how_its_users_word_their_reactions():
    from clawray.apps.demo import JUDGE, judge_description, users_phrasing, with_judge
    from clawray.config import ClawRayConfig

    heuristic = with_judge(ClawRayConfig(), "heuristic")
    assert JUDGE == "heuristic" and users_phrasing(heuristic) == "keywords"
    assert judge_description(heuristic).endswith("rules:heuristic_judge")
    served = ClawRayConfig().judge(backend="server", model_path="/models/judge")
    assert users_phrasing(served) == "users" and "/models/judge (m=3" in judge_description(served)
    with pytest.raises(ValueError, match="unknown demo judge 'oracle'"):
        with_judge(ClawRayConfig(), "oracle")


def test_a_real_models_judge_model_is_the_lora_recipe_of_judge_sft(monkeypatch, tmp_path):
    """``--judge model`` builds the judge from the policy's model: the embedded model by the
    full-weight recipe, a real model by LoRA (JUDGE_SFT_REAL), the key `clawray judge-sft`
    with those settings gives; the JudgeServer then serves the build."""
    from clawray.apps import demo
    from clawray.config import ClawRayConfig
    from clawray.sim import judge_sft
    from clawray.training.sft import SFTResult

    calls = []

    def fake(cfg, **kwargs):
        calls.append((cfg, kwargs))
        figures = {f: 0.5 for f in judge_sft.FIGURES}
        return SFTResult(tmp_path / "judge", True, {"test": {"judge": figures}})

    monkeypatch.setattr(judge_sft, "run_judge_sft", fake)
    real = demo.with_judge(ClawRayConfig().model(path="/models/smol"), "model", log=lambda m: None)
    embedded = demo.with_judge(ClawRayConfig(), "model", log=lambda m: None)
    (real_cfg, real_kw), (tiny_cfg, tiny_kw) = calls
    assert real_cfg.sft_cfg.lora_rank == 16 and real_cfg.sft_cfg.steps == 48
    assert real_kw["threads"] == 2 and real_kw["eval_engine"] == "vllm"
    assert tiny_cfg.sft_cfg.lora_rank == 0 and tiny_cfg.sft_cfg.steps == 400
    assert tiny_kw == {"n_train": 4000, "progress": True}
    assert real_cfg.model_cfg.path == "/models/smol"
    for cfg in (real, embedded):
        assert cfg.judge_cfg.backend == "server"
        assert cfg.judge_cfg.model_path == str(tmp_path / "judge")


def test_arms_are_compared_to_the_trained_one_seed_by_seed(tmp_path):
    from scipy import stats

    from clawray.apps.demo import aggregate_demo_seeds, compare_arms, plot_arms

    trained = aggregate_demo_seeds([summary(k, 0.4, 0.4 + r) for k, r in
                                    enumerate((0.30, 0.25, 0.40, 0.35, 0.20))])
    shuffled = aggregate_demo_seeds([summary(k, 0.4, 0.4 + r) for k, r in
                                     enumerate((0.02, -0.05, 0.04, 0.0, 0.01))])
    same = aggregate_demo_seeds([summary(k, 0.4, 0.4 + r) for k, r in
                                 enumerate((0.28, 0.30, 0.35, 0.30, 0.22))])
    c = compare_arms({"none": trained, "shuffled_feedback": shuffled, "no_training": same})
    want = stats.ttest_rel([0.30, 0.25, 0.40, 0.35, 0.20], [0.02, -0.05, 0.04, 0.0, 0.01])
    assert c["shuffled_feedback"]["p_value"] == pytest.approx(want.pvalue)
    assert c["shuffled_feedback"]["difference"]["mean"] == pytest.approx(0.296)
    assert c["shuffled_feedback"]["shown"] and not c["no_training"]["shown"]
    assert c["no_training"]["seeds"] == [0, 1, 2, 3, 4]
    # one seed: no test, nothing shown
    one = compare_arms({"none": aggregate_demo_seeds([summary(0, 0.4, 0.7)]),
                        "reply_hidden": aggregate_demo_seeds([summary(0, 0.4, 0.4)])})
    assert one["reply_hidden"]["p_value"] is None and not one["reply_hidden"]["shown"]
    plot_arms({"none": trained, "shuffled_feedback": shuffled}, tmp_path / "arms.png")
    assert (tmp_path / "arms.png").stat().st_size > 10_000


def test_run_learning_refuses_an_unknown_control_and_no_training_without_lockstep(tmp_path):
    from clawray.apps.demo import run_learning
    from clawray.config import ClawRayConfig

    for control, lockstep, match in (("swap", True, "unknown control 'swap'"),
                                     ("no_training", False, "needs lockstep")):
        with pytest.raises(ValueError, match=match):
            run_learning(ClawRayConfig(), "http://127.0.0.1:1/v1", "k", "m", tmp_path,
                         iterations=1, users=1, eval_n=1, seed=0, lockstep=lockstep,
                         control=control)


def test_a_real_model_gets_lora_its_own_rate_and_the_concise_preference(tmp_path):
    from clawray.apps.demo import REAL_MODEL, demo_config, is_real_model, run_defaults
    from clawray.config import ClawRayConfig
    from clawray.sim.preferences import get_preference

    tiny = demo_config(ClawRayConfig(), tmp_path)
    assert not is_real_model(tiny) and tiny.training_cfg.lora_rank == 0
    assert tiny.training_cfg.loss.kl_coef == 0.5 and run_defaults(tiny)["preference"] == "brief"
    real = demo_config(ClawRayConfig().copy_with(model={"path": "bundled:smollm2"}), tmp_path,
                       seed=3)
    t = real.training_cfg
    assert is_real_model(real) and (t.lora_rank, t.lr, t.loss.kl_coef, t.seed) == (16, 1e-3, 0.1, 3)
    assert real.inference_cfg.max_lora_rank >= t.lora_rank  # vLLM serves the adapters
    assert t.checkpoint_dir == str(tmp_path / "checkpoints")  # the demo's own settings stay
    defaults = run_defaults(real)
    assert defaults == {k: v for k, v in REAL_MODEL.items() if k != "config"}
    assert real.serving_cfg.default_max_tokens == defaults["max_tokens"] == 32
    concise = get_preference(defaults["preference"])
    assert concise.satisfied("The capital of France is Paris.")
    assert not concise.satisfied(" ".join(["word"] * 21))  # 21 words
    assert not concise.satisfied("x" * 141) and not concise.satisfied("!!! ???")


def test_a_judge_control_must_be_the_one_the_apps_voters_run(tmp_path):
    """The control acts in the app's voters, configured when the app started: run_learning
    refuses a config whose judge.control is not the arm's (it once changed only its own copy,
    and the "shuffled" arm was judged on its own feedback)."""
    from clawray.apps.demo import judge_control_of, run_learning
    from clawray.config import ClawRayConfig

    assert [judge_control_of(c) for c in ("none", "shuffled_feedback", "reply_hidden",
                                          "no_training")] == [
        "none", "shuffled_feedback", "reply_hidden", "none"]
    for control, cfg in (("shuffled_feedback", ClawRayConfig()),
                         ("none", ClawRayConfig().judge(control="reply_hidden"))):
        with pytest.raises(ValueError, match="needs the app started with judge.control"):
            run_learning(cfg, "http://127.0.0.1:1/v1", "k", "m", tmp_path, iterations=1,
                         users=1, eval_n=1, seed=0, lockstep=True, control=control)


@pytest.mark.parametrize("controls, after, code", [
    (("none",), 0.4, 1),  # the trained arm alone did not rise: the command fails
    (("none",), 0.6, 0),
    (("no_training",), 0.4, 0),  # a control alone that stayed flat: a finding, not a failure
    (("shuffled_feedback",), 0.6, 0),
])
def test_the_demo_seeds_exit_status_judges_only_the_trained_arm(monkeypatch, tmp_path, controls,
                                                                 after, code):
    import json

    from clawray.apps import demo
    from clawray.config import ClawRayConfig

    def fake_run(cfg, where, *, seed, control, **kw):
        where.mkdir(parents=True)
        (where / "summary.json").write_text(json.dumps(summary(seed, 0.4, after)))

    monkeypatch.setattr(demo, "run_demo", fake_run)
    assert demo.run_demo_seeds(ClawRayConfig(), tmp_path, [0, 1], controls=controls) == code


def test_the_demo_seeds_run_seed_major_and_leave_each_arms_aggregate_after_every_seed(
        monkeypatch, tmp_path):
    import json

    from clawray.apps import demo
    from clawray.config import ClawRayConfig

    order = []

    def fake_run(cfg, where, *, seed, control, **kw):
        order.append((seed, control))
        if (seed, control) == (1, "shuffled_feedback"):
            raise KeyboardInterrupt  # the run is cut here
        where.mkdir(parents=True)
        (where / "summary.json").write_text(json.dumps(summary(seed, 0.4, 0.6)))

    monkeypatch.setattr(demo, "run_demo", fake_run)
    with pytest.raises(KeyboardInterrupt):
        demo.run_demo_seeds(ClawRayConfig(), tmp_path, [0, 1, 2],
                            controls=("none", "shuffled_feedback"))
    assert order == [(0, "none"), (0, "shuffled_feedback"), (1, "none"),
                     (1, "shuffled_feedback")]
    # what was finished is aggregated: two seeds of the trained arm, one of the control
    assert json.loads((tmp_path / "none" / "demo_seeds.json").read_text())["runs"] == 2
    assert json.loads(
        (tmp_path / "shuffled_feedback" / "demo_seeds.json").read_text())["runs"] == 1
    # and the arms compared on the seed both finished
    arms = json.loads((tmp_path / "demo_arms.json").read_text())
    assert arms["compared"]["shuffled_feedback"]["seeds"] == [0]


def test_make_demos_one_seed_says_what_a_test_needs_instead_of_not_shown(monkeypatch, tmp_path,
                                                                        capsys):
    """``make demo`` runs one seed of two arms: the difference is printed, with what it takes
    to test it, not a verdict a single seed cannot give."""
    import json

    from clawray.apps import demo
    from clawray.config import ClawRayConfig

    def fake_run(cfg, where, *, seed, control, **kw):
        where.mkdir(parents=True)
        after = 0.78 if control == "none" else 0.38
        (where / "summary.json").write_text(json.dumps(summary(seed, 0.39, after)))

    monkeypatch.setattr(demo, "run_demo", fake_run)
    assert demo.run_demo_seeds(ClawRayConfig(), tmp_path, [0],
                               controls=("none", "shuffled_feedback")) == 0
    out = capsys.readouterr().out
    assert "clawray demo [none]: 1 seed on the held-out pool: 39.0% → 78.0%, rise +39.0%, " \
        "rose in 1 of 1" in out
    assert "trained − shuffled_feedback: +40.0% on seed 0; whether it is more than chance " \
        "needs a paired test over seeds (--seeds 0 1 2 3 4)" in out
    assert "NOT shown" not in out and "topic" not in out  # the embedded model: no topic check


def test_a_real_models_experiment_names_its_kl_weight_the_embedded_ones_do_not():
    from clawray.apps.demo import experiment_name
    from clawray.config import ClawRayConfig

    tiny = ClawRayConfig().training(loss={"kl_coef": 0.5})
    assert experiment_name(tiny, True, "brief", "clawray-tiny") == "demo-lockstep"
    assert experiment_name(tiny, False, "detailed", "clawray-tiny") == "demo-live-detailed"
    real = ClawRayConfig().model(path="bundled:smollm2")
    assert experiment_name(real, True, "concise", "smollm2-135m-instruct") == \
        "demo-lockstep-concise-smollm2-135m-instruct"  # no KL: the 2026-12-05 runs' name
    assert experiment_name(real.copy_with(training={"loss": {"kl_coef": 0.1}}), True,
                           "concise", "smollm2-135m-instruct") == \
        "demo-lockstep-concise-smollm2-135m-instruct-kl0.1"


def write_run(run, turns):
    """A run folder as ``run_learning`` leaves it: ``interactions.jsonl`` (whether each reply
    met its user's preference) and a sample-log segment (each turn's judge status and reward).
    ``turns``: (response id, satisfied, judge status, reward)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    (run / "samples").mkdir(parents=True)
    with open(run / "interactions.jsonl", "w") as f:
        for rid, met, _, _ in turns:
            f.write(json.dumps({"response_id": rid, "satisfied": met}) + "\n")
    pq.write_table(pa.table({"sample_id": [f"{rid}/rl" for rid, *_ in turns],
                             "kind": ["rl"] * len(turns),
                             "judge_status": [s for *_, s, _ in turns],
                             "reward": [r for *_, r in turns]}),
                   run / "samples" / "seg-000000000000.parquet")


def test_the_live_judges_rewards_are_scored_against_what_each_user_wanted(tmp_path):
    from clawray.apps.demo import live_judge_agreement

    assert live_judge_agreement(tmp_path) is None  # no sample log: nothing to say
    write_run(tmp_path, [("a", True, "judged", 1.0), ("b", True, "judged", 1.0),
                         ("c", True, "judged", 0.0),  # a neutral verdict misses on both sides
                         ("d", True, "judged", -1.0), ("e", False, "judged", -1.0),
                         ("f", False, "judged", 0.3333),  # a split vote above 0: a miss
                         ("g", False, "no_next_state", 0.0),  # not judged: left out
                         ("h", True, "no_next_state", 0.0)])
    got = live_judge_agreement(tmp_path)
    assert (got["n_plus"], got["n_minus"]) == (4, 2)
    assert got["p_plus"] == pytest.approx(0.5) and got["p_minus"] == pytest.approx(0.5)
    assert got["balanced"] == pytest.approx(0.5)


def test_one_sided_live_turns_have_no_balanced_accuracy(tmp_path):
    from clawray.apps.demo import live_judge_agreement

    write_run(tmp_path, [("a", True, "judged", 1.0), ("b", True, "judged", -1.0)])
    got = live_judge_agreement(tmp_path)
    assert got["p_plus"] == 0.5 and got["p_minus"] is None and got["balanced"] is None


def test_runs_made_one_by_one_combine_into_the_arms_compared_and_refuse_doubles(tmp_path):
    import json

    from clawray.apps.demo import combine_demo

    def run(folder, control, seed, after, pool="test"):
        where = folder / control / f"seed{seed}"
        # the trained arm's judge agrees with the users; the shuffled one's does not
        good = control == "none"
        write_run(where, [("a", True, "judged", 1.0 if good else -1.0),
                          ("b", False, "judged", -1.0)])
        s = {**summary(seed, 0.2, after), "control": control, "experiment": "demo-x",
             "judge": "server J", "eval_pool": pool}
        (where / "summary.json").write_text(json.dumps(s))

    first, second = tmp_path / "first", tmp_path / "second"
    for seed, (trained, shuffled) in enumerate(((0.8, 0.2), (0.7, 0.25))):
        run(first, "none", seed, trained)
        run(first, "shuffled_feedback", seed, shuffled)
    run(second, "shuffled_feedback", 2, 0.15)
    run(second, "none", 2, 0.9)
    out = tmp_path / "out"
    aggs = combine_demo([first, second], out)
    assert list(aggs) == ["none", "shuffled_feedback"]  # the trained arm first
    assert [p["seed"] for p in aggs["none"]["seeds"]] == [0, 1, 2]
    assert aggs["none"]["live_judge"]["mean"] == pytest.approx(1.0)
    assert aggs["shuffled_feedback"]["live_judge"]["mean"] == pytest.approx(0.5)
    arms = json.loads((out / "demo_arms.json").read_text())
    assert arms["compared"]["shuffled_feedback"]["seeds"] == [0, 1, 2]
    assert arms["compared"]["shuffled_feedback"]["difference"]["mean"] == pytest.approx(
        (0.6 + 0.45 + 0.75) / 3)
    assert (out / "none" / "demo_seeds.png").exists()
    # a seed and arm twice: the first registered run is the one reported, never a pick
    again = tmp_path / "again"
    run(again, "none", 1, 0.95)
    with pytest.raises(ValueError, match="none seed 1 is also"):
        combine_demo([first, again], tmp_path / "o2")
    # another pool is another result
    other = tmp_path / "other"
    run(other, "none", 5, 0.9, pool="validation")
    with pytest.raises(ValueError, match="combine runs of one setting"):
        combine_demo([first, other], tmp_path / "o3")
    with pytest.raises(ValueError, match="no runs"):
        combine_demo([tmp_path / "empty"], tmp_path / "o4")
