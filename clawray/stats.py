"""Figures over seeds: the one summary every multi-seed result in ``docs/results`` reports."""

from __future__ import annotations

from typing import Any, Iterable


def seed_stats(values: Iterable[float]) -> dict[str, float | None]:
    """Mean, min, max and standard error of the mean (sample std, n − 1, over √n; None for a
    single value) of one figure over seeds."""
    import numpy as np

    v = np.asarray(list(values), dtype=float)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
            "stderr": float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None}


def paired_difference(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """``a`` against ``b`` (values by seed) on the seeds both have: the per-seed differences'
    mean and standard error (``seed_stats``; None without a common seed), a paired t-test's p
    (``scipy.stats.ttest_rel``; None under two seeds or when every difference is the same),
    and "shown": p < 0.05 with ``a`` the larger."""
    from scipy import stats

    seeds = sorted(set(a) & set(b))
    diffs = [a[k] - b[k] for k in seeds]
    p_value = (float(stats.ttest_rel([a[k] for k in seeds], [b[k] for k in seeds]).pvalue)
               if len(seeds) >= 2 and len(set(diffs)) > 1 else None)
    return {"seeds": seeds, "difference": seed_stats(diffs) if diffs else None,
            "p_value": p_value,
            "shown": bool(p_value is not None and p_value < 0.05 and sum(diffs) > 0)}
