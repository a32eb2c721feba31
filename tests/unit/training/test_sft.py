"""``clawray sft``: expert rows through the DeepSpeed learner, a cached model folder, live rows."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clawray.config import ClawRayConfig
from clawray.samples import make_row, rows_to_batch


def _cfg(tmp_path, **sft):
    return (ClawRayConfig().inference(engine="hf")
            .environments(family="household", history_window=0)
            .sft(tasks=6, steps=4, batch_size=8, lr=1e-3, max_difficulty=0.2, eval_tasks=2,
                 cache_dir=str(tmp_path / "sft"), **sft))


def test_sft_trains_saves_a_loadable_model_and_is_cached_by_config(tmp_path, tiny_model_path):
    from clawray.models.loader import load_model
    from clawray.training.sft import INFO, run_sft

    cfg = _cfg(tmp_path)
    first = run_sft(cfg, progress=False)
    assert not first.cached and (first.path / INFO).is_file()
    info = json.loads((first.path / INFO).read_text())
    assert info["rows"] > 6 and info["steps"] == 4
    assert info["nll_last"] < info["nll_first"]  # the NLL steps learn the demonstrations
    # scored on the 2 held-out tasks (the floor on learning: tests/cpu/training/test_warm_start_floors_on_cpu.py)
    assert info["eval_tasks"] == 2
    assert {info["success_before"], info["success_after"]} <= {0.0, 0.5, 1.0}
    model = load_model(first.path)
    base = load_model(tiny_model_path)
    changed = [n for n, p in model.state_dict().items()
               if not (p == base.state_dict()[n]).all()]
    assert changed  # weights differ from the base model's
    again = run_sft(cfg, progress=False)
    assert again.cached and again.path == first.path and again.info == first.info
    # Another held-out scoring is not another model: the cached entry is scored again.
    cooler = run_sft(_cfg(tmp_path).sft(eval_temperature=0.3, eval_tasks=3), progress=False)
    assert cooler.cached and cooler.path == first.path
    assert cooler.info["eval_temperature"] == 0.3 and cooler.info["eval_tasks"] == 3
    assert info["eval_temperature"] == cfg.environments_cfg.temperature
    assert json.loads((first.path / INFO).read_text())["eval_tasks"] == 3
    other = run_sft(_cfg(tmp_path).sft(steps=5), progress=False)
    assert other.path != first.path  # a different setting is a different cache entry


def test_live_rows_keep_positive_turns_as_sft_rows(tmp_path):
    from clawray.training.sft import live_rows

    def turn(i, reward, mask=1):
        return make_row(sample_id=f"t{i}", kind="rl", source="live", session_id="s", turn=i,
                        prompt_ids=[1, 2], response_ids=[3, 4], rollout_logprobs=[-1.0, -1.0],
                        policy_version=0, loss_mask=[mask, mask], reward=reward)

    rows = [turn(0, 1.0), turn(1, -1.0), turn(2, 0.0), turn(3, 1.0, mask=0), turn(4, 0.5)]
    pq.write_table(pa.Table.from_batches([rows_to_batch(rows)]), tmp_path / "seg.parquet")
    out = live_rows(str(tmp_path))
    assert [r["sample_id"] for r in out] == ["sft/t0", "sft/t4"]
    assert all(r["kind"] == "sft" for r in out)
    rows_to_batch(out)


def test_bad_family_in_config_is_a_clear_error(tmp_path):
    from clawray.envs import EnvError
    from clawray.training.sft import run_sft

    cfg = _cfg(tmp_path).environments(family="nosuchmodule:Family")
    with pytest.raises(EnvError, match="cannot import"):
        run_sft(cfg, progress=False)


def test_a_rescored_model_keeps_the_digest_its_dependants_are_keyed_by(tmp_path):
    """Rescoring a warm start rewrites its info file only: the RM built on its steps must
    stay a cache hit. A changed weight file changes the digest."""
    import os

    from clawray.training.sft import INFO, files_digest

    (tmp_path / "model.safetensors").write_bytes(b"w" * 10)
    (tmp_path / INFO).write_text("{}")
    before = files_digest(tmp_path)
    (tmp_path / INFO).write_text(json.dumps({"success_after": 0.34}))
    os.utime(tmp_path / INFO, (1, 1))
    assert files_digest(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"w" * 11)
    assert files_digest(tmp_path) != before


def _sft_rows(tokenizer, n=12):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = []
    for i in range(n):
        answer = tokenizer.encode(f"go to room {i % 3}", add_special_tokens=False) + [end]
        rows.append(make_row(sample_id=f"r{i}", kind="sft", source="env", trajectory_id=f"t{i}",
                             prompt_ids=tokenizer.encode(f"task {i}: where?",
                                                         add_special_tokens=False),
                             response_ids=answer, rollout_logprobs=[0.0] * len(answer),
                             policy_version=0, loss_mask=[1] * len(answer), reward=1.0))
    return rows


def test_early_stopping_keeps_the_best_rated_weights_on_the_same_batches(tmp_path,
                                                                         tiny_model_path,
                                                                         tiny_tokenizer):
    """``train_sft(select=...)`` rates the model every ``every`` steps and after the last, keeps
    the best-rated weights (the earliest on a tie), hands back the last step's as
    ``last_model``, and samples the same batches as a run without ``select``."""
    from clawray.training.sft import Selection, train_sft

    cfg = _cfg(tmp_path).sft(steps=5)
    rows = _sft_rows(tiny_tokenizer)
    ratings, seen = iter([0.2, 0.7, 0.7]), []

    def rate(model):
        assert not model.training  # rated in eval mode
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return next(ratings)

    got = train_sft(tiny_model_path, cfg, rows, progress=False, select=Selection(2, rate))
    assert [c["step"] for c in got["selection"]] == [2, 4, 5] and got["selected_step"] == 4
    assert got["model"].training  # back in train mode
    kept, last = got["model"].state_dict(), got["last_model"].state_dict()
    assert all((kept[k] == seen[1][k]).all() for k in kept)
    assert all((last[k] == seen[2][k]).all() for k in last)
    assert any(not (kept[k] == last[k]).all() for k in kept)
    plain = train_sft(tiny_model_path, cfg, rows, progress=False)
    assert plain["nll"] == got["nll"] and "selection" not in plain
    best_last = train_sft(tiny_model_path, cfg, rows, progress=False,
                          select=Selection(10, lambda _m: 1.0))
    assert best_last["selected_step"] == 5 and "last_model" not in best_last
    with pytest.raises(ValueError, match="at least 1"):
        Selection(0, rate)


def test_lora_sft_saves_the_merged_model_under_its_own_key(tmp_path, tiny_model_path):
    """``sft.lora_rank``: only the adapters train, and the saved folder is a plain model with
    them merged (it loads and serves like the base); the full-weight builds keep their keys."""
    from clawray.models.loader import load_model
    from clawray.training.sft import learner_settings, run_sft, sft_key

    full, lora = _cfg(tmp_path), _cfg(tmp_path, lora_rank=4)
    assert "lora" not in learner_settings(full) and learner_settings(lora)["lora"]["rank"] == 4
    assert sft_key(tiny_model_path, full) != sft_key(tiny_model_path, lora)
    # rank 0 is the setting the keys were computed without before the field existed
    assert sft_key(tiny_model_path, full) == sft_key(tiny_model_path, full.sft(lora_rank=0))
    result = run_sft(lora, progress=False)
    assert result.info["nll_last"] < result.info["nll_first"]
    model, base = load_model(result.path), load_model(tiny_model_path)
    names = set(model.state_dict())
    assert names == set(base.state_dict())  # merged: no lora_A / lora_B left
    changed = {n for n, p in model.state_dict().items() if not (p == base.state_dict()[n]).all()}
    assert changed and all(n.endswith(".weight") for n in changed)
    # only the adapted projections move; embeddings and norms are the base's
    assert not any("embed" in n or "norm" in n for n in changed)


def test_sampled_votes_of_several_sets_on_one_engine_are_each_sets_own(tiny_model_path):
    """``seeds``: prompts of several evaluation sets on one engine start vote as each set
    voted on an engine of its own (seeded ``seed + i`` within the set)."""
    from clawray.training.evaluate import sampled_votes

    cfg = ClawRayConfig().inference(engine="hf")
    first = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    second = [[{"role": "user", "content": f"another {i}"}] for i in range(2)]

    def votes(prompts, **kw):
        return sampled_votes(tiny_model_path, cfg, prompts, 2, 1.0, 7, 6,
                             lambda text: len(text), **kw)

    apart = votes(first) + votes(second)
    together = votes(first + second, seeds=[7, 8, 9, 7, 8])
    assert together == apart
    assert len({tuple(v) for v in apart}) > 1  # the votes differ between prompts
    with pytest.raises(ValueError, match="2 seeds for 5 prompts"):
        votes(first + second, seeds=[7, 8])


def test_policy_selection_keeps_the_checkpoint_that_plays_best_on_validation_tasks(
        tmp_path, tiny_model_path):
    """``sft.select_every``: the policy is rated every N steps by its success on
    ``selection_tasks`` (validation pool, the same for every ``sft.seed``); the saved model is
    the best-rated one and scores its rating again; off, the keys are the ones built without
    the field."""
    from clawray.envs import make_family, task_pool
    from clawray.training.evaluate import evaluate_model
    from clawray.training.sft import run_sft, selection_tasks, sft_key

    plain = _cfg(tmp_path)
    cfg = _cfg(tmp_path, select_every=2, select_tasks=3)
    assert sft_key(tiny_model_path, plain) == sft_key(tiny_model_path, plain.sft(select_tasks=7))
    assert sft_key(tiny_model_path, plain) != sft_key(tiny_model_path, cfg)
    family = make_family("household")
    tasks = selection_tasks(cfg, family)
    assert len(tasks) == 3 and {task_pool(t) for t in tasks} == {"validation"}
    assert ([t.task_id for t in selection_tasks(cfg.sft(seed=5), family)]
            == [t.task_id for t in tasks])
    result = run_sft(cfg, progress=False)
    curve = result.info["selection"]
    assert [c["step"] for c in curve] == [2, 4]
    best = max(c["score"] for c in curve)
    assert result.info["selected_step"] == next(c["step"] for c in curve if c["score"] == best)
    assert evaluate_model(result.path, cfg, tasks) == best
