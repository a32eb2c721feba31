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
    assert JUDGE == "model" and users_phrasing(heuristic) == "keywords"
    assert judge_description(heuristic).endswith("rules:heuristic_judge")
    served = ClawRayConfig().judge(backend="server", model_path="/models/judge")
    assert users_phrasing(served) == "users" and "/models/judge (m=3" in judge_description(served)
    with pytest.raises(ValueError, match="unknown demo judge 'oracle'"):
        with_judge(ClawRayConfig(), "oracle")
