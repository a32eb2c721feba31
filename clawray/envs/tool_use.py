"""Multi-step tool use: reach a verifiable number by calling a calculator and a lookup table.

A task is a word problem ("What is the total price, in coins, of 3 apples and 2 pears?") whose
numbers hide behind tools: ``lookup(name)`` reads the task's table, ``add`` / ``sub`` / ``mul``
compute on integers, and distractor tools (``weather``, ``convert``, ``translate``, ``clock``)
answer plausibly and uselessly. The optimal plan: every lookup, then each product, the running
sum, and the discount; the expert follows it and then answers "the answer is N".

Episode rules:

- an action with tool calls executes every call; each gets one ``tool`` message (the call's
  id) with the result, or ``error: ...`` for an unknown tool, missing / extra / ill-typed
  arguments, arguments that are not a JSON object, or an item not in the table (then
  ``valid=False``). A ``<tool_call>`` block that did not parse (it stays in the content) gets a
  ``user`` error message and ``valid=False``; it is not taken as the final answer;
- an action without tool calls is the final answer and ends the episode: success iff the *last*
  number in its text (``-?\\d+``, thousands commas and a decimal part allowed, e.g. "1,234" or
  "12.0") equals the answer;
- every action uses one step of ``spec['budget']`` (optimal steps + slack); running out ends the
  episode as a failure.

Step oracle: ``progress`` iff a call produced a value the plan still needed (a lookup of a plan
item not looked up yet, or an arithmetic result equal to a plan value not computed yet), or the
final answer is correct.

Difficulty params (in [0, 1], higher harder; each is rounded stochastically with the seed, which
also picks the flavour, items and numbers): ``steps`` (1 → 6 dependent tool calls),
``operands`` (table values of 1 → 3 digits), ``distractors`` (0 → 4 distractor tools),
``budget`` (slack of 4 → 1 steps beyond the optimum).

Tools differ per task (distractors), so ``ToolUseFamily.tools`` is the superset and each task
lists its own in ``spec['tools']``; ``ToolUseEnv.tools`` gives the current task's.
"""

from __future__ import annotations

import json
import math
import random
import re
import zlib
from typing import Any, Callable, Sequence

from clawray.envs.base import (Action, Direction, EnvError, Param, StepResult, Task,
                               TaskFamily, TextEnv)
from clawray.models.tool_calls import TOOL_CALL_START

NAME = "tool_use"
SYSTEM_PROMPT = ("Answer the user's question by calling the tools; the numbers you need come "
                 "from `lookup`. When you know the result, reply with the number and no tool "
                 "call.")
MAX_OPERAND = 10**15  # calculator arguments beyond this are rejected (no giant outputs)
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _schema(name: str, description: str, props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": list(props)}}}


_INT, _STR = {"type": "integer"}, {"type": "string"}
_UNITS = {"km": ("miles", 0.621371), "miles": ("km", 1.609344), "kg": ("lb", 2.204623),
          "lb": ("kg", 0.453592), "celsius": ("fahrenheit", None),
          "fahrenheit": ("celsius", None)}
CORE_TOOLS = [
    _schema("lookup", "Look up the number listed for an item in today's table (for example its "
            "unit price).", {"name": {"type": "string", "description": "the item, e.g. apple"}}),
    _schema("add", "Add two integers: a + b.", {"a": _INT, "b": _INT}),
    _schema("sub", "Subtract two integers: a - b.", {"a": _INT, "b": _INT}),
    _schema("mul", "Multiply two integers: a * b.", {"a": _INT, "b": _INT}),
]
DISTRACTOR_TOOLS = [
    _schema("weather", "The current weather in a city.", {"city": _STR}),
    _schema("convert", "Convert a quantity into another unit.",
            {"value": {"type": "number"}, "unit": {"type": "string", "enum": list(_UNITS)}}),
    _schema("translate", "Translate an English word into French.", {"word": _STR}),
    _schema("clock", "The current local time in a city.", {"city": _STR}),
]
_SCHEMAS = {t["function"]["name"]: t for t in CORE_TOOLS + DISTRACTOR_TOOLS}
_ARITH = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}

# flavour -> (question, discount clause, {item: plural})
FLAVOURS: dict[str, tuple[str, str, dict[str, str]]] = {
    "shop": ("What is the total price, in coins, of {items}{discount}?",
             ", after a discount of {c} coins",
             {w: w + "s" for w in ["apple", "pear", "banana", "orange", "lemon", "mango",
                                   "plum", "melon", "kiwi", "apricot"]}),
    "zoo": ("How many kilograms of food per day are needed for {items}{discount}?",
            ", not counting the {c} kg already in stock",
            {"lion": "lions", "zebra": "zebras", "bear": "bears", "camel": "camels",
             "panda": "pandas", "tiger": "tigers", "giraffe": "giraffes", "hippo": "hippos",
             "wolf": "wolves", "rhino": "rhinos"}),
    "warehouse": ("How many parcels fit in {items}{discount}?",
                  ", once {c} parcels have been shipped",
                  {"crate": "crates", "box": "boxes", "pallet": "pallets", "bag": "bags",
                   "bin": "bins", "carton": "cartons", "sack": "sacks", "tray": "trays",
                   "barrel": "barrels", "basket": "baskets"}),
}
_FRENCH = {"apple": "pomme", "pear": "poire", "lion": "lion", "box": "boîte", "bear": "ours",
           "water": "eau", "price": "prix", "total": "total", "number": "nombre"}


def _stoch_round(x: float, rng: random.Random, lo: int, hi: int) -> int:
    """``x`` rounded up with probability ``frac(x)``: the mean follows the continuous param."""
    return max(lo, min(hi, int(math.floor(x + rng.random()))))


def _shapes(n: int) -> list[tuple[int, int, int]]:
    """(items, multiplied items, discount) whose plan has ``n`` calls: 2k - 1 + m + c."""
    return [(k, m, c) for k in range(1, 5) for m in range(k + 1) for c in (0, 1)
            if 2 * k - 1 + m + c == n]


def _phrase(items: list[tuple[str, int]], plurals: dict[str, str]) -> str:
    words = [f"{q} {plurals[name]}" if q > 1 else f"one {name}" for name, q in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def build_spec(params: Sequence[float], rng: random.Random, flavour: str | None = None
               ) -> dict[str, Any]:
    """A task spec at clipped ``params``; all discrete choices come from ``rng``."""
    steps, operands, distractors, budget = params
    flavour = flavour or rng.choice(sorted(FLAVOURS))
    question, discount_text, plurals = FLAVOURS[flavour]
    n_calls = _stoch_round(1 + 5 * steps, rng, 1, 6)
    digits = _stoch_round(1 + 2 * operands, rng, 1, 3)
    n_distractors = _stoch_round(4 * distractors, rng, 0, 4)
    slack = _stoch_round(4 - 3 * budget, rng, 1, 4)
    k, m, c = rng.choice(_shapes(n_calls))
    names = rng.sample(sorted(plurals), min(len(plurals), k + rng.randint(2, 4)))
    lo, hi = max(2, 10 ** (digits - 1)), 10**digits - 1
    table = {name: rng.randint(lo, hi) for name in names}
    multiplied = set(rng.sample(range(k), m))
    items = [(names[i], rng.randint(2, 9) if i in multiplied else 1) for i in range(k)]
    plan: list[dict[str, Any]] = [{"tool": "lookup", "arguments": {"name": n}, "value": table[n]}
                                  for n, _ in items]
    terms = []
    for name, q in items:
        if q > 1:
            plan.append({"tool": "mul", "arguments": {"a": q, "b": table[name]},
                         "value": q * table[name]})
        terms.append(q * table[name])
    total = terms[0]
    for t in terms[1:]:
        plan.append({"tool": "add", "arguments": {"a": total, "b": t}, "value": total + t})
        total += t
    discount = ""
    if c:
        coupon = rng.randint(1, min(total - 1, hi))
        plan.append({"tool": "sub", "arguments": {"a": total, "b": coupon},
                     "value": total - coupon})
        total -= coupon
        discount = discount_text.format(c=coupon)
    tools = CORE_TOOLS + rng.sample(DISTRACTOR_TOOLS, n_distractors)
    rng.shuffle(tools)
    return {"goal": question.format(items=_phrase(items, plurals), discount=discount),
            "flavour": flavour, "items": [{"name": n, "quantity": q} for n, q in items],
            "table": table, "plan": plan, "answer": total, "tools": tools,
            "optimal_steps": len(plan) + 1, "budget": len(plan) + 1 + slack,
            "digits": digits, "slack": slack, "n_distractors": n_distractors}


def _hardness(spec: dict[str, Any]) -> int:
    """One integer that orders specs by difficulty (used by rewrites)."""
    return len(spec["plan"]) + spec["digits"] + spec["n_distractors"] - spec["slack"]


class ToolUseFamily(TaskFamily):
    """Word problems solved with a calculator, a lookup table and distractor tools."""

    name = NAME
    params = (
        Param("steps", 0.0, 1.0, "dependent tool calls: 1 → 6"),
        Param("operands", 0.0, 1.0, "digits of the table values: 1 → 3"),
        Param("distractors", 0.0, 1.0, "useless tools offered: 0 → 4"),
        Param("budget", 0.0, 1.0, "spare steps beyond the optimum: 4 → 1"),
    )
    tools = CORE_TOOLS + DISTRACTOR_TOOLS  # the superset; a task's own list is spec["tools"]

    def generate(self, params: Sequence[float], seed: int) -> Task:
        p = self.clip(params)
        return Task(NAME, p, int(seed), build_spec(p, random.Random(f"{NAME}:{int(seed)}")))

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        """Move every param by 0.25 and redraw (same flavour) until the task is strictly
        harder / easier by ``_hardness``; at the edge of the box the most extreme of 32 draws
        is returned. ``critique`` is ignored."""
        if direction not in ("harder", "easier"):
            raise EnvError(f"{NAME}: direction must be 'harder' or 'easier', got {direction!r}")
        sign = 1 if direction == "harder" else -1
        p = self.clip([x + sign * 0.25 for x in self.clip(task.params)])
        old = _hardness(task.spec)
        best: dict[str, Any] | None = None
        for attempt in range(32):
            rng = random.Random(f"{NAME}:{task.task_id}:{direction}:{seed}:{attempt}")
            spec = build_spec(p, rng, flavour=task.spec["flavour"])
            if best is None or sign * (_hardness(spec) - _hardness(best)) > 0:
                best = spec
            if sign * (_hardness(best) - old) > 0:
                break
        assert best is not None
        return task.derived(p, best)

    def make_env(self) -> "ToolUseEnv":
        return ToolUseEnv()


def _check_args(name: str, raw: Any) -> dict[str, Any]:
    """The call's arguments checked against its schema (raises ``EnvError`` with the reason)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise EnvError("arguments are not valid JSON") from None
    if not isinstance(raw, dict):
        raise EnvError("arguments must be a JSON object")
    props = _SCHEMAS[name]["function"]["parameters"]["properties"]
    missing = [k for k in props if k not in raw]
    extra = [k for k in raw if k not in props]
    if missing or extra:
        raise EnvError(f"{name} takes ({', '.join(props)}); "
                       + (f"missing {', '.join(missing)}" if missing else
                          f"unexpected {', '.join(extra)}"))
    args = {}
    for key, prop in props.items():
        v = raw[key]
        if prop["type"] == "integer":
            if isinstance(v, float) and v.is_integer():
                v = int(v)
            if isinstance(v, bool) or not isinstance(v, int) or abs(v) > MAX_OPERAND:
                raise EnvError(f"{key} must be an integer (|{key}| <= 10^15), got {v!r}")
        elif prop["type"] == "number":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise EnvError(f"{key} must be a number, got {v!r}")
        elif not isinstance(v, str) or not v.strip():
            raise EnvError(f"{key} must be a non-empty string, got {v!r}")
        if "enum" in prop and v not in prop["enum"]:
            raise EnvError(f"{key} must be one of {', '.join(prop['enum'])}, got {v!r}")
        args[key] = v
    return args


def _distractor(name: str, args: dict[str, Any]) -> str:
    """Plausible, useless, deterministic output of a distractor tool."""
    h = zlib.crc32(json.dumps([name, args], sort_keys=True).encode())
    if name == "weather":
        sky = ["sunny", "cloudy", "light rain", "windy", "foggy"][h % 5]
        return f"{args['city']}: {sky}, {h % 35 - 5} °C"
    if name == "clock":
        return f"{h % 24:02d}:{(h >> 5) % 60:02d} in {args['city']}"
    if name == "translate":
        word = args["word"].strip().lower()
        return f"{word} (fr): {_FRENCH.get(word, word + 'e')}"
    other, factor = _UNITS[args["unit"]]
    v = args["value"]
    out = v * factor if factor else (v * 9 / 5 + 32 if other == "fahrenheit" else (v - 32) * 5 / 9)
    return f"{v} {args['unit']} = {out:.2f} {other}"


def final_number(text: str) -> float | None:
    """The last number in ``text`` (the answer rule of the module docstring), or None."""
    found = _NUMBER.findall(text or "")
    return float(found[-1].replace(",", "")) if found else None


class ToolUseEnv(TextEnv):
    """One tool-use episode at a time (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self._task: Task | None = None
        self._spec: dict[str, Any] = {}
        self._done = True

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas of the current task (pass them to the chat template)."""
        if self._task is None:
            raise EnvError(f"{NAME}: call reset(task) before asking for its tools")
        return self._task.spec["tools"]

    def reset(self, task: Task) -> list[dict[str, Any]]:
        if task.family != NAME or "plan" not in task.spec:
            raise EnvError(f"{NAME}: cannot play a task of family {task.family!r}")
        self._task, self._spec = task, task.spec
        self._names = {t["function"]["name"] for t in task.spec["tools"]}
        self._needed = [True] * len(task.spec["plan"])  # plan calls not yet matched
        self._steps, self._done = 0, False
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": task.spec["goal"]}]

    def step(self, action: Action | str) -> StepResult:
        if self._done:
            raise EnvError(f"{NAME}: step after the episode ended (call reset)")
        action = self.as_action(action)
        self._steps += 1
        broken = TOOL_CALL_START in (action.content or "")
        if not action.tool_calls and not broken:
            return self._answer(action.content or "")
        messages, valid, progress = [], not broken, False
        for i, call in enumerate(action.tool_calls):
            fn = call.get("function") or {}
            try:
                result, new = self._execute(fn.get("name"), fn.get("arguments"))
            except EnvError as e:
                result, new, valid = f"error: {e}", False, False
            progress |= new
            messages.append({"role": "tool", "content": result,
                             "tool_call_id": call.get("id") or f"call_{self._steps}_{i}"})
        if broken:
            messages.append({"role": "user", "content": (
                'error: a <tool_call> block did not parse; write <tool_call>{"name": ..., '
                '"arguments": {...}}</tool_call> with valid JSON')})
        done = self._steps >= self._spec["budget"]
        self._done = done
        return StepResult(messages, done=done, progress=progress, valid=valid,
                          success=False if done else None,
                          info={"reason": "out of steps"} if done else {})

    def _answer(self, text: str) -> StepResult:
        given = final_number(text)
        ok = given is not None and given == self._spec["answer"]
        self._done = True
        return StepResult([], done=True, progress=ok, success=ok,
                          info={"reason": "answered", "given": given,
                                "answer": self._spec["answer"]})

    def _execute(self, name: Any, raw_args: Any) -> tuple[str, bool]:
        """Run one call: ``(result text, whether it produced a value the plan needed)``."""
        if name not in self._names:
            raise EnvError(f"unknown tool {name!r}; available: {', '.join(sorted(self._names))}")
        args = _check_args(name, raw_args)
        if name == "lookup":
            item = self._item(args["name"])
            return str(self._spec["table"][item]), self._mark(lambda s: s["tool"] == "lookup"
                                                              and s["arguments"]["name"] == item)
        if name in _ARITH:
            value = _ARITH[name](args["a"], args["b"])
            return str(value), self._mark(lambda s: s["tool"] != "lookup"
                                          and s["value"] == value)
        return _distractor(name, args), False

    def _item(self, raw: str) -> str:
        """The table entry ``raw`` names (case-insensitive, singular or plural)."""
        word = raw.strip().lower()
        plurals = FLAVOURS[self._spec["flavour"]][2]
        singular = {p: s for s, p in plurals.items()}.get(word, word)
        if singular not in self._spec["table"]:
            raise EnvError(f"no item {raw!r} in the table")
        return singular

    def _mark(self, matches: Callable[[dict[str, Any]], bool]) -> bool:
        """Mark the first still-needed plan call that ``matches``; whether there was one."""
        for j, step in enumerate(self._spec["plan"]):
            if self._needed[j] and matches(step):
                self._needed[j] = False
                return True
        return False

    def expert_action(self) -> Action:
        """The next call of the optimal plan still needed, then the final answer."""
        if self._done:
            raise EnvError(f"{NAME}: the episode is over")
        for j, step in enumerate(self._spec["plan"]):
            if self._needed[j]:
                return Action.call(step["tool"], step["arguments"],
                                   call_id=f"call_{self._steps}_{j}")
        return Action(content=f"the answer is {self._spec['answer']}")
