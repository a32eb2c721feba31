"""Figures over seeds: the one summary every multi-seed result in ``docs/results`` reports."""

from __future__ import annotations

from typing import Iterable


def seed_stats(values: Iterable[float]) -> dict[str, float | None]:
    """Mean, min, max and standard error of the mean (sample std, n − 1, over √n; None for a
    single value) of one figure over seeds."""
    import numpy as np

    v = np.asarray(list(values), dtype=float)
    return {"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
            "stderr": float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None}
