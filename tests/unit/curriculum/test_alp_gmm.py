"""ALP-GMM (Portelas et al. 2019): each rule of the reference algorithm, as listed in
``alp_gmm.py``'s docstring, and a synthetic teacher test against uniform sampling."""

from __future__ import annotations

import numpy as np
import pytest

from clawray.curriculum.alp_gmm import ALPGMM, ALPGMMConfig
from tests.support.curriculum_toy import ToyStudent  # the toy student of the synthetic teacher tests


def teacher(**kw) -> ALPGMM:
    return ALPGMM(ALPGMMConfig(**{"mins": [0.0, 0.0], "maxs": [1.0, 1.0], "fit_rate": 20,
                                  **kw}))


def test_bootstrap_is_uniform_in_the_box_until_the_first_fit():
    t = teacher(mins=[-1.0, 10.0], maxs=[1.0, 20.0], fit_rate=50)
    pts = []
    for _ in range(49):
        x = t.sample_task()
        pts.append(x)
        t.update(x, 1.0)
    pts = np.stack(pts)
    assert t.gmm is None and t.fits == 0
    assert np.all(pts >= [-1, 10]) and np.all(pts <= [1, 20])
    t.update(t.sample_task(), 0.0)
    assert t.fits == 1 and t.gmm is not None


def test_alp_is_zero_while_the_history_holds_at_most_five_tasks():
    t = teacher()
    alps = [t.update([i / 10, 0.0], float(i % 2)) for i in range(7)]
    assert alps[:6] == [0.0] * 6
    assert alps[6] == 1.0  # 7th task: nearest previous is task 5 (reward 1), it scored 0


def test_alp_uses_the_nearest_previous_task_searched_before_insertion():
    t = teacher()
    for i in range(6):
        t.update([0.9, 0.9], 0.0)
    t.update([0.1, 0.1], 0.0)  # far from the others, reward equal
    # next to [0.1, 0.1] (reward 0), not to itself: |0.7 - 0| after scaling
    assert t.update([0.12, 0.1], 0.7) == pytest.approx(0.7)


def test_rewards_are_scaled_to_unit_interval():
    t = teacher(reward_range=(-1.0, 1.0))
    assert [t.scale(r) for r in (-1.0, 0.0, 1.0, 3.0)] == [0.0, 0.5, 1.0, 1.0]
    for _ in range(6):
        t.update([0.5, 0.5], -1.0)
    assert t.update([0.5, 0.5], 1.0) == pytest.approx(1.0)


def test_fit_keeps_the_lowest_aic_of_k_2_to_10_on_the_last_fit_rate_vectors():
    from sklearn.mixture import GaussianMixture

    t = teacher(fit_rate=60)
    rng = np.random.default_rng(1)
    for i in range(120):
        t.update(rng.uniform(0, 1, 2), float(rng.random() < 0.5))
    assert t.fits == 2
    data = np.column_stack([np.stack(t.tasks[-60:]), t.alps[-60:]])
    assert 2 <= t.gmm.n_components <= 10 and t.gmm.covariance_type == "full"
    assert t.gmm.means_.shape[1] == 3  # [params; ALP]
    own = t.gmm.aic(data)
    for k in range(2, 11):
        other = GaussianMixture(k, covariance_type="full", random_state=0).fit(data)
        assert own <= other.aic(data) + 1e-6 * abs(other.aic(data)) + 5.0  # lowest up to EM noise


def test_sampling_favours_high_alp_components_and_stays_in_the_box():
    t = teacher(fit_rate=100, random_task_ratio=0.0, seed=3)
    rng = np.random.default_rng(0)
    # progress (alternating rewards) only in the left half; the right half always fails
    for i in range(100):
        x = rng.uniform(0, 1, 2)
        t.update(x, float(i % 2) if x[0] < 0.5 else 0.0)
    pts = np.stack([t.sample_task() for _ in range(400)])
    assert np.all(pts >= 0) and np.all(pts <= 1)
    assert (pts[:, 0] < 0.5).mean() > 0.7
    alp = [c["alp"] for c in t.components()]
    assert max(alp) > 0.2


def test_random_task_ratio_one_is_uniform_and_validation_is_clear():
    t = teacher(random_task_ratio=1.0, fit_rate=10)
    for i in range(10):
        t.update([0.01, 0.01], float(i % 2))
    pts = np.stack([t.sample_task() for _ in range(300)])
    assert 0.4 < pts[:, 0].mean() < 0.6  # not drawn to the fitted corner
    with pytest.raises(ValueError, match="above its min"):
        ALPGMMConfig(mins=[0, 1], maxs=[1, 1])
    with pytest.raises(ValueError, match="shape"):
        t.update([0.5], 1.0)


def test_seeded_runs_are_reproducible_and_state_round_trips():
    def run(seed, n=70, t=None):
        t = t or teacher(seed=seed, fit_rate=30)
        out = []
        for _ in range(n):
            x = t.sample_task()
            out.append(x)
            t.update(x, float(x[0] > 0.5))
        return np.stack(out), t

    a, ta = run(5)
    b, _ = run(5)
    c, _ = run(6)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    restored = ALPGMM.from_state(ta.cfg, ta.state())
    assert np.array_equal(run(0, 20, restored)[0], run(0, 20, ta)[0])


# ---------------------------------------------------------------- synthetic teacher test

def _teach(sampler: str, seed: int, episodes: int = 600) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    student = ToyStudent(rng)
    t = ALPGMM(ALPGMMConfig(mins=[0, 0], maxs=[1, 1], fit_rate=100, random_task_ratio=0.1,
                            seed=seed))
    in_frontier = 0
    for _ in range(episodes):
        x = t.sample_task() if sampler == "alp-gmm" else rng.uniform(0, 1, 2)
        in_frontier += student.learnable(x)
        t.update(x, student.attempt(x))
    return in_frontier / episodes, student.mastery()


def test_alp_gmm_finds_the_learnable_region_and_the_student_masters_more_than_uniform():
    seeds = range(4)
    alp = np.array([_teach("alp-gmm", s) for s in seeds])
    uni = np.array([_teach("uniform", s) for s in seeds])
    print("share in the learnable region: alp-gmm", alp[:, 0], "uniform", uni[:, 0])
    print("final mastery: alp-gmm", alp[:, 1], "uniform", uni[:, 1])
    assert uni[:, 0].mean() == pytest.approx(0.15, abs=0.03)
    assert alp[:, 0].mean() > 0.4 and alp[:, 0].min() > 0.3, alp[:, 0]
    assert alp[:, 1].mean() > uni[:, 1].mean() + 0.1, (alp[:, 1], uni[:, 1])
