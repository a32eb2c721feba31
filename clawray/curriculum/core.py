"""The curriculum's core: one task sampler serving leases of tasks to env runners.

``Curriculum`` is plain Python (testable without Ray); ``CurriculumActor`` in
``clawray/curriculum/actor.py`` is its Ray shell and ``get_or_create_curriculum`` the named
handle runners share.

- ``lease(runner_id, n)`` hands out ``n`` tasks (one GRPO group each) as
  ``{"lease_id", "task"}``; tasks of released leases come first (a retry queue), then the
  sampler's next tasks.
- ``report(lease_id, rewards, info)`` closes a lease: the sampler learns from the group, and
  each episode's difficulty (``family.difficulty``) and reward enter the recent-window metrics.
  A report of an unknown lease (already reported, released, or lost in a crash) is ignored
  and counted; it returns False.
- ``release(runner_id)``: a runner died; its open leases go to the front of the retry queue.
- ``metrics()``: counters, recent success, the sampled-difficulty histogram, the sampler's
  metrics (``sampler/...``) and a trajectory (every ``trajectory_every`` reports: episodes so
  far, mean recent difficulty, recent success) for plotting the curriculum.

Durability: the whole state (sampler, open leases, retry queue, metrics windows) is saved as
JSON (temp file + ``os.replace``) every ``checkpoint_every`` reports and on ``save()``, and
restored when the actor starts with an existing ``checkpoint_path``: the restored sampler
proposes exactly the tasks the old one would have. A crash loses what happened since the last
checkpoint: reports of leases open at the checkpoint count again (those leases are open in the
restored state), leases made after it are unknown to the restored actor (their reports return
False, and the sampler never learns from them).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from clawray.curriculum.samplers import (TaskSampler, difficulty_histogram, make_sampler,
                                         sampler_from_state)
from clawray.envs import Task, make_family
from clawray.files import write_json_atomic
from clawray.envs.base import Pooled, SubBox

logger = logging.getLogger(__name__)

STATE_VERSION = 1


class Curriculum:
    """The state behind ``CurriculumActor`` (no Ray)."""

    def __init__(self, family_name: str, family_kwargs: dict[str, Any] | None = None,
                 sampler: str = "alp_gmm", sampler_kwargs: dict[str, Any] | None = None,
                 checkpoint_path: str | None = None, checkpoint_every: int = 50,
                 window: int = 512, trajectory_every: int = 10, bins: int = 10,
                 max_difficulty: float = 1.0, pool: str | None = None) -> None:
        if checkpoint_every < 0 or window < 1 or trajectory_every < 1 or bins < 1:
            raise ValueError("checkpoint_every must be >= 0 and window, trajectory_every, bins "
                             f">= 1; got {checkpoint_every}, {window}, {trajectory_every}, {bins}")
        self.family_name, self.sampler_name = family_name, sampler
        self.family = make_family(family_name, **(family_kwargs or {}))
        if pool is not None:  # training draws only tasks of this pool (envs.task_pool)
            self.family = Pooled(self.family, pool)
        if max_difficulty < 1.0:
            self.family = SubBox(self.family, max_difficulty)
        self.checkpoint_path = checkpoint_path
        self.checkpoint_every, self.trajectory_every, self.bins = (
            checkpoint_every, trajectory_every, bins)
        self.leases: dict[str, dict[str, Any]] = {}  # lease_id → {"runner", "task"}, in order
        self.retry: collections.deque[dict[str, Any]] = collections.deque()  # task dicts
        self.difficulties: collections.deque[float] = collections.deque(maxlen=window)
        self.rewards: collections.deque[float] = collections.deque(maxlen=window)
        self.info: dict[str, collections.deque[float]] = {}
        self.trajectory: list[list[float]] = []
        self.counts = {"served": 0, "reported": 0, "retried": 0, "released": 0,
                       "unknown_reports": 0, "episodes": 0, "checkpoints": 0}
        self.window = window
        if checkpoint_path and Path(checkpoint_path).exists():
            self._load(json.loads(Path(checkpoint_path).read_text()), sampler_kwargs)
            logger.info("curriculum restored from %s after %d reports", checkpoint_path,
                        self.counts["reported"])
        else:
            self.sampler: TaskSampler = make_sampler(sampler, self.family,
                                                     **(sampler_kwargs or {}))

    # ---------------------------------------------------------------- serving

    def lease(self, runner_id: str, n: int = 1) -> list[dict[str, Any]]:
        """``n`` tasks for ``runner_id``: ``[{"lease_id": str, "task": task.to_dict()}]``."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        out = []
        for _ in range(n):
            if self.retry:
                task = self.retry.popleft()
                self.counts["retried"] += 1
            else:
                task = self.sampler.next_task().to_dict()
            lease_id = uuid.uuid4().hex
            self.leases[lease_id] = {"runner": runner_id, "task": task}
            self.counts["served"] += 1
            out.append({"lease_id": lease_id, "task": task})
        return out

    def report(self, lease_id: str, rewards: list[float],
               info: dict[str, Any] | None = None) -> bool:
        """The group's rewards in [0, 1] (one per episode). Numeric ``info`` entries (episode
        length, ...) are averaged over the recent window as ``info/<key>`` metrics."""
        lease = self.leases.get(lease_id)
        if lease is None:
            self.counts["unknown_reports"] += 1
            logger.warning("report of unknown lease %s ignored (reported twice, released, or "
                           "lost in a restart)", lease_id)
            return False
        task = Task.from_dict(lease["task"])
        self.sampler.update(task, rewards)  # validates the rewards before the lease is closed
        del self.leases[lease_id]
        d = self.family.difficulty(task)
        for r in rewards:
            self.difficulties.append(d)
            self.rewards.append(float(r))
        for k, v in (info or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self.info.setdefault(k, collections.deque(maxlen=self.window)).append(float(v))
        self.counts["reported"] += 1
        self.counts["episodes"] += len(rewards)
        if self.counts["reported"] % self.trajectory_every == 0:
            self.trajectory.append([float(self.counts["episodes"]),
                                    float(np.mean(self.difficulties)),
                                    float(np.mean(self.rewards))])
        if self.checkpoint_every and self.counts["reported"] % self.checkpoint_every == 0 \
                and self.checkpoint_path:
            self.save()
        return True

    def release(self, runner_id: str) -> int:
        """Put ``runner_id``'s open leases at the front of the retry queue; how many."""
        mine = [lid for lid, lease in self.leases.items() if lease["runner"] == runner_id]
        for lid in reversed(mine):  # keep their order at the front
            self.retry.appendleft(self.leases.pop(lid)["task"])
        self.counts["released"] += len(mine)
        return len(mine)

    def open_leases(self, runner_id: str | None = None) -> list[str]:
        return [lid for lid, lease in self.leases.items()
                if runner_id is None or lease["runner"] == runner_id]

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in self.counts.items()}
        out.update(open_leases=len(self.leases), retry_queue=len(self.retry),
                   success_rate=float(np.mean(self.rewards)) if self.rewards else math.nan,
                   mean_difficulty=(float(np.mean(self.difficulties)) if self.difficulties
                                    else math.nan),
                   difficulty_histogram=difficulty_histogram(self.difficulties, self.bins),
                   trajectory=[list(t) for t in self.trajectory])
        out.update({f"info/{k}": float(np.mean(v)) for k, v in self.info.items()})
        out.update({f"sampler/{k}": v for k, v in self.sampler.metrics().items()})
        return out

    # ---------------------------------------------------------------- checkpoints

    def state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "family": self.family_name,
                "sampler": self.sampler.state(), "leases": self.leases,
                "retry": list(self.retry), "difficulties": list(self.difficulties),
                "rewards": list(self.rewards), "info": {k: list(v) for k, v in self.info.items()},
                "trajectory": self.trajectory, "counts": self.counts}

    def save(self, path: str | None = None) -> str:
        """Write the state as JSON, atomically; returns the path."""
        path = path or self.checkpoint_path
        if not path:
            raise ValueError("no checkpoint path: pass one to save() or to the constructor")
        self.counts["checkpoints"] += 1
        return write_json_atomic(path, self.state())

    def _load(self, state: dict[str, Any], sampler_kwargs: dict[str, Any] | None) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{self.checkpoint_path}: unknown curriculum state version "
                             f"{state.get('version')!r}")
        saved = state["sampler"]
        if state["family"] != self.family_name or saved["sampler"] != self.sampler_name:
            raise ValueError(f"{self.checkpoint_path} holds a {saved['sampler']!r} curriculum "
                             f"over {state['family']!r}, not {self.sampler_name!r} over "
                             f"{self.family_name!r}")
        if sampler_kwargs and any(saved["config"].get(k) != v for k, v in
                                  sampler_kwargs.items()):
            logger.warning("sampler settings %s differ from the checkpoint's %s; the "
                           "checkpoint's are kept", sampler_kwargs, saved["config"])
        self.sampler = sampler_from_state(self.family, saved)
        self.leases = dict(state["leases"])
        self.retry = collections.deque(state["retry"])
        self.difficulties.extend(state["difficulties"])
        self.rewards.extend(state["rewards"])
        self.info = {k: collections.deque(v, maxlen=self.window)
                     for k, v in state["info"].items()}
        self.trajectory = [list(t) for t in state["trajectory"]]
        self.counts.update(state["counts"])
