"""A toy task family and student for the curriculum tests (importable by Ray workers as
``tests.support.curriculum_toy:ToyFamily`` when tests/ is on their PYTHONPATH)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from clawray.envs.base import Action, Direction, Param, StepResult, Task, TaskFamily, TextEnv


class ToyEnv(TextEnv):
    """One step: answer with the goal's x + y (rounded to 3 places) to succeed."""

    def __init__(self) -> None:
        self.task: Task | None = None

    def reset(self, task: Task) -> list[dict[str, Any]]:
        self.task = task
        return [{"role": "system", "content": "Answer with x + y."},
                {"role": "user", "content": task.description}]

    def _answer(self) -> str:
        return f"{self.task.spec['x'] + self.task.spec['y']:.3f}"

    def step(self, action: Action | str) -> StepResult:
        ok = self.as_action(action).content.strip() == self._answer()
        return StepResult([], done=True, progress=ok, success=ok)

    def expert_action(self) -> Action:
        return Action(self._answer())


class ToyFamily(TaskFamily):
    """Two params in [0, 1]; the spec is the point itself."""

    name = "toy"
    params = (Param("x", 0.0, 1.0), Param("y", 0.0, 1.0))

    def generate(self, params: Sequence[float], seed: int) -> Task:
        x, y = self.clip(params)
        return Task(self.name, (x, y), int(seed),
                    {"goal": f"x = {x:.6f}, y = {y:.6f}", "x": x, "y": y})

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        step = 0.1 if direction == "harder" else -0.1
        x, y = self.clip([p + step for p in task.params])
        return task.derived((x, y), {"goal": f"x = {x:.6f}, y = {y:.6f}", "x": x, "y": y})

    def make_env(self) -> TextEnv:
        return ToyEnv()


class ToyStudent:
    """Competence grows only where it practices, and spreads to nearby tasks (as in
    test_alp_gmm): tasks with x < 0.3 and y < 0.5 (15 % of the box) are learnable, every other
    task always fails. An attempt adds a Gaussian bump (width 0.1) around the task on a 6 x 10
    grid over the learnable region; success probability is 1 - exp(-competence / 40)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        gx, gy = np.meshgrid((np.arange(6) + 0.5) * 0.05, (np.arange(10) + 0.5) * 0.05,
                             indexing="ij")
        self.cells = np.stack([gx.ravel(), gy.ravel()], axis=1)
        self.competence = np.zeros(len(self.cells))

    @staticmethod
    def learnable(x: Sequence[float]) -> bool:
        return bool(x[0] < 0.3 and x[1] < 0.5)

    def p_success(self, x: np.ndarray) -> float:
        if not self.learnable(x):
            return 0.0
        c = self.competence[int(np.argmin(np.linalg.norm(self.cells - x, axis=1)))]
        return float(1.0 - np.exp(-c / 40.0))

    def attempt(self, params: Sequence[float]) -> float:
        x = np.asarray(params, dtype=np.float64)
        ok = self.rng.random() < self.p_success(x)
        if self.learnable(x):
            self.competence += np.exp(-((self.cells - x) ** 2).sum(axis=1) / (2 * 0.1 ** 2))
        return float(ok)

    def mastery(self) -> float:
        """Mean success probability over the learnable region."""
        return float(np.mean(1.0 - np.exp(-self.competence / 40.0)))
