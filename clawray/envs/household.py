"""A household task family in the spirit of AlfWorld ("put a clean mug in cabinet 1").

Sized for a tiny policy (2 layers, byte-level BPE): short lowercase words, fixed action
templates, and Markov observations (every message re-describes the whole visible state, so the
right action follows from the current message alone).

World. Numbered receptacles of three sorts: open storage (countertop, shelf, table), closed
storage (cabinet, drawer: ``open`` one before you see, take or put inside; it then stays open)
and appliances that hold nothing (sinkbasin 1 cleans, microwave 1 heats, fridge 1 cools).
Objects have a type and a number (mug 1, apple 2) and a state: dishes (mug, plate, bowl, cup,
pan) are dirty or clean, food (apple, potato, egg, tomato, bread) is plain, hot or cold. The
agent starts in the room, holding nothing, and holds at most one object. The goal is
``put a [clean|hot|cold] <type> in <receptacle>``; any object of that type satisfies it once it
has the state and lies in the target (as in AlfWorld).

Actions (matching ignores case, surrounding and repeated spaces and a trailing period):
``go to <r>``, ``open <r>``, ``take <o> from <r>``, ``put <o> in <r>``,
``clean <o> with sinkbasin 1``, ``heat <o> with microwave 1``, ``cool <o> with fridge 1``.
Each message lists the admissible ones: ``go to`` every other receptacle, plus what can be done
where the agent stands. Anything else answers "nothing happens." and still costs a step.

Difficulty (each axis in [0, 1], higher is harder; a value maps to a discrete count):
``receptacles`` 3 → 10; ``distractors`` 0 → 8 extra objects (with a transform goal some are
more objects of the goal type in the wrong state); ``substeps`` below 1/3 pick & place, then
one transform, from 2/3 also every object of the goal type hidden in closed storage;
``budget`` the step limit is the optimal plan length plus a slack of 6 → 1. The seed picks the
goal type, target and layout, from separate random streams so that a rewrite moving one axis
keeps the goal (the adjective comes and goes with the transform).

Oracle. ``plan`` gives an optimal action sequence in closed form: for each object of the goal
type, reach its receptacle, open it if closed, put down what is held, take it, transform it if
needed, go to the target, open it if closed, put it; each of these actions is necessary, so the
shortest such plan is optimal (the tests check it against breadth-first search). The expert
plays its first action; a step makes ``progress`` iff the optimal remaining length drops.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Any, Sequence

from clawray.envs.base import (Action, Direction, EnvError, Param, StepResult, Task, TaskFamily,
                               TextEnv)

DISHES = ("mug", "plate", "bowl", "cup", "pan")
FOOD = ("apple", "potato", "egg", "tomato", "bread")
OPEN = ("countertop", "shelf", "table")
CLOSED = ("cabinet", "drawer")
STORAGE = OPEN + CLOSED
# appliance kind -> (verb, resulting state, object types it applies to)
APPLIANCES = {"sinkbasin": ("clean", "clean", DISHES), "microwave": ("heat", "hot", FOOD),
              "fridge": ("cool", "cold", FOOD)}
APPLIANCE_FOR = {"clean": "sinkbasin", "hot": "microwave", "cold": "fridge"}
KIND_ORDER = STORAGE + tuple(APPLIANCES)
FILLERS = ("countertop", "countertop", "cabinet", "cabinet", "drawer", "shelf", "table",
           "sinkbasin", "microwave", "fridge")
SYSTEM = "you are a house robot. answer with one action from the list, exactly as written."
MAX_RECEPTACLES, MAX_DISTRACTORS, MAX_SLACK = 10, 8, 6


def _kind(receptacle: str) -> str:
    return receptacle.rsplit(" ", 1)[0]


def _pick(seq: Sequence[Any], u: float) -> Any:
    """The element of ``seq`` a uniform draw ``u`` in [0, 1) selects (keeps streams fixed)."""
    return seq[min(int(u * len(seq)), len(seq) - 1)]


def normalize(text: str) -> str:
    """Lowercase, single spaces, no surrounding space or trailing period."""
    return re.sub(r"\s+", " ", text.strip().lower()).rstrip(".").strip()


@dataclasses.dataclass
class Obj:
    type: str
    state: str | None  # dirty/clean for dishes; None (plain)/hot/cold for food
    at: str | None  # a receptacle, or None while held


@dataclasses.dataclass(frozen=True)
class Goal:
    type: str
    state: str | None  # None: pick & place
    target: str

    @property
    def text(self) -> str:
        return f"put a {self.state + ' ' if self.state else ''}{self.type} in {self.target}"


@dataclasses.dataclass
class World:
    """The full state: receptacles (name → closed storage?), objects, agent position."""

    receptacles: dict[str, bool]
    objects: dict[str, Obj]
    opened: set[str] = dataclasses.field(default_factory=set)
    at: str | None = None
    held: str | None = None

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "World":
        return cls({r["name"]: bool(r["closed"]) for r in spec["receptacles"]},
                   {o["name"]: Obj(o["type"], o["state"], o["at"]) for o in spec["objects"]})

    def copy(self) -> "World":
        return World(dict(self.receptacles),
                     {k: dataclasses.replace(o) for k, o in self.objects.items()},
                     set(self.opened), self.at, self.held)

    def is_shut(self, receptacle: str) -> bool:
        return self.receptacles[receptacle] and receptacle not in self.opened

    def contents(self, receptacle: str) -> list[str]:
        return sorted(n for n, o in self.objects.items() if o.at == receptacle)

    def label(self, name: str) -> str:
        state = self.objects[name].state
        return f"{name} ({state})" if state else name


def admissible(w: World) -> list[str]:
    """The actions possible now: go to any other receptacle, and what can be done here."""
    acts = [f"go to {r}" for r in w.receptacles if r != w.at]
    here = w.at
    if here is None:
        return acts
    kind = _kind(here)
    if kind in APPLIANCES:
        verb, result, types = APPLIANCES[kind]
        held = w.objects[w.held] if w.held else None
        if held and held.type in types and held.state != result:
            acts.append(f"{verb} {w.held} with {here}")
    elif w.is_shut(here):
        acts.append(f"open {here}")
    elif w.held:
        acts.append(f"put {w.held} in {here}")
    else:
        acts += [f"take {o} from {here}" for o in w.contents(here)]
    return acts


def apply(w: World, action: str) -> None:
    """Apply an admissible action (from ``admissible``) to ``w`` in place."""
    if action.startswith("go to "):
        w.at = action[len("go to "):]
    elif action.startswith("open "):
        w.opened.add(action[len("open "):])
    elif action.startswith("take "):
        w.held = action[len("take "):].split(" from ")[0]
        w.objects[w.held].at = None
    elif action.startswith("put "):
        name, receptacle = action[len("put "):].split(" in ")
        w.objects[name].at, w.held = receptacle, None
    else:  # a transform: "<verb> <obj> with <appliance>"
        name, appliance = action.split(" ", 1)[1].split(" with ")
        w.objects[name].state = APPLIANCES[_kind(appliance)][1]


def satisfied(w: World, g: Goal) -> bool:
    return any(o.type == g.type and o.at == g.target and (g.state is None or o.state == g.state)
               for o in w.objects.values())


def _plan_with(w: World, g: Goal, name: str) -> list[str] | None:
    """The shortest plan that delivers object ``name`` (None if it cannot reach the state)."""
    obj, steps, at, opened = w.objects[name], [], w.at, set(w.opened)

    def go(r: str) -> None:
        nonlocal at
        if at != r:
            steps.append(f"go to {r}")
            at = r

    def open_(r: str) -> None:
        if w.receptacles[r] and r not in opened:
            steps.append(f"open {r}")
            opened.add(r)

    if w.held != name:
        go(obj.at)
        open_(obj.at)
        if w.held:
            steps.append(f"put {w.held} in {obj.at}")
        steps.append(f"take {name} from {obj.at}")
    if g.state is not None and obj.state != g.state:
        appliance = f"{APPLIANCE_FOR[g.state]} 1"
        if appliance not in w.receptacles or obj.type not in APPLIANCES[_kind(appliance)][2]:
            return None
        go(appliance)
        steps.append(f"{APPLIANCES[_kind(appliance)][0]} {name} with {appliance}")
    go(g.target)
    open_(g.target)
    steps.append(f"put {name} in {g.target}")
    return steps


def plan(w: World, g: Goal) -> list[str]:
    """An optimal action sequence from ``w`` to the goal ([] once it holds)."""
    if satisfied(w, g):
        return []
    plans = [p for n in sorted(w.objects) if w.objects[n].type == g.type
             for p in [_plan_with(w, g, n)] if p is not None]
    if not plans:
        raise EnvError(f"household: no object can satisfy {g.text!r}")
    return min(plans, key=len)


def render(w: World, g: Goal, actions: bool = True) -> str:
    """One observation: the task, every storage receptacle's visible state, position, actions."""
    seen = []
    for r in w.receptacles:
        if _kind(r) in APPLIANCES:
            continue
        items = ", ".join(w.label(o) for o in w.contents(r))
        seen.append(f"{r}: {'closed' if w.is_shut(r) else items or 'empty'}.")
    where = f"you are at {w.at}." if w.at else "you are in the room."
    hold = f"you hold {w.label(w.held)}." if w.held else "you hold nothing."
    lines = [f"task: {g.text}.", " ".join(seen), f"{where} {hold}"]
    if actions:
        lines.append("actions: " + " | ".join(admissible(w)))
    return "\n".join(lines)


def counts(params: Sequence[float]) -> tuple[int, int, int, int]:
    """Clipped params → (receptacles, distractors, substep level 0-2, budget slack)."""
    r, d, s, b = params
    return (3 + int(7 * r + 0.5), int(8 * d + 0.5), min(2, int(3 * s + 1e-9)),
            MAX_SLACK - int(5 * b + 0.5))


def grid(axis: int, count: int) -> float:
    """The smallest param value on ``axis`` whose count (as ``counts`` gives it) is ``count``."""
    return [(count - 3) / 7, count / 8, count / 3, (MAX_SLACK - count) / 5][axis]


def _wrong_state(state: str, u: float) -> str | None:
    return _pick({"clean": ("dirty",), "hot": (None, "cold"), "cold": (None, "hot")}[state], u)


def _any_state(otype: str, u: float) -> str | None:
    return _pick(("dirty", "clean") if otype in DISHES else (None, "hot", "cold"), u)


def build_spec(params: Sequence[float], seed: int) -> dict[str, Any]:
    """The task spec at clipped ``params``: goal, receptacles, objects and step budget."""
    n_recep, n_distr, level, slack = counts(params)
    g = random.Random(f"household/goal/{seed}")
    ug = [g.random() for _ in range(4)]
    otype = _pick(DISHES + FOOD, ug[0])
    state = None if level == 0 else "clean" if otype in DISHES else _pick(("hot", "cold"), ug[1])
    source_kind = _pick(CLOSED if level == 2 else OPEN, ug[3])
    kinds = [_pick(STORAGE, ug[2]), source_kind] + ([APPLIANCE_FOR[state]] if state else [])
    lay = random.Random(f"household/layout/{seed}")
    fillers = [_pick(FILLERS, lay.random()) for _ in range(MAX_RECEPTACLES)]
    for kind in fillers[:n_recep - len(kinds)]:
        kinds.append("countertop" if kind in APPLIANCES and kind in kinds else kind)
    names = [f"{k} {kinds[:i + 1].count(k)}" for i, k in enumerate(kinds)]
    target, source = names[0], names[1]
    storage = [n for n in names if _kind(n) in STORAGE]
    hide = [n for n in storage if n != target and (level < 2 or _kind(n) in CLOSED)]

    rng = random.Random(f"household/objects/{seed}")
    u = [[rng.random() for _ in range(4)] for _ in range(MAX_DISTRACTORS + 1)]
    first = _wrong_state(state, u[0][0]) if state else _any_state(otype, u[0][0])
    objs = [(otype, first, source)]
    others = tuple(t for t in DISHES + FOOD if t != otype)
    for ui in u[1:n_distr + 1]:
        if state and ui[0] < 0.3:  # another object of the goal type, also in the wrong state
            objs.append((otype, _wrong_state(state, ui[1]), _pick(hide, ui[2])))
        else:
            t = _pick(others, ui[1])
            objs.append((t, _any_state(t, ui[2]), _pick(storage, ui[3])))
    numbers: dict[str, list[int]] = {}
    for t in sorted({o[0] for o in objs}):
        numbers[t] = list(range(1, sum(o[0] == t for o in objs) + 1))
        rng.shuffle(numbers[t])
    objects = sorted(({"name": f"{t} {numbers[t].pop()}", "type": t, "state": st, "at": at}
                      for t, st, at in objs), key=lambda o: o["name"])
    order = sorted(names, key=lambda n: (KIND_ORDER.index(_kind(n)), int(n.rsplit(" ", 1)[1])))
    goal = Goal(otype, state, target)
    spec = {"goal": goal.text, "type": otype, "state": state, "target": target,
            "receptacles": [{"name": n, "closed": _kind(n) in CLOSED} for n in order],
            "objects": objects}
    optimal = len(plan(World.from_spec(spec), goal))
    return {**spec, "optimal": optimal, "budget": optimal + slack}


class HouseholdEnv(TextEnv):
    """One household episode at a time; ``world`` and ``goal`` are public for inspection."""

    def __init__(self) -> None:
        self.world: World | None = None
        self.goal: Goal | None = None
        self.budget, self.steps, self.done = 0, 0, False

    def reset(self, task: Task) -> list[dict[str, Any]]:
        spec = task.spec
        self.world = World.from_spec(spec)
        self.goal = Goal(spec["type"], spec["state"], spec["target"])
        self.budget, self.steps, self.done = int(spec["budget"]), 0, False
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": render(self.world, self.goal)}]

    def _live(self) -> tuple[World, Goal]:
        if self.world is None or self.goal is None:
            raise EnvError("household: call reset(task) before step or expert_action")
        if self.done:
            raise EnvError("household: the episode is over; call reset(task) for a new one")
        return self.world, self.goal

    def step(self, action: Action | str) -> StepResult:
        w, g = self._live()
        act = self.as_action(action)
        text = normalize(act.content) if not act.tool_calls else ""
        before = len(plan(w, g))
        valid = text in admissible(w)
        if valid:
            apply(w, text)
        self.steps += 1
        success = satisfied(w, g)
        left = len(plan(w, g))
        self.done = success or self.steps >= self.budget
        feedback = ("you did it.\n" if success else "out of steps.\n" if self.done
                    else "" if valid else "nothing happens.\n")
        message = feedback + render(w, g, actions=not self.done)
        return StepResult([{"role": "user", "content": message}], self.done,
                          progress=valid and left < before, valid=valid,
                          success=success if self.done else None,
                          info={"action": text, "steps": self.steps, "budget": self.budget,
                                "optimal_left": left})

    def expert_action(self) -> Action:
        w, g = self._live()
        return Action(content=plan(w, g)[0])


class HouseholdFamily(TaskFamily):
    """AlfWorld-style household tasks with plain-text actions (see the module docstring)."""

    name = "household"
    tools = None
    params = (
        Param("receptacles", 0.0, 1.0, "number of receptacles, 3 → 10"),
        Param("distractors", 0.0, 1.0, "extra objects, 0 → 8"),
        Param("substeps", 0.0, 1.0, "pick & place → + transform → + hidden in closed storage"),
        Param("budget", 0.0, 1.0, "step slack over the optimal plan, 6 → 1"),
    )

    def generate(self, params: Sequence[float], seed: int) -> Task:
        clipped = self.clip(params)
        return Task(self.name, clipped, int(seed), build_spec(clipped, int(seed)))

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        """Move one axis (chosen by ``seed``) one count harder or easier and regenerate.

        The goal's type and target come from the task's own seed, so they stay; the state
        adjective appears or goes when ``substeps`` crosses pick & place. Raises ``EnvError``
        when every axis is already at the box limit in that direction. ``critique`` is unused."""
        if direction not in ("harder", "easier"):
            raise EnvError(f"household: direction must be 'harder' or 'easier', got {direction!r}")
        now = counts(self.clip(task.params))
        step = 1 if direction == "harder" else -1
        limits = [(3, MAX_RECEPTACLES), (0, MAX_DISTRACTORS), (0, 2), (MAX_SLACK, 1)]
        movable = [i for i, (lo, hi) in enumerate(limits)
                   if now[i] != (hi if direction == "harder" else lo)]
        if not movable:
            raise EnvError(f"household: {task.task_id} is already the {direction}st task of "
                           "the family (every axis at its limit)")
        axis = random.Random(f"{task.task_id}/{direction}/{seed}").choice(movable)
        new = list(task.params)
        new[axis] = grid(axis, now[axis] + (step if axis < 3 else -step))
        new_params = self.clip(new)
        return task.derived(new_params, build_spec(new_params, task.seed))

    def make_env(self) -> HouseholdEnv:
        return HouseholdEnv()
