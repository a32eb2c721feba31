"""Task samplers: which task a runner plays next, given the outcomes of the groups so far.

A ``TaskSampler`` hands out ``Task`` objects of one family (``next_task``) and learns from the
outcome of each GRPO group (``update(task, rewards)``: the G rewards in [0, 1], 1 = success).
Four are built in, chosen by name with ``make_sampler``:

- ``uniform``: uniform params in the family's box, a random seed;
- ``alp_gmm``: the ALP-GMM teacher (``alp_gmm.py``) over the box, fed each group's mean reward;
- ``learnability``: a pool of generated tasks sampled ∝ p(1 − p) + ε (p: recent success);
  unseen tasks score 0.25 (the maximum of p(1 − p)); a task whose p is 0 or 1 over at least
  ``min_episodes`` recent episodes is retired and replaced by a fresh one;
- ``accuracy_band``: RLAnything's acc-band pool: task slots, sampled uniformly
  among those whose recent accuracy is in ``band`` (inclusive) or unknown. An out-of-band slot
  is no longer served, so its ``patience`` is counted in groups reported to the sampler (any
  slot), not in its own groups: that is the window an adapter has to ``replace()`` it with a
  rewrite before it falls back to a freshly generated task.

Every sampler is seeded, and ``state()`` / ``sampler_from_state`` restore it exactly: the same
updates after a restore give the same tasks. Pure Python + NumPy, no Ray.
"""

from __future__ import annotations

import collections
import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Sequence

import numpy as np

from clawray.curriculum.alp_gmm import ALPGMM, ALPGMMConfig
from clawray.envs.base import Task, TaskFamily

LOG_LIMIT = 1000  # event logs kept in the state (counters keep the totals)


def group_mean(rewards: Sequence[float]) -> float:
    """The mean of one group's rewards, after checking they are finite and in [0, 1]."""
    r = np.asarray(list(rewards), dtype=np.float64)
    if r.size == 0:
        raise ValueError("a group needs at least one reward")
    if not np.all(np.isfinite(r)) or np.any(r < 0) or np.any(r > 1):
        raise ValueError(f"rewards must be finite and in [0, 1], got {r.tolist()}")
    return float(r.mean())


def difficulty_histogram(difficulties: Sequence[float], bins: int = 10) -> list[int]:
    """Counts of ``difficulties`` (clipped to [0, 1]) in ``bins`` equal bins of [0, 1]."""
    counts, _ = np.histogram(np.clip(np.asarray(list(difficulties), float), 0, 1),
                             bins=bins, range=(0.0, 1.0))
    return counts.astype(int).tolist()


class TaskSampler(ABC):
    """Seeded task choice; ``state()`` is JSON-able and ``from_state`` restores it exactly."""

    name: ClassVar[str] = ""

    def __init__(self, family: TaskFamily, seed: int = 0) -> None:
        self.family = family
        self.config: dict[str, Any] = {"seed": int(seed)}
        self.rng = np.random.default_rng(seed)
        self.served = 0
        self.groups = 0

    @abstractmethod
    def next_task(self) -> Task:
        """The task to play next (one GRPO group of it)."""

    @abstractmethod
    def update(self, task: Task, rewards: Sequence[float]) -> None:
        """The rewards in [0, 1] of one group of rollouts of ``task``."""

    def metrics(self) -> dict[str, float]:
        return {"served": float(self.served), "groups": float(self.groups)}

    # ---------------------------------------------------------------- state

    def _state(self) -> dict[str, Any]:
        """The subclass's own state (plain data)."""
        return {}

    def _restore(self, state: dict[str, Any]) -> None:
        """Load what ``_state`` returned."""

    def state(self) -> dict[str, Any]:
        return {"sampler": self.name, "family": self.family.name, "config": dict(self.config),
                "rng": self.rng.bit_generator.state, "served": self.served,
                "groups": self.groups, **self._state()}

    @classmethod
    def from_state(cls, family: TaskFamily, state: dict[str, Any]) -> "TaskSampler":
        if state.get("sampler") != cls.name:
            raise ValueError(f"state of a {state.get('sampler')!r} sampler, not {cls.name!r}")
        if state.get("family") != family.name:
            raise ValueError(f"sampler state is for family {state.get('family')!r}, not "
                             f"{family.name!r}")
        s = cls(family, **state["config"])
        s.rng.bit_generator.state = state["rng"]
        s.served, s.groups = int(state["served"]), int(state["groups"])
        s._restore(state)
        return s


class UniformSampler(TaskSampler):
    """Uniform params in the family's box, a random seed."""

    name = "uniform"

    def next_task(self) -> Task:
        self.served += 1
        return self.family.sample(self.rng)

    def update(self, task: Task, rewards: Sequence[float]) -> None:
        group_mean(rewards)
        self.groups += 1


class ALPGMMSampler(TaskSampler):
    """ALP-GMM over the family's box; one teacher update per group (its mean reward)."""

    name = "alp_gmm"

    def __init__(self, family: TaskFamily, seed: int = 0, fit_rate: int = 250,
                 random_task_ratio: float = 0.2, max_components: int = 10) -> None:
        super().__init__(family, seed)
        self.config.update(fit_rate=fit_rate, random_task_ratio=random_task_ratio,
                           max_components=max_components)
        self.teacher_cfg = ALPGMMConfig(mins=family.low.tolist(), maxs=family.high.tolist(),
                                        fit_rate=fit_rate, random_task_ratio=random_task_ratio,
                                        max_components=max_components, seed=seed)
        self.teacher = ALPGMM(self.teacher_cfg)  # its own RNG; self.rng draws the task seeds

    def next_task(self) -> Task:
        self.served += 1
        params = self.teacher.sample_task()
        return self.family.generate(params.tolist(), int(self.rng.integers(2**31)))

    def update(self, task: Task, rewards: Sequence[float]) -> None:
        self.teacher.update(task.params, group_mean(rewards))
        self.groups += 1

    def metrics(self) -> dict[str, float]:
        comps = self.teacher.components()
        out = {**super().metrics(), "components": float(len(comps)),
               "fits": float(self.teacher.fits)}
        names = [p.name for p in self.family.params]
        for i, c in enumerate(comps):  # one region of the box per component
            out[f"component/{i}/alp"] = c["alp"]
            out[f"component/{i}/weight"] = c["weight"]
            for name, m in zip(names, c["mean"]):
                out[f"component/{i}/mean/{name}"] = float(m)
        if comps:
            out["alp_max"] = max(c["alp"] for c in comps)
        return out

    def _state(self) -> dict[str, Any]:
        return {"teacher": self.teacher.state()}

    def _restore(self, state: dict[str, Any]) -> None:
        self.teacher = ALPGMM.from_state(self.teacher_cfg, state["teacher"])


class _Evidence:
    """Recent group results of one task: the last ``window`` (reward sum, episodes) pairs."""

    def __init__(self, task: Task, window: int, groups: Sequence[Sequence[float]] = ()) -> None:
        self.task, self.task_id = task, task.task_id
        self.groups: collections.deque = collections.deque(
            (tuple(g) for g in groups), maxlen=window)

    def add(self, rewards: Sequence[float]) -> None:
        self.groups.append((float(sum(rewards)), len(rewards)))

    @property
    def episodes(self) -> int:
        return sum(n for _, n in self.groups)

    @property
    def p(self) -> float | None:
        n = self.episodes
        return sum(s for s, _ in self.groups) / n if n else None

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task.to_dict(), "groups": [list(g) for g in self.groups]}


class LearnabilitySampler(TaskSampler):
    """A pool sampled ∝ p(1 − p) + ``epsilon``; settled tasks (p ∈ {0, 1}) are retired."""

    name = "learnability"

    def __init__(self, family: TaskFamily, seed: int = 0, pool_size: int = 64,
                 window: int = 4, min_episodes: int = 8, epsilon: float = 0.01,
                 unseen_score: float = 0.25) -> None:
        super().__init__(family, seed)
        if pool_size < 1 or window < 1 or min_episodes < 1:
            raise ValueError("pool_size, window and min_episodes must be >= 1, got "
                             f"{pool_size}, {window}, {min_episodes}")
        if epsilon < 0 or unseen_score <= 0:
            raise ValueError(f"epsilon must be >= 0 and unseen_score > 0, got {epsilon}, "
                             f"{unseen_score}")
        self.config.update(pool_size=pool_size, window=window, min_episodes=min_episodes,
                           epsilon=epsilon, unseen_score=unseen_score)
        self.window, self.min_episodes = window, min_episodes
        self.epsilon, self.unseen_score = epsilon, unseen_score
        self.pool = [_Evidence(family.sample(self.rng), window) for _ in range(pool_size)]
        self.retired = 0
        self.stale = 0  # groups of tasks no longer in the pool
        self.log: list[dict[str, Any]] = []

    def scores(self) -> np.ndarray:
        return np.array([self.unseen_score if e.p is None
                         else e.p * (1 - e.p) + self.epsilon for e in self.pool])

    def next_task(self) -> Task:
        s = self.scores()
        i = int(self.rng.choice(len(s), p=s / s.sum()))
        self.served += 1
        return self.pool[i].task

    def update(self, task: Task, rewards: Sequence[float]) -> None:
        rewards = list(rewards)
        group_mean(rewards)
        self.groups += 1
        tid = task.task_id
        i = next((k for k, e in enumerate(self.pool) if e.task_id == tid), None)
        if i is None:
            self.stale += 1
            return
        e = self.pool[i]
        e.add(rewards)
        if e.episodes >= self.min_episodes and e.p in (0.0, 1.0):
            self.pool[i] = _Evidence(self.family.sample(self.rng), self.window)
            self.retired += 1
            self.log = (self.log + [{"group": self.groups, "task_id": tid, "p": e.p,
                                     "new": self.pool[i].task_id}])[-LOG_LIMIT:]

    def metrics(self) -> dict[str, float]:
        ps = [e.p for e in self.pool if e.p is not None]
        return {**super().metrics(), "pool": float(len(self.pool)),
                "seen": float(len(ps)), "retired": float(self.retired),
                "stale": float(self.stale),
                "mean_p": float(np.mean(ps)) if ps else math.nan,
                "frontier": float(sum(0 < p < 1 for p in ps))}

    def _state(self) -> dict[str, Any]:
        return {"pool": [e.to_dict() for e in self.pool], "retired": self.retired,
                "stale": self.stale, "log": self.log}

    def _restore(self, state: dict[str, Any]) -> None:
        self.pool = [_Evidence(Task.from_dict(e["task"]), self.window, e["groups"])
                     for e in state["pool"]]
        self.retired, self.stale = int(state["retired"]), int(state["stale"])
        self.log = list(state["log"])


class AccuracyBandSampler(TaskSampler):
    """RLAnything's acc-band pool: slots whose recent accuracy is in ``band`` or unknown."""

    name = "accuracy_band"

    def __init__(self, family: TaskFamily, seed: int = 0, num_slots: int = 16,
                 band: Sequence[float] = (0.125, 0.875), patience: int = 8,
                 window: int = 1) -> None:
        super().__init__(family, seed)
        lo, hi = (float(x) for x in band)
        if not 0.0 <= lo <= hi <= 1.0:
            raise ValueError(f"band must satisfy 0 <= lo <= hi <= 1, got {tuple(band)}")
        if num_slots < 1 or patience < 1 or window < 1:
            raise ValueError("num_slots, patience and window must be >= 1, got "
                             f"{num_slots}, {patience}, {window}")
        self.config.update(num_slots=num_slots, band=[lo, hi], patience=patience, window=window)
        self.band, self.patience, self.window = (lo, hi), patience, window
        self.slots = [_Evidence(family.sample(self.rng), window) for _ in range(num_slots)]
        self.out = [0] * num_slots  # consecutive groups (any slot's) spent out of band
        self.history: list[list[str]] = [[s.task_id] for s in self.slots]
        self.replacements: list[dict[str, Any]] = []  # log of slot changes
        self.counts = {"replaced": 0, "rewritten": 0, "fresh": 0, "unslotted": 0}

    def slot_accuracy(self) -> list[float | None]:
        """Each slot's recent accuracy (None while its active task has no group yet)."""
        return [s.p for s in self.slots]

    def active_tasks(self) -> list[Task]:
        return [s.task for s in self.slots]

    def in_band(self, acc: float | None) -> bool:
        return acc is not None and self.band[0] <= acc <= self.band[1]

    def eligible(self) -> list[int]:
        return [i for i, a in enumerate(self.slot_accuracy()) if a is None or self.in_band(a)]

    def next_task(self) -> Task:
        self.served += 1
        ok = self.eligible()
        if ok:
            return self.slots[ok[int(self.rng.integers(len(ok)))]].task
        task = self.family.sample(self.rng)  # every slot is out of band, waiting
        self.counts["fresh"] += 1
        self._log({"event": "fresh", "slot": None, "new": task.task_id})
        return task

    def update(self, task: Task, rewards: Sequence[float]) -> None:
        rewards = list(rewards)
        group_mean(rewards)
        self.groups += 1
        tid = task.task_id
        hit = [i for i, s in enumerate(self.slots) if s.task_id == tid]
        for i in hit:
            self.slots[i].add(rewards)
        if not hit:
            self.counts["unslotted"] += 1
        for i, acc in enumerate(self.slot_accuracy()):
            self.out[i] = 0 if acc is None or self.in_band(acc) else self.out[i] + 1
            if self.out[i] >= self.patience:
                self._swap(i, self.family.sample(self.rng), "out_of_band", acc)
                self.counts["replaced"] += 1

    def replace(self, slot: int, task: Task, reason: str = "rewrite") -> None:
        """Make ``task`` (a rewrite of the slot's task: same root) the slot's active task;
        its accuracy starts unknown."""
        old = self.slots[slot].task
        if task.root != old.root:
            raise ValueError(f"slot {slot}: a replacement must keep the root {old.root!r}, got "
                             f"{task.root!r} (use family.rewrite to derive it)")
        self._swap(slot, task, reason, self.slots[slot].p)
        self.counts["rewritten"] += 1

    def _swap(self, slot: int, task: Task, reason: str, acc: float | None) -> None:
        self._log({"event": reason, "slot": slot, "old": self.slots[slot].task_id,
                   "new": task.task_id, "accuracy": acc})
        self.slots[slot] = _Evidence(task, self.window)
        self.out[slot] = 0
        self.history[slot] = (self.history[slot] + [task.task_id])[-100:]

    def _log(self, event: dict[str, Any]) -> None:
        self.replacements = (self.replacements + [{"group": self.groups, **event}])[-LOG_LIMIT:]

    def metrics(self) -> dict[str, float]:
        accs = self.slot_accuracy()
        known = [a for a in accs if a is not None]
        return {**super().metrics(), "slots": float(len(accs)),
                "in_band": float(sum(self.in_band(a) for a in known)),
                "unknown": float(len(accs) - len(known)),
                "out_of_band": float(sum(not self.in_band(a) for a in known)),
                "mean_accuracy": float(np.mean(known)) if known else math.nan,
                **{k: float(v) for k, v in self.counts.items()}}

    def _state(self) -> dict[str, Any]:
        return {"slots": [s.to_dict() for s in self.slots], "out": list(self.out),
                "history": self.history, "replacements": self.replacements,
                "counts": dict(self.counts)}

    def _restore(self, state: dict[str, Any]) -> None:
        self.slots = [_Evidence(Task.from_dict(s["task"]), self.window, s["groups"])
                      for s in state["slots"]]
        self.out = [int(x) for x in state["out"]]
        self.history = [list(h) for h in state["history"]]
        self.replacements = list(state["replacements"])
        self.counts = {k: int(v) for k, v in state["counts"].items()}


SAMPLERS: dict[str, type[TaskSampler]] = {
    cls.name: cls for cls in (UniformSampler, ALPGMMSampler, LearnabilitySampler,
                              AccuracyBandSampler)}


def _sampler_cls(name: str) -> type[TaskSampler]:
    if name not in SAMPLERS:
        raise ValueError(f"unknown task sampler {name!r}; expected one of: "
                         f"{', '.join(SAMPLERS)}")
    return SAMPLERS[name]


def make_sampler(name: str, family: TaskFamily, **kwargs: Any) -> TaskSampler:
    """The sampler called ``name`` (see ``SAMPLERS``) over ``family``."""
    return _sampler_cls(name)(family, **kwargs)


def sampler_from_state(family: TaskFamily, state: dict[str, Any]) -> TaskSampler:
    """The sampler ``state()`` described, restored exactly."""
    return _sampler_cls(state.get("sampler", "")).from_state(family, state)
