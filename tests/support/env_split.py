"""A one-step environment whose GRPO groups certainly carry signal, whatever the policy writes
(importable by Ray workers as ``tests.support.env_split:SplitFamily`` with the repository on
their PYTHONPATH).

The outcome of an episode is decided by the task, not by the model's sampling: the family
instance (one per runner) counts the episodes it has started of each task, and the ``k``-th
(from 0) succeeds iff ``k`` is even. A group is ``group_size`` episodes of one task started one
after the other (a runner starts a group's episodes together, and a retried group starts them
again): ``n`` consecutive counts, so a group of ``n >= 2`` episodes holds at least one success
and one failure, and a group of 4 exactly 2 and 2 (GRPO advantages +1 and -1, accuracy 0.5:
inside RLAnything's policy and RM bands, no rewrite). Every seed gives its own task, so two
groups in flight at once do not share a counter.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from clawray.envs.base import (
    Action,
    Direction,
    EnvError,
    Param,
    StepResult,
    Task,
    TaskFamily,
    TextEnv,
)


class SplitEnv(TextEnv):
    """One step; succeeds iff this is an even-numbered episode of its task (see module)."""

    def __init__(self, family: SplitFamily) -> None:
        self.family = family
        self.success: bool | None = None
        self.done = False

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        self.success = self.family.next_outcome(task)
        self.done = False
        return [{"role": "user", "content": task.description}]

    def step(self, action: Action | str) -> StepResult:
        if self.success is None or self.done:
            raise EnvError("split: step() before reset() or after the episode ended")
        self.as_action(action)  # parsed like any action; its content does not matter
        self.done = True
        ok = self.success
        return StepResult([{"role": "user", "content": "yes" if ok else "no"}], done=True,
                          progress=ok, success=ok)

    def expert_action(self) -> Action:
        return Action("ok")


class SplitFamily(TaskFamily):
    name = "split"
    params = (Param("x", 0.0, 1.0),)

    def __init__(self) -> None:
        self._started: Counter[str] = Counter()
        self._lock = threading.Lock()

    def next_outcome(self, task: Task) -> bool:
        """Whether the next episode of ``task`` succeeds (even-numbered ones do)."""
        with self._lock:
            k = self._started[task.task_id]
            self._started[task.task_id] += 1
        return k % 2 == 0

    def generate(self, params: Sequence[float], seed: int) -> Task:
        (x,) = self.clip(params)
        return Task(self.name, (x,), int(seed), {"goal": f"say something ({int(seed)})"})

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        return task.derived(task.params, {"goal": task.spec["goal"] + "!"})

    def make_env(self) -> TextEnv:
        return SplitEnv(self)
