"""Task pools: train / validation / test split by task content (``clawray.envs.task_pool``),
so no training draw, warm start or rewrite can produce a held-out task."""

from __future__ import annotations

import collections
import random

import pytest

from clawray.config import ClawRayConfig
from clawray.curriculum.core import Curriculum
from clawray.envs import EnvError, Pooled, Task, demo_tasks, make_family, task_pool
from clawray.training.evaluate import EVAL_MAX_DIFFICULTY, held_out_tasks
from tests.support.curriculum_toy import ToyFamily


@pytest.fixture(scope="module")
def household():
    return make_family("household")


def test_pools_split_contents_a_tenth_each_for_validation_and_test(household):
    counts = collections.Counter(task_pool(t) for t in demo_tasks(household, 3000, 0.3, 5))
    assert set(counts) == {"train", "validation", "test"}
    assert 0.07 < counts["test"] / 3000 < 0.13 and 0.07 < counts["validation"] / 3000 < 0.13


def test_held_out_pools_never_meet_training_draws(household):
    """The seed streams alone let held-out tasks repeat training ones (measured: 2 of 100 among
    20,000 draws); the pools make it impossible: a large training draw from every source a
    run uses shares no task with the validation or the test pool."""
    cfg = ClawRayConfig()
    test = {t.task_id for s in range(3) for t in held_out_tasks(cfg, 100, s)}
    validation = {t.task_id for s in range(3) for t in held_out_tasks(cfg, 100, s, "validation")}
    # (a pool may repeat a content across seeds: the easy corner of the box is finite)
    assert len(test) > 290 and len(validation) > 290 and not test & validation
    assert all(task_pool(t) == "test" for t in held_out_tasks(cfg, 50, 0))
    train = {t.task_id for t in demo_tasks(household, 6000, EVAL_MAX_DIFFICULTY, 11, "train")}
    curriculum = Curriculum("household", sampler="uniform", sampler_kwargs={"seed": 3},
                            max_difficulty=EVAL_MAX_DIFFICULTY, pool="train")
    leased = [x["task"] for x in curriculum.lease("r", 3000)]
    train |= {Task.from_dict(d).task_id for d in leased}
    assert not train & test and not train & validation
    # Without pools the old seed streams are unchanged (and do overlap at this size).
    off = ClawRayConfig().copy_with(environments={"task_pools": False})
    old = demo_tasks(household, 5, EVAL_MAX_DIFFICULTY, 0 + 7_777_777)
    assert [t.task_id for t in held_out_tasks(off, 5, 0)] == [t.task_id for t in old]


def test_pooled_generation_is_deterministic_and_rewrites_stay_in_the_pool(household):
    pooled = Pooled(household, "test")
    a = [pooled.generate([0.1] * len(household.params), s) for s in range(20)]
    b = [pooled.generate([0.1] * len(household.params), s) for s in range(20)]
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert {task_pool(t) for t in a} == {"test"}
    train = Pooled(household, "train")
    task = train.generate([0.2] * len(household.params), 4)
    rng = random.Random(0)
    for direction in ("harder", "easier") * 5:
        try:
            task = train.rewrite(task, direction, seed=rng.randrange(1000))
        except EnvError:  # at the box's edge
            continue
        assert task_pool(task) == "train"
    assert train.difficulty(task) == household.difficulty(task)


def test_a_family_whose_task_ignores_its_seed_gets_a_clear_error():
    toy = ToyFamily()  # its task is its point: no seed changes the content
    point = next(p for p in ([i / 97, i / 89] for i in range(200))
                 if task_pool(toy.generate(p, 0)) != "test")
    with pytest.raises(EnvError, match="does the family's task vary with its seed"):
        Pooled(toy, "test").generate(point, 0)
    with pytest.raises(EnvError, match="unknown task pool 'dev'"):
        Pooled(toy, "dev")


def test_warm_start_keys_change_with_the_pools(tmp_path):
    from clawray.training.sft import sft_key

    (tmp_path / "m").mkdir()
    on = ClawRayConfig()
    off = on.copy_with(environments={"task_pools": False})
    assert sft_key(tmp_path / "m", on) != sft_key(tmp_path / "m", off)
