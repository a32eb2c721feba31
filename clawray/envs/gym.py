"""Any gymnasium environment with text observations as a clawray task family.

``make_family("gym:<env id>", **kwargs)`` builds ``GymTextFamily(env_id, **kwargs)``. The env
id is anything ``gymnasium.make`` accepts, including ``"my_package.module:MyEnv-v0"`` (gymnasium
imports the module first, which registers the env).

Mapping:

- a task is ``(params, seed)``: the env is reset with ``env.reset(seed=task.seed,
  options={"params": list(task.params)})`` when the family declares params (that is how the env
  receives its difficulty), plain ``env.reset(seed=task.seed)`` otherwise. The spec's goal is
  the first observation;
- observations become ``user`` messages: a ``str`` as-is, a dict's ``"text"`` entry, anything
  else ``str(obs)``;
- actions: for a ``spaces.Text`` action space the action's text is passed through (the env
  checks its own input); for ``spaces.Discrete`` the first integer in the text is the action,
  and a missing or out-of-range integer is an invalid action: the env is *not* stepped, the agent
  gets an error message, ``valid=False``, and one step is used. Other action spaces are refused
  at construction;
- success (when done): ``info["success"]`` when the env provides it, else the summed reward
  reaching ``success_reward``. Episodes end on ``terminated``, ``truncated`` or ``max_steps``;
- step oracle: ``progress = reward > 0`` for that step, a proxy (sparse-reward envs report
  progress only on the winning step);
- expert: the unwrapped env's ``expert_action()`` method when it has one;
- rewrite: every param moved by a quarter of its range (up for harder, down for easier), same
  seed.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Mapping, Sequence

from clawray.envs.base import (Action, Direction, EnvError, Param, StepResult, Task,
                               TaskFamily, TextEnv)

DEFAULT_SYSTEM_PROMPT = ("You are playing a text game. Read each observation and reply with "
                         "your next action only.")
_INT = re.compile(r"-?\d+")


def observation_text(obs: Any) -> str:
    """The text an observation shows the agent (see the module docstring)."""
    if isinstance(obs, str):
        return obs
    if isinstance(obs, Mapping) and "text" in obs:
        return str(obs["text"])
    return str(obs)


def _param(p: Param | Mapping[str, Any]) -> Param:
    if isinstance(p, Param):
        return p
    try:
        return Param(str(p["name"]), float(p["low"]), float(p["high"]), str(p.get("doc", "")))
    except (KeyError, TypeError, ValueError) as e:
        raise EnvError(f"gym params: each needs name, low and high, got {p!r} ({e})") from None


class GymTextFamily(TaskFamily):
    """A gymnasium env id (with ``Text`` or ``Discrete`` actions) as a task family."""

    tools = None

    def __init__(self, env_id: str, params: Sequence[Param | Mapping[str, Any]] = (),
                 make_kwargs: dict[str, Any] | None = None, success_reward: float = 1.0,
                 system_prompt: str = DEFAULT_SYSTEM_PROMPT, max_steps: int = 50) -> None:
        self.env_id = env_id
        self.name = f"gym:{env_id}"
        self.params = tuple(_param(p) for p in params)
        bad = [p.name for p in self.params if not p.low <= p.high]
        if bad:
            raise EnvError(f"{self.name}: params with low > high: {', '.join(bad)}")
        if max_steps < 1:
            raise EnvError(f"{self.name}: max_steps must be >= 1, got {max_steps}")
        self.make_kwargs = dict(make_kwargs or {})
        self.success_reward = float(success_reward)
        self.system_prompt = system_prompt
        self.max_steps = int(max_steps)
        self._probe = self.make_gym_env()  # checks the id and the action space now
        self._probe_lock = threading.Lock()

    def make_gym_env(self) -> Any:
        """A new gymnasium env of this family (``EnvError`` for unusable ids or spaces)."""
        import gymnasium
        from gymnasium import spaces

        try:
            env = gymnasium.make(self.env_id, **self.make_kwargs)
        except gymnasium.error.Error as e:
            raise EnvError(f"{self.name}: gymnasium cannot make {self.env_id!r}: {e}") from None
        if not isinstance(env.action_space, (spaces.Text, spaces.Discrete)):
            env.close()
            raise EnvError(f"{self.name}: action space {env.action_space} is not supported; "
                           "a text agent can drive gymnasium.spaces.Text or Discrete actions")
        return env

    def reset_gym_env(self, env: Any, task: Task) -> tuple[Any, dict[str, Any]]:
        """Reset ``env`` to ``task`` (difficulty params through ``options``)."""
        if self.params:
            return env.reset(seed=task.seed, options={"params": list(task.params)})
        return env.reset(seed=task.seed)

    def generate(self, params: Sequence[float], seed: int) -> Task:
        p = self.clip(params)
        task = Task(self.name, p, int(seed), {})
        with self._probe_lock:
            obs, _ = self.reset_gym_env(self._probe, task)
        return Task(self.name, p, int(seed), {"env_id": self.env_id, "params": list(p),
                                              "seed": int(seed),
                                              "goal": observation_text(obs)})

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        """Every param a quarter of its range up (harder) or down (easier), same seed."""
        if not self.params:
            raise EnvError(f"{self.name}: no difficulty params to rewrite along")
        if direction not in ("harder", "easier"):
            raise EnvError(f"{self.name}: direction must be 'harder' or 'easier', "
                           f"got {direction!r}")
        sign = 1.0 if direction == "harder" else -1.0
        old = self.clip(task.params)
        new = self.clip([x + sign * 0.25 * (p.high - p.low) for x, p in zip(old, self.params)])
        if new == old:
            raise EnvError(f"{self.name}: {task.task_id} is already the "
                           f"{'hardest' if sign > 0 else 'easiest'} in the box")
        return task.derived(new, self.generate(new, task.seed).spec)

    def make_env(self) -> "GymTextEnv":
        return GymTextEnv(self)


class GymTextEnv(TextEnv):
    """One episode at a time of a ``GymTextFamily``'s gymnasium env."""

    def __init__(self, family: GymTextFamily) -> None:
        self.family = family
        self._env: Any = None
        self._done = True

    def reset(self, task: Task) -> list[dict[str, Any]]:
        if task.family != self.family.name:
            raise EnvError(f"{self.family.name}: cannot play a task of family {task.family!r}")
        if self._env is None:
            self._env = self.family.make_gym_env()
        obs, _ = self.family.reset_gym_env(self._env, task)
        self._steps, self._return, self._done = 0, 0.0, False
        return [{"role": "system", "content": self.family.system_prompt},
                {"role": "user", "content": observation_text(obs)}]

    def _to_gym(self, action: Action) -> tuple[Any, str | None]:
        """The gym action for ``action``, or ``(None, error message)``."""
        from gymnasium import spaces

        space, text = self._env.action_space, action.text()
        if isinstance(space, spaces.Text):
            return text, None
        m = _INT.search(text)
        low, high = int(space.start), int(space.start) + int(space.n) - 1
        if m is None or not low <= int(m.group()) <= high:
            return None, (f"Invalid action {text[:80]!r}: answer with one integer from {low} "
                          f"to {high}.")
        return int(m.group()), None

    def step(self, action: Action | str) -> StepResult:
        if self._done:
            raise EnvError(f"{self.family.name}: step after the episode ended (call reset)")
        action = self.as_action(action)
        self._steps += 1
        gym_action, error = self._to_gym(action)
        out_of_steps = self._steps >= self.family.max_steps
        if error is not None:
            self._done = out_of_steps
            return StepResult([{"role": "user", "content": error}], done=out_of_steps,
                              progress=False, valid=False,
                              success=False if out_of_steps else None,
                              info={"reason": "out of steps"} if out_of_steps else {})
        obs, reward, terminated, truncated, info = self._env.step(gym_action)
        self._return += float(reward)
        self._done = bool(terminated or truncated or out_of_steps)
        success = None
        if self._done:
            success = (bool(info["success"]) if "success" in info
                       else self._return >= self.family.success_reward)
        return StepResult([{"role": "user", "content": observation_text(obs)}],
                          done=self._done, progress=float(reward) > 0, success=success,
                          info={"reward": float(reward), "return": self._return,
                                "terminated": bool(terminated), "truncated": bool(truncated)})

    def expert_action(self) -> Action:
        """The unwrapped env's ``expert_action()`` as an ``Action`` (``EnvError`` if none)."""
        if self._done:
            raise EnvError(f"{self.family.name}: the episode is over")
        expert = getattr(self._env.unwrapped, "expert_action", None)
        if not callable(expert):
            raise EnvError(f"{self.family.name}: this gym env has no expert "
                           "(its unwrapped env defines no expert_action())")
        a = expert()
        if not self._env.action_space.contains(a):
            raise EnvError(f"{self.family.name}: expert_action() returned {a!r}, "
                           f"not in {self._env.action_space}")
        return Action(content=str(a) if isinstance(a, str) else str(int(a)))

    def close(self) -> None:
        """Close the gymnasium env (a later ``reset`` makes a new one)."""
        if self._env is not None:
            self._env.close()
            self._env = None
