r"""``clawray rm-sft``: oracle-labelled step-RM rows, token-exact with the JudgeServer, a cached
warm-started RM, and its step accuracy."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from clawray.config import ClawRayConfig
from clawray.envs import make_family
from clawray.envs.rollout import play_episode
from clawray.inference.engine import SamplingParams
from clawray.models.chat_template import IM_END
from clawray.rlanything.steps import step_contexts, step_rm_request

from tests.support.env_policies import expert_policy, scripted


@pytest.fixture(scope="module")
def mixed_contexts(tiny_tokenizer):
    """Steps of two household tasks: the expert's (progress) and a policy that only says an
    invalid action (no progress)."""
    family = make_family("household")
    out = []
    for seed in (5, 6):
        task = family.generate([0.3] * 4, seed=seed)
        out += step_contexts(asyncio.run(play_episode(
            family, task, expert_policy(family, task, tiny_tokenizer), tiny_tokenizer,
            SamplingParams(max_tokens=48), history_window=0)))
        bad = scripted(tiny_tokenizer, lambda _p: "jump over the moon")
        out += step_contexts(asyncio.run(play_episode(
            family, task, bad, tiny_tokenizer, SamplingParams(max_tokens=8), max_steps=4,
            history_window=0)))
    assert 0 < sum(c.progress for c in out) < len(out)
    return out


def test_rows_are_the_judge_servers_prompt_and_the_oracle_verdict(mixed_contexts,
                                                                  tiny_tokenizer):
    from clawray.inference.fixed_latency import FixedLatencyEngine
    from clawray.serve.judge_server import JudgeCore
    from clawray.training.rm_sft import rm_sft_rows

    judge = JudgeCore(ClawRayConfig(), engine=FixedLatencyEngine(max_model_len=32768),
                      tokenizer=tiny_tokenizer)
    rows = rm_sft_rows(mixed_contexts, tiny_tokenizer, history_window=0)
    assert len(rows) == len(mixed_contexts)  # 8 progress vs 8 no-progress: nothing dropped
    end = tiny_tokenizer.convert_tokens_to_ids(IM_END)
    for ctx, row in zip(mixed_contexts, rows):
        assert row["kind"] == "sft"
        assert row["prompt_ids"] == judge.template(step_rm_request(ctx, 0).messages)
        assert row["response_ids"][-1] == end and sum(row["loss_mask"]) == len(
            row["response_ids"])
        want = "\\boxed{1}" if ctx.progress else "\\boxed{-1}"
        assert tiny_tokenizer.decode(row["response_ids"][:-1]) == want


def test_the_majority_class_is_cut_to_twice_the_minority(mixed_contexts, tiny_tokenizer):
    from clawray.training.rm_sft import rm_sft_rows

    plus = [c for c in mixed_contexts if c.progress][:3]
    minus = [dataclasses.replace(c, step=100 + i)
             for i, c in enumerate([c for c in mixed_contexts if not c.progress] * 3)]
    rows = rm_sft_rows(plus + minus, tiny_tokenizer, 0, seed=1)
    labels = [r["reward"] for r in rows]
    assert labels.count(1.0) == 3 and labels.count(-1.0) == 6
    assert [r["sample_id"] for r in rows] == sorted(
        (r["sample_id"] for r in rows), key=lambda s: int(s.split("/")[1]))  # input order
    again = rm_sft_rows(plus + minus, tiny_tokenizer, 0, seed=1)  # seeded subsample
    assert [r["sample_id"] for r in again] == [r["sample_id"] for r in rows]
    with pytest.raises(ValueError, match="progress and no-progress"):
        rm_sft_rows(plus, tiny_tokenizer, 0)


def test_label_noise_flips_about_that_share_of_verdicts(mixed_contexts, tiny_tokenizer):
    from clawray.training.rm_sft import rm_sft_rows

    many = mixed_contexts * 20
    clean = rm_sft_rows(many, tiny_tokenizer, 0)
    noisy = rm_sft_rows(many, tiny_tokenizer, 0, label_noise=0.25, seed=3)
    assert [r["prompt_ids"] for r in clean] == [r["prompt_ids"] for r in noisy]
    flipped = sum(a["reward"] != b["reward"] for a, b in zip(clean, noisy)) / len(clean)
    assert 0.17 < flipped < 0.33  # 320 rows: ±3.5 sd of a 0.25 share
    for r in noisy:  # a flipped row is a consistent wrong verdict
        want = "\\boxed{1}" if r["reward"] > 0 else "\\boxed{-1}"
        assert tiny_tokenizer.decode(r["response_ids"][:-1]) == want


def test_step_accuracy_counts_parseable_votes_majorities_and_ties():
    from clawray.training.evaluate import step_accuracy

    got = step_accuracy([True, False, True, False],
                        [[1, 1, -1], [None, None, None], [1, -1, None], [-1, -1, 1]])
    assert got["step_acc"] == pytest.approx(5 / 8)  # 5 right of 8 parseable
    assert got["majority_acc"] == pytest.approx(2 / 4)  # step 2 ties, step 1 has no vote
    assert got["unparseable"] == pytest.approx(4 / 12)
    assert got["plus_acc"] == pytest.approx(3 / 5) and got["minus_acc"] == pytest.approx(2 / 3)
    assert got["balanced_acc"] == pytest.approx((3 / 5 + 2 / 3) / 2)
    assert got["mu"] == pytest.approx(3 / 5 + 2 / 3)
    # an RM that always answers -1: plain accuracy is the majority's share, balanced 0.5
    always = step_accuracy([True, False, False], [[-1, -1], [-1, -1], [-1, -1]])
    assert always["step_acc"] == pytest.approx(2 / 3) and always["balanced_acc"] == 0.5
    assert got["n_steps"] == 4 and got["n_plus"] == 2


def test_the_rms_tasks_are_none_of_the_policys_sft_tasks_nor_the_held_out_ones():
    """The RM's warm start learns from tasks of a stream of their own: neither the policy's SFT
    tasks (where the policy plays like its expert) nor the tasks its accuracy is tested on."""
    from pathlib import Path

    from clawray.apps.env_demo import env_demo_config
    from clawray.envs.base import demo_tasks
    from clawray.training.rm_sft import EVAL_SEED_OFFSET, TASK_SEED_OFFSET

    cfg = env_demo_config(ClawRayConfig(), Path("."), 0)
    s, e = cfg.sft_cfg, cfg.environments_cfg
    family = make_family(e.family, **e.family_kwargs)

    def ids(n: int, seed: int) -> set[str]:
        return {t.task_id for t in demo_tasks(family, n, s.max_difficulty, seed)}

    policy = ids(s.tasks, s.seed)
    rm = ids(200, s.seed + TASK_SEED_OFFSET)
    held_out = ids(40, s.seed + EVAL_SEED_OFFSET)
    assert len(rm) == 200 and not rm & policy and not rm & held_out and not held_out & policy
    assert ids(200, s.seed) <= policy  # what recipe 1 did: the policy's first 200 tasks


@pytest.mark.parametrize("task_pools", [True, False])
def test_the_rms_train_validation_and_test_steps_come_from_disjoint_tasks(task_pools):
    """Recipe 5's three task sets: the train pool's (rows), the validation pool's (early
    stopping), the test pool's (reported); disjoint also where task pools are off (seeds)."""
    from clawray.envs.base import demo_tasks
    from clawray.training.rm_sft import EVAL_SEED_OFFSET, TASK_SEED_OFFSET, TEST_SEED_OFFSET
    from clawray.training.sft import pools

    cfg = ClawRayConfig().environments(family="household", task_pools=task_pools)
    e, seed = cfg.environments_cfg, cfg.sft_cfg.seed
    family = make_family(e.family, **e.family_kwargs)
    train_pool, validation_pool = pools(cfg)

    def ids(n: int, offset: int, pool: str | None) -> set[str]:
        return {t.task_id for t in demo_tasks(family, n, 0.3, seed + offset, pool)}

    train = ids(200, TASK_SEED_OFFSET, train_pool)
    validation = ids(60, EVAL_SEED_OFFSET, validation_pool)
    test = ids(60, TEST_SEED_OFFSET, e.pool("test"))
    assert len(train) == 200 and len(validation) == 60 and len(test) == 60
    assert not train & validation and not train & test and not validation & test


def _cfg(tmp_path):
    return (ClawRayConfig().inference(engine="hf")
            .environments(family="household", history_window=0, max_tokens=8, max_steps=4)
            .sft(steps=3, batch_size=4, lr=1e-3, eval_tasks=1, cache_dir=str(tmp_path / "sft"))
            .rlanything(m=2, max_tokens=8))


def test_rm_sft_trains_on_the_policys_steps_and_is_cached_by_setting(tmp_path,
                                                                     tiny_model_path):
    from clawray.models.loader import load_model
    from clawray.training.rm_sft import rm_sft_key, run_rm_sft
    from clawray.training.sft import INFO

    cfg = _cfg(tmp_path)
    first = run_rm_sft(cfg, tiny_model_path, progress=False, n_tasks=1, max_difficulty=0.2,
                       select_every=2, select_tasks=1)
    info = json.loads((first.path / INFO).read_text())
    assert not first.cached and info == first.info
    assert first.path.name == f"rm-sft-{info['key']}"
    assert info["nll_last"] < info["nll_first"]
    # Stopped early on validation steps (rated at steps 2 and 3), reported on the test pool.
    assert [c["step"] for c in info["selection"]] == [2, 3] and info["validation_steps"] > 0
    best = max(info["selection"], key=lambda c: c["score"])
    assert info["selected_step"] == best["step"] and info["eval_pool"] == "test"
    assert ("rm_last" in info) == (info["selected_step"] != 3)
    # The tiny policy never makes progress: the expert's actions at its states were added.
    plus = info["progress_steps"]
    assert plus > 0 and 2 * plus >= info["steps_collected"] - plus
    for when in ("rm_before", "rm_after"):
        got = info[when]
        assert got["n_steps"] > 0 and 0.0 <= got["unparseable"] <= 1.0
        assert 0.0 <= got["majority_acc"] <= 1.0
    base = load_model(tiny_model_path).state_dict()
    assert any(not (p == base[n]).all() for n, p in load_model(first.path).state_dict().items())

    again = run_rm_sft(cfg, tiny_model_path, progress=False, n_tasks=1, max_difficulty=0.2,
                       select_every=2, select_tasks=1)
    assert again.cached and again.path == first.path and again.info == info
    # Every setting that changes the weights changes the entry (the eval protocol does not).
    settings = {"n_tasks": 1, "max_difficulty": 0.2, "label_noise": 0.0, "select_every": 2,
                "select_tasks": 1}
    key = rm_sft_key(tiny_model_path, tiny_model_path, cfg, settings)
    assert key == info["key"]
    assert rm_sft_key(tiny_model_path, tiny_model_path, cfg.sft(eval_tasks=9).rlanything(m=5),
                      settings) == key
    changed = [rm_sft_key(tiny_model_path, tiny_model_path, cfg, {**settings, **s})
               for s in ({"n_tasks": 2}, {"max_difficulty": 0.3}, {"label_noise": 0.1},
                         {"select_every": 3}, {"select_tasks": 2})]
    changed.append(rm_sft_key(tiny_model_path, tiny_model_path, cfg.rlanything(temperature=0.5),
                              settings))  # the temperature the selection rates votes at
    changed += [rm_sft_key(tiny_model_path, tiny_model_path, c, settings)
                for c in (_cfg(tmp_path).sft(steps=4), _cfg(tmp_path).environments(
                    temperature=0.5))]
    changed.append(rm_sft_key(tiny_model_path, first.path, cfg, settings))  # another policy
    assert len({key, *changed}) == len(changed) + 1
    with pytest.raises(ValueError, match="needs validation tasks"):
        run_rm_sft(cfg, tiny_model_path, progress=False, n_tasks=1, select_tasks=0)


def test_run_sft_saves_through_the_shared_cache_writer(tmp_path, tiny_model_path,
                                                       monkeypatch):
    import clawray.training.sft as sft
    from clawray.models.loader import load_model

    calls = []
    real = sft.save_result
    monkeypatch.setattr(sft, "train_sft", lambda base, cfg, rows, progress, select=None: {
        "model": load_model(base), "nll": [2.0, 1.0]})
    monkeypatch.setattr(sft, "save_result",
                        lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    cfg = _cfg(tmp_path).sft(tasks=2, eval_tasks=0)
    result = sft.run_sft(cfg, progress=False)
    assert calls == [result.path] and result.path.name.startswith("sft-")
    assert json.loads((result.path / sft.INFO).read_text())["rows"] == result.info["rows"]
    assert not [p for p in result.path.parent.iterdir() if p.name.startswith(".")]  # no temp
    assert sft.run_sft(cfg, progress=False).cached


def test_verdict_probabilities_are_the_sampling_chances_of_each_verdict(tiny_model_path,
                                                                       tiny_tokenizer):
    """Right-padded pairs give each verdict's exact chance under teacher forcing at the
    temperature, the chance one sampled answer is that verdict."""
    import numpy as np
    import torch

    from clawray.models.loader import load_model
    from clawray.training.rm_sft import verdict, verdict_probabilities

    model = load_model(tiny_model_path).eval()
    prompts = [tiny_tokenizer.encode(t, add_special_tokens=False)
               for t in ("Did the step help? Answer", "x")]
    for temperature in (1.0, 0.5):
        with torch.no_grad():
            got = verdict_probabilities(model, tiny_tokenizer, prompts, temperature)
            for i, prompt in enumerate(prompts):
                for j, v in enumerate((True, False)):
                    answer = tiny_tokenizer.encode(verdict(v), add_special_tokens=False)
                    chance = 1.0
                    for k, tok in enumerate(answer):  # one token at a time, no padding
                        logits = model(input_ids=torch.tensor([prompt + answer[:k]])).logits
                        chance *= float(torch.softmax(logits[0, -1] / temperature, -1)[tok])
                    assert got[i, j] == pytest.approx(chance, rel=1e-4)
        assert np.all(got.sum(axis=1) <= 1.0)


def test_expected_vote_accuracy_is_balanced_over_the_classes():
    import numpy as np

    from clawray.training.rm_sft import expected_vote_accuracy

    probs = np.array([[0.9, 0.1], [0.5, 0.3], [0.2, 0.6], [0.0, 0.0]])
    got = expected_vote_accuracy(probs, [True, True, False, False])
    assert got["plus"] == pytest.approx(0.7) and got["minus"] == pytest.approx(0.3)
    assert got["balanced"] == pytest.approx(0.5)  # a silent answer counts as wrong
    assert got["verdict"] == pytest.approx((1.0 + 0.8 + 0.8 + 0.0) / 4)
    # always the common verdict: 3 of 4 steps right, balanced 0.5
    assert expected_vote_accuracy(np.array([[0, 1.0]] * 4), [True, False, False, False])[
        "balanced"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="progress and no-progress"):
        expected_vote_accuracy(probs, [True] * 4)


def test_early_stopping_without_both_classes_among_validation_steps_is_a_clear_error(
        mixed_contexts, tiny_tokenizer):
    from clawray.training.rm_sft import rm_selection

    plus = [c for c in mixed_contexts if c.progress]
    with pytest.raises(ValueError, match=r"validation steps; got \d+ progress steps"):
        rm_selection(plus, tiny_tokenizer, 0, 0.8, every=25)
    assert rm_selection(mixed_contexts, tiny_tokenizer, 0, 0.8, every=25).every == 25
