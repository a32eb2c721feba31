"""Task samplers (clawray.curriculum.samplers): each one's rule, seeded reproducibility, exact
state round trips, and a synthetic comparison against uniform sampling on a toy family whose
only learnable region is 15 % of the box."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clawray.curriculum.samplers import (SAMPLERS, difficulty_histogram, make_sampler,
                                         sampler_from_state)
from clawray.envs import Param
from tests.support.curriculum_toy import ToyFamily, ToyStudent

KWARGS = {"uniform": {}, "alp_gmm": {"fit_rate": 10}, "learnability": {"pool_size": 8},
          "accuracy_band": {"num_slots": 4, "patience": 2}}


class WideToy(ToyFamily):
    """The toy family on a box other than the unit square."""

    params = (Param("x", -2.0, 2.0), Param("y", 10.0, 20.0))


class OtherToy(ToyFamily):
    name = "other"


def _rewards(task, k: int, g: int = 4) -> list[float]:
    """A deterministic group outcome that depends on the task (mixed, all-fail, all-pass)."""
    x = task.params[0]
    return [float((x * 7 + i + k) % 3 < 1.5) if x < 0.7 else float(x > 0.85) for i in range(g)]


def _play(sampler, groups: int, start: int = 0) -> list[str]:
    ids = []
    for k in range(start, start + groups):
        t = sampler.next_task()
        ids.append(t.task_id)
        sampler.update(t, _rewards(t, k))
    return ids


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_each_sampler_is_seeded_reproducible(name):
    a = _play(make_sampler(name, ToyFamily(), seed=3, **KWARGS[name]), 30)
    b = _play(make_sampler(name, ToyFamily(), seed=3, **KWARGS[name]), 30)
    c = _play(make_sampler(name, ToyFamily(), seed=4, **KWARGS[name]), 30)
    assert a == b and a != c


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_state_round_trip_gives_identical_next_tasks(name):
    s = make_sampler(name, ToyFamily(), seed=1, **KWARGS[name])
    _play(s, 25)  # past alp_gmm's fits at 10 and 20, and some retirements/replacements
    state = json.loads(json.dumps(s.state()))  # JSON-able
    restored = sampler_from_state(ToyFamily(), state)
    assert restored.metrics() == pytest.approx(s.metrics(), nan_ok=True)
    assert _play(restored, 25, start=25) == _play(s, 25, start=25)
    with pytest.raises(ValueError, match="family"):
        sampler_from_state(OtherToy(), state)


def test_uniform_covers_the_box():
    s = make_sampler("uniform", WideToy(), seed=0)
    tasks = [s.next_task() for _ in range(2000)]
    p = np.array([t.params for t in tasks])
    assert np.all(p >= [-2, 10]) and np.all(p <= [2, 20])
    assert p.min(0) == pytest.approx([-2, 10], abs=0.05) and p.max(0) == pytest.approx(
        [2, 20], abs=0.1)
    quadrants = np.histogram2d(p[:, 0], p[:, 1], bins=2, range=[[-2, 2], [10, 20]])[0] / 2000
    assert np.all(np.abs(quadrants - 0.25) < 0.04), quadrants
    assert len({t.seed for t in tasks}) > 1990


def test_alp_gmm_wraps_the_teacher_with_one_update_per_group():
    s = make_sampler("alp_gmm", WideToy(), seed=0, fit_rate=20, random_task_ratio=0.0)
    for k in range(19):
        t = s.next_task()
        s.update(t, [1.0, 0.0, 0.0, 0.0] if t.params[0] < 0 else [0.0] * 4)
    assert s.teacher.fits == 0 and s.metrics()["components"] == 0
    t = s.next_task()
    s.update(t, [1.0, 1.0, 0.0, 0.0])
    assert s.teacher.episodes == 20 and s.teacher.rewards[-1] == 0.5  # the group mean
    m = s.metrics()
    assert s.teacher.fits == 1 and m["fits"] == 1 and m["components"] >= 2
    assert {"component/0/alp", "component/0/weight", "component/0/mean/x"} <= set(m)
    p = np.array([s.next_task().params for _ in range(300)])  # drawn from the mixture now
    assert np.all(p >= [-2, 10]) and np.all(p <= [2, 20])


def test_learnability_prefers_uncertain_tasks_and_retires_settled_ones():
    s = make_sampler("learnability", ToyFamily(), seed=0, pool_size=3, min_episodes=100)
    half, zero, one = (e.task for e in s.pool)
    assert s.scores().tolist() == [0.25, 0.25, 0.25]  # unseen: optimistic
    s.update(half, [1, 0, 1, 0, 1, 0, 1, 0])
    s.update(zero, [0] * 8)
    s.update(one, [1] * 8)
    ids = [s.next_task().task_id for _ in range(3000)]
    shares = {n: ids.count(t.task_id) / 3000 for n, t in
              [("half", half), ("zero", zero), ("one", one)]}
    print("learnability sample shares", shares)
    assert shares["half"] > 0.85 and shares["zero"] < 0.08 and shares["one"] < 0.08

    s = make_sampler("learnability", ToyFamily(), seed=0, pool_size=3, min_episodes=8)
    a, b = s.pool[0].task, s.pool[1].task
    s.update(a, [0] * 4)  # too little evidence
    assert s.pool[0].task == a
    s.update(a, [0] * 4)
    s.update(b, [1, 0, 1, 1, 1, 1, 1, 1])  # not settled
    assert s.pool[0].task != a and s.pool[1].task == b
    assert s.log[-1]["task_id"] == a.task_id and s.metrics()["retired"] == 1
    s.update(a, [1] * 8)  # a late report of the retired task changes nothing
    assert s.metrics()["stale"] == 1 and s.pool[1].p == 7 / 8


def _band(**kw):
    return make_sampler("accuracy_band", ToyFamily(), seed=0, window=1, **kw)


def test_accuracy_band_samples_only_in_band_or_unknown_slots():
    s = _band(num_slots=5, patience=100)
    t = s.active_tasks()
    s.update(t[0], [0] * 8)  # 0: below
    s.update(t[1], [1] * 8)  # 1: above
    s.update(t[2], [1] + [0] * 7)  # 1/8: in band (inclusive)
    s.update(t[3], [1] * 7 + [0])  # 7/8: in band (inclusive)
    assert s.slot_accuracy() == [0.0, 1.0, 0.125, 0.875, None]
    served = {s.next_task().task_id for _ in range(400)}
    assert served == {t[2].task_id, t[3].task_id, t[4].task_id}
    m = s.metrics()
    assert (m["in_band"], m["out_of_band"], m["unknown"]) == (2, 2, 1)


def test_accuracy_band_replaces_a_slot_out_of_band_for_patience_groups():
    s = _band(num_slots=3, patience=3)
    t = s.active_tasks()
    s.update(t[0], [0] * 8)  # out of band: 1 group
    s.update(t[1], [1, 0] * 4)
    s.update(t[2], [1, 0] * 4)  # 3 groups, but the first counted
    assert s.active_tasks()[0] != t[0] and s.slot_accuracy()[0] is None
    assert s.active_tasks()[1:] == t[1:]
    event = s.replacements[-1]
    assert (event["event"], event["slot"], event["old"], event["accuracy"]) == (
        "out_of_band", 0, t[0].task_id, 0.0)
    assert s.history[0] == [t[0].task_id, s.active_tasks()[0].task_id]
    s.update(t[1], [1] * 8)  # out of band, then back in band before patience: kept
    s.update(t[1], [1, 0] * 4)
    s.update(t[2], [1, 0] * 4)
    s.update(t[2], [1, 0] * 4)
    assert s.active_tasks()[1] == t[1] and s.metrics()["replaced"] == 1


def test_accuracy_band_serves_a_logged_fresh_task_when_no_slot_is_eligible():
    s = _band(num_slots=2, patience=100)
    t = s.active_tasks()
    s.update(t[0], [0] * 4)
    s.update(t[1], [1] * 4)
    fresh = s.next_task()
    assert fresh not in t and s.replacements[-1]["event"] == "fresh"
    assert s.replacements[-1]["new"] == fresh.task_id
    s.update(fresh, [1, 0])
    assert s.metrics()["fresh"] == 1 and s.metrics()["unslotted"] == 1


def test_accuracy_band_replace_keeps_the_root_and_logs_it():
    fam = ToyFamily()
    s = make_sampler("accuracy_band", fam, seed=0, num_slots=2)
    old = s.active_tasks()[0]
    s.update(old, [1] * 8)
    harder = fam.rewrite(old, "harder")
    s.replace(0, harder)
    assert s.active_tasks()[0] == harder and harder.root == old.root == old.task_id
    assert s.slot_accuracy()[0] is None and s.history[0] == [old.task_id, harder.task_id]
    e = s.replacements[-1]
    assert (e["event"], e["old"], e["new"], e["accuracy"]) == (
        "rewrite", old.task_id, harder.task_id, 1.0)
    harder2 = fam.rewrite(harder, "harder")
    s.replace(0, harder2)
    assert s.active_tasks()[0].root == old.task_id and s.metrics()["rewritten"] == 2
    with pytest.raises(ValueError, match="root"):
        s.replace(0, fam.generate([0.5, 0.5], 1))


def test_bad_names_and_rewards_are_rejected_clearly():
    with pytest.raises(ValueError, match="uniform, alp_gmm, learnability, accuracy_band"):
        make_sampler("acc_band", ToyFamily())
    s = make_sampler("uniform", ToyFamily())
    t = s.next_task()
    for bad in ([], [1.5], [float("nan")], [-0.1]):
        with pytest.raises(ValueError, match="reward"):
            s.update(t, bad)
    with pytest.raises(ValueError, match="band"):
        make_sampler("accuracy_band", ToyFamily(), band=(0.9, 0.1))


def test_difficulty_histogram_counts_in_equal_bins_of_the_unit_interval():
    assert difficulty_histogram([0.0, 0.05, 0.5, 0.99, 1.0, 1.2], bins=4) == [2, 0, 1, 3]
    assert difficulty_histogram([], bins=3) == [0, 0, 0]


# ---------------------------------------------------------------- synthetic comparison

def _teach(name: str, seed: int, groups: int = 200, g: int = 8) -> tuple[float, float]:
    """Share of groups sampled in the learnable region, and the student's final mastery."""
    student = ToyStudent(np.random.default_rng(seed + 100))
    sampler = make_sampler(name, ToyFamily(), seed=seed)
    inside = 0
    for _ in range(groups):
        t = sampler.next_task()
        inside += student.learnable(t.params)
        sampler.update(t, [student.attempt(t.params) for _ in range(g)])
    return inside / groups, student.mastery()


def test_learnability_and_accuracy_band_sample_the_learnable_frontier_more_than_uniform():
    seeds = range(6)
    res = {n: np.array([_teach(n, s) for s in seeds])
           for n in ("uniform", "learnability", "accuracy_band")}
    for n, r in res.items():
        print(f"{n}: share in the learnable region {np.round(r[:, 0], 3)} (mean "
              f"{r[:, 0].mean():.3f}), final mastery {r[:, 1].mean():.3f}")
    uni = res["uniform"][:, 0]
    assert uni.mean() == pytest.approx(0.15, abs=0.03)
    for n in ("learnability", "accuracy_band"):
        share = res[n][:, 0]
        assert share.mean() > uni.mean() + 0.08 and share.min() > uni.mean(), (n, share)
        assert res[n][:, 1].mean() > res["uniform"][:, 1].mean() + 0.1, n


# ---------------------------------------------------------------- the actor's core, no Ray

def test_curriculum_core_saves_atomically_and_rejects_a_mismatched_checkpoint(tmp_path):
    from clawray.curriculum.core import Curriculum

    path = str(tmp_path / "c.json")
    a = Curriculum("tests.support.curriculum_toy:ToyFamily", sampler="learnability",
                   sampler_kwargs={"pool_size": 4}, checkpoint_path=path, checkpoint_every=3)
    for _ in range(3):
        (lease,) = a.lease("r")
        assert a.report(lease["lease_id"], [1.0, 0.0])
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]
    b = Curriculum("tests.support.curriculum_toy:ToyFamily", sampler="learnability", checkpoint_path=path)
    assert b.sampler.state() == a.sampler.state() and b.metrics()["reported"] == 3
    assert [x["task"] for x in b.lease("r", 3)] == [x["task"] for x in a.lease("r", 3)]
    with pytest.raises(ValueError, match="'learnability' curriculum"):
        Curriculum("tests.support.curriculum_toy:ToyFamily", sampler="uniform", checkpoint_path=path)
