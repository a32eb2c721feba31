"""ALP-GMM: a curriculum over continuous task parameters (Portelas et al. 2019).

The teacher samples task parameters in a box where the student's *absolute learning progress*
(ALP) is high:

- rewards are scaled to [0, 1] with the configured reward range;
- the ALP of a finished episode is ``|r − r_nn|``, ``nn`` the nearest *previous* task in
  parameter space (searched before the new task is inserted); 0 while the history holds ≤ 5
  tasks;
- the first ``fit_rate`` tasks are uniform in the box; every ``fit_rate`` episodes Gaussian
  mixtures with k = 2..10 components (full covariance) are fitted on the last ``fit_rate``
  ``[params; ALP]`` vectors, and the one with the lowest AIC is kept;
- a task is uniform with probability ``random_task_ratio``; otherwise a component is chosen with
  probability ∝ its mean ALP (uniform if all are 0), a point is drawn from it, its ALP
  coordinate is dropped and it is clipped to the box;
- one seed fixes every draw: two teachers with the same seed and the same episode results
  propose the same tasks.

Pure Python + NumPy + scikit-learn (``GaussianMixture``), no Ray: the curriculum actor wraps it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np


@dataclasses.dataclass
class ALPGMMConfig:
    mins: Sequence[float]
    maxs: Sequence[float]
    fit_rate: int = 250  # teachDeepRL's default (TeachMyAgent uses 150)
    random_task_ratio: float = 0.2  # teachDeepRL's default (TeachMyAgent uses 0.05)
    max_components: int = 10
    reward_range: tuple[float, float] = (0.0, 1.0)
    seed: int = 0

    def __post_init__(self) -> None:
        lo, hi = np.asarray(self.mins, float), np.asarray(self.maxs, float)
        if lo.ndim != 1 or lo.shape != hi.shape or lo.size == 0:
            raise ValueError(f"mins and maxs must be 1-D of the same length, got "
                             f"{list(self.mins)} and {list(self.maxs)}")
        if not np.all(np.isfinite(lo)) or not np.all(np.isfinite(hi)) or np.any(hi <= lo):
            raise ValueError(f"every max must be finite and above its min: {list(self.mins)}"
                             f" .. {list(self.maxs)}")
        if self.fit_rate < 2:
            raise ValueError(f"fit_rate must be >= 2, got {self.fit_rate}")
        if not 0.0 <= self.random_task_ratio <= 1.0:
            raise ValueError(f"random_task_ratio must be in [0, 1], got {self.random_task_ratio}")
        if self.max_components < 2:
            raise ValueError(f"max_components must be >= 2, got {self.max_components}")
        if not self.reward_range[1] > self.reward_range[0]:
            raise ValueError(f"reward_range must be increasing, got {self.reward_range}")


class ALPGMM:
    """The teacher: ``sample_task()`` → parameters; ``update(params, reward)`` after each
    episode."""

    MIN_HISTORY = 5  # ALP is 0 while the history holds at most this many tasks

    def __init__(self, cfg: ALPGMMConfig) -> None:
        self.cfg = cfg
        self.mins = np.asarray(cfg.mins, dtype=np.float64)
        self.maxs = np.asarray(cfg.maxs, dtype=np.float64)
        self.rng = np.random.default_rng(cfg.seed)
        self.tasks: list[np.ndarray] = []  # every finished episode's parameters
        self.rewards: list[float] = []  # scaled to [0, 1]
        self.alps: list[float] = []
        self.gmm: Any = None
        self.episodes = 0
        self.fits = 0
        self._last_fit: tuple[int, int] | None = None  # (episodes at the fit, its EM seed)

    @property
    def dim(self) -> int:
        return int(self.mins.size)

    # ---------------------------------------------------------------- sampling

    def _uniform(self) -> np.ndarray:
        return self.rng.uniform(self.mins, self.maxs)

    def sample_task(self) -> np.ndarray:
        """The next task's parameters (a point of the box)."""
        if self.gmm is None or self.rng.random() < self.cfg.random_task_ratio:
            return self._uniform()
        alp_means = self.gmm.means_[:, -1]
        weights = np.clip(alp_means, 0.0, None)
        if weights.sum() <= 0:
            probs = np.full(len(weights), 1.0 / len(weights))
        else:
            probs = weights / weights.sum()
        k = int(self.rng.choice(len(probs), p=probs))
        point = self.rng.multivariate_normal(self.gmm.means_[k], self.gmm.covariances_[k])
        return np.clip(point[:-1], self.mins, self.maxs)

    # ---------------------------------------------------------------- learning

    def scale(self, reward: float) -> float:
        lo, hi = self.cfg.reward_range
        return float(np.clip((reward - lo) / (hi - lo), 0.0, 1.0))

    def update(self, params: Sequence[float], reward: float) -> float:
        """Record a finished episode; returns its ALP. Refits every ``fit_rate`` episodes."""
        x = np.asarray(params, dtype=np.float64)
        if x.shape != self.mins.shape:
            raise ValueError(f"task parameters have shape {x.shape}, expected {self.mins.shape}")
        if not np.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        r = self.scale(reward)
        alp = 0.0
        if len(self.tasks) > self.MIN_HISTORY:  # nearest previous task, before inserting x
            d = np.linalg.norm(np.stack(self.tasks) - x, axis=1)
            alp = abs(r - self.rewards[int(np.argmin(d))])
        self.tasks.append(x)
        self.rewards.append(r)
        self.alps.append(alp)
        self.episodes += 1
        if self.episodes % self.cfg.fit_rate == 0:
            self._fit()
        return alp

    def _fit(self, end: int | None = None, seed: int | None = None) -> None:
        """Fit on the ``fit_rate`` vectors before episode ``end`` (default: all so far)."""
        from sklearn.mixture import GaussianMixture
        from threadpoolctl import threadpool_limits

        n, end = self.cfg.fit_rate, self.episodes if end is None else end
        seed = int(self.rng.integers(2**31 - 1)) if seed is None else seed
        data = np.column_stack([np.stack(self.tasks[end - n:end]),
                                np.asarray(self.alps[end - n:end])])
        best, best_aic = None, np.inf
        # A few hundred small vectors: one BLAS thread is fastest, and many threads on a busy
        # machine made a refit take ~6 s instead of ~0.3 s (measured in the notebook).
        with threadpool_limits(1):
            for k in range(2, min(self.cfg.max_components, len(data)) + 1):
                gmm = GaussianMixture(n_components=k, covariance_type="full", random_state=seed)
                gmm.fit(data)
                aic = gmm.aic(data)
                if aic < best_aic:
                    best, best_aic = gmm, aic
        self.gmm = best
        self.fits += 1
        self._last_fit = (end, seed)

    # ---------------------------------------------------------------- introspection

    def components(self) -> list[dict[str, Any]]:
        """The fitted Gaussians: weight, mean parameters and mean ALP (for metrics, plots)."""
        if self.gmm is None:
            return []
        return [{"weight": float(w), "mean": m[:-1].tolist(), "alp": float(m[-1])}
                for w, m in zip(self.gmm.weights_, self.gmm.means_)]

    def state(self) -> dict[str, Any]:
        """Everything needed to resume, as plain data (the GMM is refitted on restore)."""
        return {"tasks": [t.tolist() for t in self.tasks], "rewards": list(self.rewards),
                "alps": list(self.alps), "episodes": self.episodes, "fits": self.fits,
                "last_fit": self._last_fit, "rng": self.rng.bit_generator.state}

    @classmethod
    def from_state(cls, cfg: ALPGMMConfig, state: dict[str, Any]) -> "ALPGMM":
        t = cls(cfg)
        t.tasks = [np.asarray(x, dtype=np.float64) for x in state["tasks"]]
        t.rewards, t.alps = list(state["rewards"]), list(state["alps"])
        t.episodes = int(state["episodes"])
        if state.get("last_fit"):
            end, seed = state["last_fit"]
            t._fit(int(end), int(seed))  # the same data and EM seed: the same mixture
        t.fits = int(state.get("fits", t.fits))
        t.rng.bit_generator.state = state["rng"]
        return t
