"""The gate's tests of significance, from scipy and statsmodels (no hand-written statistics).

Each function answers one question of the gate's rules with a one-sided p-value; a rule acts
when the p-value is below its alpha *and* the effect is beyond its allowance
(``clawray/gate/core.py``). The Monte-Carlo tests in ``tests/unit/gate/test_significance.py``
measure each rule's false-rejection rate when candidate and incumbent are equal, against its
alpha.

Degenerate samples (no spread: every paired difference equal, every reward the same) have no
noise to test against; there the difference is exact, and the p-value is 0 when it points the
asked way and 1 otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def _exact(difference: float) -> float:
    return 0.0 if difference < 0 else 1.0


def _no_spread(values: Sequence[float]) -> bool:
    """All equal, up to rounding (scipy's moments lose all precision there)."""
    mean = sum(values) / len(values)
    return max(values) - min(values) <= 1e-12 * (1.0 + abs(mean))


def paired_below(candidate: Sequence[float], incumbent: Sequence[float]) -> float:
    """p-value that the candidate scores lower than the incumbent on the same prompts
    (one-sided paired t-test, ``scipy.stats.ttest_rel``)."""
    from scipy import stats

    diffs = [c - i for c, i in zip(candidate, incumbent)]
    if len(diffs) < 2 or _no_spread(diffs):
        return _exact(sum(diffs) / len(diffs))
    return float(stats.ttest_rel(candidate, incumbent, alternative="less").pvalue)


def below_value(scores: Sequence[float], value: float) -> float:
    """p-value that the mean of ``scores`` is below a fixed ``value`` (one-sided one-sample
    t-test, ``scipy.stats.ttest_1samp``)."""
    from scipy import stats

    mean = sum(scores) / len(scores)
    if len(scores) < 2 or _no_spread(scores):
        return _exact(mean - value)
    return float(stats.ttest_1samp(scores, value, alternative="less").pvalue)


def t_half_width(scores: Sequence[float], alpha: float) -> float:
    """The one-sided ``1 - alpha`` half-width of the mean of ``scores`` (Student's t)."""
    from scipy import stats

    n = len(scores)
    if n < 2:
        return 0.0
    mean = sum(scores) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in scores) / (n - 1))
    return float(stats.t.ppf(1 - alpha, n - 1) * sd / math.sqrt(n))


@dataclass(frozen=True)
class Welch:
    """Two independent samples given by their means, variances and sizes (first minus
    second): the difference, its standard error, Welch's degrees of freedom, and one-sided
    p-values (``scipy.stats.ttest_ind_from_stats``, ``equal_var=False``)."""

    mean1: float
    var1: float
    n1: float
    mean2: float
    var2: float
    n2: float

    @property
    def difference(self) -> float:
        return self.mean1 - self.mean2

    @property
    def se(self) -> float:
        return math.sqrt(self.var1 / self.n1 + self.var2 / self.n2)

    @property
    def df(self) -> float:
        """Welch–Satterthwaite degrees of freedom."""
        a, b = self.var1 / self.n1, self.var2 / self.n2
        if a + b == 0:
            return math.inf
        return (a + b) ** 2 / (a * a / (self.n1 - 1) + b * b / (self.n2 - 1))

    def p_greater(self, shift: float = 0.0) -> float:
        """p-value that the difference exceeds ``shift``."""
        from scipy import stats

        if self.se == 0:
            return _exact(shift - self.difference)
        return float(stats.ttest_ind_from_stats(
            self.mean1 - shift, math.sqrt(self.var1), self.n1, self.mean2,
            math.sqrt(self.var2), self.n2, equal_var=False, alternative="greater").pvalue)

    def p_less(self, shift: float = 0.0) -> float:
        """p-value that the difference is below ``shift``."""
        from scipy import stats

        if self.se == 0:
            return _exact(self.difference - shift)
        return float(stats.ttest_ind_from_stats(
            self.mean1 - shift, math.sqrt(self.var1), self.n1, self.mean2,
            math.sqrt(self.var2), self.n2, equal_var=False, alternative="less").pvalue)

    def bounds(self, alpha: float) -> tuple[float, float]:
        """One-sided ``1 - alpha`` lower and upper confidence bounds of the difference."""
        from scipy import stats

        half = 0.0 if self.se == 0 else float(stats.t.ppf(1 - alpha, self.df)) * self.se
        return self.difference - half, self.difference + half


def rate_higher(x1: float, n1: float, x2: float, n2: float) -> float:
    """p-value that the first rate (``x1`` of ``n1``) is higher than the second
    (``statsmodels``' ``test_proportions_2indep``, difference, one-sided)."""
    import numpy as np
    from statsmodels.stats.proportion import test_proportions_2indep

    if x1 / n1 <= x2 / n2:
        return 1.0
    with np.errstate(divide="ignore", invalid="ignore"):  # its ratio summaries at a zero rate
        p = float(test_proportions_2indep(int(x1), int(n1), int(x2), int(n2), compare="diff",
                                          alternative="larger").pvalue)
    return p if math.isfinite(p) else 1.0
