"""The text-environment protocol: task families, episodes, actions and step results.

An environment is two objects, close to gymnasium's split between a registered env id and an
``Env`` instance:

- a ``TaskFamily`` describes a family of verifiable tasks: its continuous difficulty box
  (``params``, what ALP-GMM samples in), ``generate(params, seed)`` (seeded: the same
  arguments give the same task), ``rewrite(task, direction, critique)`` (a harder or easier
  variant, used by RLAnything's environment adaptation), the OpenAI ``tools`` its episodes
  expose (``None`` for plain-text actions), and ``make_env()``;
- a ``TextEnv`` plays one episode at a time: ``reset(task) -> messages``,
  ``step(action) -> StepResult``, and ``expert_action()`` (the expert solver: an optimal
  action from the current state, used for demonstrations and SFT).

Observations are chat messages, so an episode's history is exactly what the policy sees:
``reset`` returns the opening messages (system, then user), each ``step`` returns the messages
the environment answers with (a ``user`` message, or ``tool`` messages answering the agent's
tool calls). Actions are what the model wrote: ``Action.from_text`` splits the text and the
``<tool_call>`` blocks the same way the serving path does.

Every ``StepResult`` carries the verifier outcome when the episode ends (``success``), and the
step oracle (``progress``: whether the action brought the goal closer). The oracle exists to
*evaluate* reward models; it is never used as a training reward unless a trainer says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from abc import ABC, abstractmethod
from typing import Any, Callable, Literal, Sequence

import numpy as np

from clawray.models.tool_calls import parse_tool_calls

Direction = Literal["harder", "easier"]


class EnvError(ValueError):
    """A task or an environment was used wrongly (bad params, step after done, ...)."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One axis of a family's difficulty box; higher values are harder."""

    name: str
    low: float
    high: float
    doc: str = ""


def spec_digest(family: str, spec: dict[str, Any]) -> str:
    """A stable id for a task's content (same family and spec → same id)."""
    blob = json.dumps([family, spec], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class Task:
    """One concrete task: everything an env needs to ``reset`` to it (JSON-able).

    ``params`` is the point in the family's difficulty box it was generated from (a rewrite
    moves it); ``spec`` is the full, family-specific description; ``root_id`` is the task a
    chain of rewrites started from (``None`` for a generated task) and ``depth`` the number of
    rewrites since.
    """

    family: str
    params: tuple[float, ...]
    seed: int
    spec: dict[str, Any]
    root_id: str | None = None
    depth: int = 0

    @property
    def task_id(self) -> str:
        return f"{self.family}-{spec_digest(self.family, self.spec)}"

    @property
    def root(self) -> str:
        return self.root_id or self.task_id

    @property
    def description(self) -> str:
        """The goal in words (every family puts it in ``spec['goal']``)."""
        return str(self.spec.get("goal", ""))

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "params": list(self.params), "seed": self.seed,
                "spec": self.spec, "root_id": self.root_id, "depth": self.depth}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Task":
        return cls(family=d["family"], params=tuple(float(x) for x in d["params"]),
                   seed=int(d["seed"]), spec=d["spec"], root_id=d.get("root_id"),
                   depth=int(d.get("depth", 0)))

    def derived(self, params: Sequence[float], spec: dict[str, Any]) -> "Task":
        """A rewrite of this task (root kept, depth + 1)."""
        return Task(self.family, tuple(float(x) for x in params), self.seed, spec,
                    root_id=self.root, depth=self.depth + 1)


@dataclasses.dataclass
class Action:
    """What the agent did: its text and its OpenAI-format tool calls (``function`` entries)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @classmethod
    def from_text(cls, text: str) -> "Action":
        """Parse a completion the way serving does (``<tool_call>`` blocks → tool calls)."""
        content, calls = parse_tool_calls(text)
        return cls(content or "", [c.to_openai() for c in calls])

    @classmethod
    def call(cls, name: str, arguments: dict[str, Any], call_id: str | None = None) -> "Action":
        """An action that is one tool call (the expert solvers of tool families use it)."""
        cid = call_id or f"call_{hashlib.sha1(json.dumps([name, arguments], sort_keys=True).encode()).hexdigest()[:12]}"
        return cls("", [{"id": cid, "type": "function",
                         "function": {"name": name, "arguments": json.dumps(arguments)}}])

    def message(self) -> dict[str, Any]:
        """The assistant message this action adds to the history."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        else:
            msg["content"] = self.content
        return msg

    def text(self) -> str:
        """The completion text a model would write for this action (for SFT targets)."""
        parts = [self.content] if self.content else []
        for call in self.tool_calls:
            fn = call["function"]
            args = fn.get("arguments") or "{}"
            parts.append('<tool_call>\n{"name": ' + json.dumps(fn["name"]) + ', "arguments": '
                         + (args if isinstance(args, str) else json.dumps(args))
                         + "}\n</tool_call>")
        return "\n".join(parts)


@dataclasses.dataclass
class StepResult:
    """The environment's answer to one action."""

    messages: list[dict[str, Any]]  # appended to the history (role "user" or "tool")
    done: bool
    progress: bool  # step oracle: the action brought the goal closer
    valid: bool = True  # the action was well-formed and admissible
    success: bool | None = None  # verifier outcome, set when done
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class TextEnv(ABC):
    """One episode at a time (not thread-safe; a runner makes one per concurrent episode)."""

    @abstractmethod
    def reset(self, task: Task) -> list[dict[str, Any]]:
        """Start ``task``; return the opening messages (system and user)."""

    @abstractmethod
    def step(self, action: Action | str) -> StepResult:
        """Apply the agent's action (an ``Action`` or raw completion text)."""

    @abstractmethod
    def expert_action(self) -> Action:
        """An optimal action from the current state (raises ``EnvError`` when done)."""

    @staticmethod
    def as_action(action: Action | str) -> Action:
        return action if isinstance(action, Action) else Action.from_text(action)


class TaskFamily(ABC):
    """A seeded generator of verifiable tasks with a continuous difficulty box."""

    name: str = ""
    params: tuple[Param, ...] = ()
    tools: list[dict[str, Any]] | None = None

    @abstractmethod
    def generate(self, params: Sequence[float], seed: int) -> Task:
        """The task at ``params`` (clipped to the box) with discrete variation from ``seed``."""

    @abstractmethod
    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        """A valid, solvable task that is harder or easier than ``task`` (root kept).

        ``critique`` (a summary of failed rollouts) may steer the change; built-in families
        change the task programmatically and may ignore it."""

    @abstractmethod
    def make_env(self) -> TextEnv:
        """A fresh environment instance for one episode at a time."""

    # ------------------------------------------------------------------ shared helpers

    @property
    def low(self) -> np.ndarray:
        return np.array([p.low for p in self.params], dtype=np.float64)

    @property
    def high(self) -> np.ndarray:
        return np.array([p.high for p in self.params], dtype=np.float64)

    def clip(self, params: Sequence[float]) -> tuple[float, ...]:
        p = np.asarray(params, dtype=np.float64).reshape(-1)
        if p.shape[0] != len(self.params):
            raise EnvError(f"{self.name}: expected {len(self.params)} params "
                           f"({', '.join(x.name for x in self.params)}), got {p.shape[0]}")
        if not np.all(np.isfinite(p)):
            raise EnvError(f"{self.name}: params must be finite, got {p.tolist()}")
        return tuple(float(x) for x in np.clip(p, self.low, self.high))

    def normalized(self, params: Sequence[float]) -> np.ndarray:
        """``params`` mapped to [0, 1] per axis (0 = easiest)."""
        span = np.where(self.high > self.low, self.high - self.low, 1.0)
        return (np.asarray(params, dtype=np.float64) - self.low) / span

    def difficulty(self, task: Task) -> float:
        """One number in [0, 1] for histograms: the mean normalized param."""
        if not self.params:
            return 0.0
        return float(np.mean(self.normalized(task.params)))

    def sample(self, rng: random.Random | np.random.Generator) -> Task:
        """A task at uniform params with a random seed."""
        if isinstance(rng, random.Random):
            params = [rng.uniform(p.low, p.high) for p in self.params]
            seed = rng.randrange(2**31)
        else:
            params = rng.uniform(self.low, self.high).tolist() if self.params else []
            seed = int(rng.integers(2**31))
        return self.generate(params, seed)


class SubBox(TaskFamily):
    """``family`` with its difficulty box cut to the lower ``fraction`` of every axis (a
    curriculum that should stay within a range: ``curriculum.max_difficulty``)."""

    def __init__(self, family: TaskFamily, fraction: float) -> None:
        if not 0 < fraction <= 1:
            raise EnvError(f"a sub-box fraction must be in (0, 1], got {fraction}")
        self.inner, self.fraction = family, fraction
        self.name, self.tools = family.name, family.tools
        self.params = tuple(dataclasses.replace(p, high=p.low + (p.high - p.low) * fraction)
                            for p in family.params)

    def generate(self, params: Sequence[float], seed: int) -> Task:
        return self.inner.generate(self.clip(params), seed)

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        return self.inner.rewrite(task, direction, critique, seed)

    def make_env(self) -> TextEnv:
        return self.inner.make_env()

    def difficulty(self, task: Task) -> float:
        return self.inner.difficulty(task)  # on the full box's scale


@dataclasses.dataclass
class Demonstration:
    """One expert episode: the history before each action, and the action."""

    task: Task
    steps: list[tuple[list[dict[str, Any]], Action]]
    success: bool


POOLS = ("train", "validation", "test")
POOL_TRIES = 256  # seeds tried for a task of the wanted pool (a held-out pool is 1 in 10)


def task_pool(task: Task) -> str:
    """The pool a task's *content* belongs to: ``test`` for one tenth of all contents,
    ``validation`` for another tenth (by the spec's digest), ``train`` for the rest. Fixed by
    content, so a task of a held-out pool is never a training task, whichever seed, sampler
    or rewrite produced it (seed streams alone are not: 2 of 100 held-out household tasks
    appeared among 20,000 training draws)."""
    h = int(spec_digest(task.family, task.spec), 16) % 10
    return "test" if h == 0 else "validation" if h == 1 else "train"


class Pooled(TaskFamily):
    """``family`` restricted to the tasks of one pool (``task_pool``): ``generate(params,
    seed)`` tries ``seed``, ``seed + 1``, ... until the task is of the pool (deterministic);
    a rewrite is retried with the next seeds the same way and refused (``EnvError``) if none
    lands in the pool. Training samplers, warm starts and the environment adapter draw from
    ``Pooled(family, "train")``; evaluations from ``validation`` or ``test``."""

    def __init__(self, family: TaskFamily, pool: str) -> None:
        if pool not in POOLS:
            raise EnvError(f"unknown task pool {pool!r}; pools: {', '.join(POOLS)}")
        self.inner, self.pool = family, pool
        self.name, self.tools, self.params = family.name, family.tools, family.params

    def _first(self, make: Callable[[int], Task], seed: int, what: str) -> Task:
        for k in range(POOL_TRIES):
            task = make(seed + k)
            if task_pool(task) == self.pool:
                return task
        raise EnvError(f"{self.name}: no {what} in the {self.pool!r} pool after {POOL_TRIES} "
                       "seeds (does the family's task vary with its seed?)")

    def generate(self, params: Sequence[float], seed: int) -> Task:
        return self._first(lambda s: self.inner.generate(params, s), seed, "task")

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        return self._first(lambda s: self.inner.rewrite(task, direction, critique, s), seed,
                           "rewrite")

    def make_env(self) -> TextEnv:
        return self.inner.make_env()

    def difficulty(self, task: Task) -> float:
        return self.inner.difficulty(task)


def demo_tasks(family: TaskFamily, n: int, max_difficulty: float, seed: int,
               pool: str | None = None) -> list[Task]:
    """``n`` seeded tasks with params in the lower ``max_difficulty`` share of each axis, of
    ``pool`` when given (``task_pool``)."""
    if pool is not None:
        family = Pooled(family, pool)
    rng = random.Random(seed)
    low, high = family.low, family.high
    top = low + (high - low) * max_difficulty
    return [family.generate([rng.uniform(a, b) for a, b in zip(low, top)], rng.randrange(2**31))
            for _ in range(n)]


def demonstrate(family: TaskFamily, task: Task, max_steps: int = 100) -> Demonstration:
    """Play ``task`` with the family's expert solver."""
    env = family.make_env()
    history = env.reset(task)
    steps: list[tuple[list[dict[str, Any]], Action]] = []
    for _ in range(max_steps):
        action = env.expert_action()
        steps.append(([dict(m) for m in history], action))
        result = env.step(action)
        history = history + [action.message()] + result.messages
        if result.done:
            return Demonstration(task, steps, bool(result.success))
    raise EnvError(f"{family.name}: the expert did not finish {task.task_id} in {max_steps} "
                   "steps")
