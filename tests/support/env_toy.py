"""A one-step environment that a random policy passes about half the time (importable by
Ray workers as ``tests.support.env_toy:ParityFamily`` with tests/ on their PYTHONPATH): GRPO groups of the
untrained tiny model then carry signal, so the env training loop can be tested end to end."""

from __future__ import annotations

from typing import Any, Sequence

from clawray.envs.base import Action, Direction, Param, StepResult, Task, TaskFamily, TextEnv


class ParityEnv(TextEnv):
    """Success iff the reply's length in characters is even."""

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        return [{"role": "user", "content": task.description}]

    def step(self, action: Action | str) -> StepResult:
        ok = len(self.as_action(action).content) % 2 == 0
        return StepResult([{"role": "user", "content": "yes" if ok else "no"}], done=True,
                          progress=ok, success=ok)

    def expert_action(self) -> Action:
        return Action("ok")


class ParityFamily(TaskFamily):
    name = "parity"
    params = (Param("x", 0.0, 1.0),)

    def generate(self, params: Sequence[float], seed: int) -> Task:
        (x,) = self.clip(params)
        return Task(self.name, (x,), int(seed), {"goal": f"say something ({seed % 97})"})

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        return task.derived(task.params, {"goal": task.spec["goal"] + "!"})

    def make_env(self) -> TextEnv:
        return ParityEnv()
