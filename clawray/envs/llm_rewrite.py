"""LLM-driven task rewrites: an environment model proposes difficulty params, never a task.

RLAnything's environment adaptation asks a language model for a harder or easier variant of a
task, given a critique of the agent's failed rollouts. A model that writes a task directly can
write one that is unsolvable, unverifiable or malformed, so here it only *proposes a new point
in the family's difficulty box* (and says which axis it moved and why); the family's own seeded
``generate(params, seed)`` builds the task. The result is therefore always a valid, solvable
task of the family, with the expert solver and the verifier intact.

A proposal is accepted when it parses (``parse_rewrite``: the last JSON object with a
``"params"`` list of the right length, clipped to the box), gives a different task, and moves
``family.difficulty`` in the requested direction. Otherwise, or when the backend raises, the
family's programmatic ``rewrite`` is used, and the returned info says so. The backend is any
judge backend (``clawray.judging.backends``): a function, an OpenAI-compatible endpoint or the
judge server.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any, Protocol, Sequence

from clawray.envs.base import Direction, EnvError, Task, TaskFamily, TextEnv
from clawray.judging.opd import message_text
from clawray.judging.prompts import JudgeRequest, TurnContext

logger = logging.getLogger(__name__)

REQUEST_KIND = "env_rewrite"
SYSTEM = """You design tasks for a reinforcement-learning curriculum. A task family has \
numeric difficulty axes; a generator builds a valid, solvable task from a point on those axes. \
You never write a task yourself: you choose the new point.

Given the current task, its point, a direction (harder or easier) and a critique of the \
agent's failed attempts, propose a new point that makes the task {direction} in the way the \
critique suggests the agent most needs. Prefer a modest change of one or two axes over a jump \
across the whole range. On every axis, higher values are harder; stay within each axis's \
[low, high].

Think briefly (a few sentences: which axis to change and why), then end your answer with one \
JSON object on its own line, with nothing after it:
{{"params": [<one number per axis, in the order listed>], "reason": "<one sentence>"}}"""


class CompletionBackend(Protocol):
    """What a rewrite needs from a judge backend (every ``JudgeBackend`` has it)."""

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]: ...


def _observation(family: TaskFamily, task: Task, max_chars: int) -> str:
    """The messages the agent sees at reset, as text (truncated to ``max_chars``)."""
    messages = family.make_env().reset(task)
    text = "\n".join(f"[{m.get('role', '?')}] {message_text(m)}" for m in messages)
    return text if len(text) <= max_chars else text[:max_chars] + "\n[... truncated]"


def build_rewrite_prompt(family: TaskFamily, task: Task, direction: Direction,
                         critique: str | None, max_observation_chars: int = 4000
                         ) -> list[dict[str, str]]:
    """The environment model's prompt: axes, the current point and task, direction, critique."""
    axes = "\n".join(
        f"{i + 1}. {p.name}: low {p.low:g}, high {p.high:g}, current {x:.3f}"
        + (f" ({p.doc})" if p.doc else "")
        for i, (p, x) in enumerate(zip(family.params, task.params)))
    user = (f"Task family: {family.name}\n\n"
            f"Difficulty axes (in this order):\n{axes}\n\n"
            f"Current params: {json.dumps([round(float(x), 4) for x in task.params])} "
            f"(overall difficulty {family.difficulty(task):.3f} on a 0-1 scale)\n\n"
            f"Current task goal: {task.description or '(none given)'}\n\n"
            f"What the agent sees at the start of the task:\n"
            f"{_observation(family, task, max_observation_chars)}\n\n"
            f"Critique of the agent's failed attempts:\n"
            f"{critique.strip() if critique and critique.strip() else '(none given)'}\n\n"
            f"Direction: make the task {direction}. Answer with your reasoning, then the JSON "
            f"object with {len(family.params)} params.")
    return [{"role": "system", "content": SYSTEM.format(direction=direction)},
            {"role": "user", "content": user}]


REASON_MAX_CHARS = 200  # the answer's "reason" sentence, for a constrained environment model


def rewrite_schema(family: TaskFamily) -> dict[str, Any]:
    """The JSON answer a rewrite ends with: one number per axis, within the axis's range, and
    a reason (a judge backend that can be constrained writes exactly this: formats.py)."""
    return {"type": "object", "additionalProperties": False, "required": ["params", "reason"],
            "properties": {
                "params": {"type": "array", "minItems": len(family.params),
                           "maxItems": len(family.params),
                           "prefixItems": [{"type": "number", "minimum": p.low,
                                            "maximum": p.high} for p in family.params],
                           "items": False},
                "reason": {"type": "string", "maxLength": REASON_MAX_CHARS}}}


def _last_params_object(text: str) -> dict[str, Any] | None:
    """The last top-level JSON object in ``text`` that has a ``"params"`` key."""
    decoder, found, i = json.JSONDecoder(), None, text.find("{")
    while i != -1:
        try:
            obj, end = decoder.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and "params" in obj:
            found = obj
            i = text.find("{", end)
        else:  # not a proposal: look inside it too
            i = text.find("{", i + 1)
    return found


def parse_rewrite(text: str, family: TaskFamily) -> list[float] | None:
    """The params the last ``{"params": [...]}`` object in ``text`` proposes, clipped to the
    family's box; None if there is none, or if it has the wrong length or a non-number."""
    obj = _last_params_object(text or "")
    if obj is None:
        return None
    params = obj["params"]
    if not isinstance(params, list) or len(params) != len(family.params):
        return None
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
               for x in params):
        return None
    return list(family.clip(params))


def _reason(text: str) -> str:
    obj = _last_params_object(text or "")
    reason = obj.get("reason") if obj else None
    return reason if isinstance(reason, str) else ""


class LLMRewriteFamily(TaskFamily):
    """``inner`` with rewrites proposed by a language model through a judge backend.

    Generation, the box, tools, envs and difficulty are ``inner``'s. ``arewrite`` samples
    ``n`` proposals in one backend call and takes the first acceptable one (see the module
    docstring); ``stats`` counts rewrites by source. The new task is regenerated at the task's
    own seed (as the built-in rewrites do, so the goal's random stream stays and the task is
    reproducible from its params and seed); the ``seed`` argument goes to the fallback.
    """

    def __init__(self, inner: TaskFamily, backend: CompletionBackend, temperature: float = 0.7,
                 max_tokens: int = 512, n: int = 1, max_observation_chars: int = 4000) -> None:
        if temperature < 0:
            raise EnvError(f"llm rewrite: temperature must be >= 0, got {temperature}")
        if max_tokens < 1 or n < 1 or max_observation_chars < 1:
            raise EnvError(f"llm rewrite: max_tokens, n and max_observation_chars must be >= 1, "
                           f"got {max_tokens}, {n}, {max_observation_chars}")
        self.inner, self.backend = inner, backend
        self.name, self.params, self.tools = inner.name, inner.params, inner.tools
        self.temperature, self.max_tokens, self.n = temperature, max_tokens, n
        self.max_observation_chars = max_observation_chars
        self.stats = {"llm": 0, "fallback": 0}

    def generate(self, params: Sequence[float], seed: int) -> Task:
        return self.inner.generate(params, seed)

    def make_env(self) -> TextEnv:
        return self.inner.make_env()

    def difficulty(self, task: Task) -> float:
        return self.inner.difficulty(task)

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        """``arewrite``'s task, for synchronous callers (no event loop running here)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.arewrite(task, direction, critique, seed))[0]
        raise EnvError(f"{self.name}: LLMRewriteFamily.rewrite was called inside a running "
                       "event loop, where it cannot wait for the backend; use "
                       "`await family.arewrite(task, direction, critique, seed)` instead")

    def _check(self, task: Task, direction: Direction, text: str) -> Task | str:
        """The task ``text`` proposes, or why it is not acceptable."""
        params = parse_rewrite(text, self)
        if params is None:
            return (f"no valid proposal: expected a final JSON object with 'params' as a list "
                    f"of {len(self.params)} numbers")
        try:
            built = self.inner.generate(params, task.seed)
        except EnvError as e:
            return f"the proposal {params} cannot be generated: {e}"
        new = task.derived(built.params, built.spec)
        if new.task_id == task.task_id:
            return f"the proposal {list(built.params)} gives the same task"
        old_d, new_d = self.difficulty(task), self.difficulty(new)
        if (new_d > old_d) if direction == "harder" else (new_d < old_d):
            return new
        return (f"the proposal {list(built.params)} is not {direction}: difficulty "
                f"{new_d:.3f} vs {old_d:.3f}")

    async def arewrite(self, task: Task, direction: Direction, critique: str | None = None,
                       seed: int = 0) -> tuple[Task, dict[str, Any]]:
        """A harder or easier task and how it was made.

        The info is ``{"source": "llm" | "fallback", "reason": ..., "raw": ...}``: the model's
        reason or why its proposals were rejected, and its raw text (``None`` if the backend
        raised; ``n`` texts are joined by a ``---`` line)."""
        if direction not in ("harder", "easier"):
            raise EnvError(f"{self.name}: direction must be 'harder' or 'easier', "
                           f"got {direction!r}")
        messages = build_rewrite_prompt(self, task, direction, critique,
                                        self.max_observation_chars)
        request = JudgeRequest(kind=REQUEST_KIND, messages=messages, context=TurnContext(
            history=[], request=messages[1:], response_text=None, response_tool_calls=[],
            next_state=[]), answer_schema=rewrite_schema(self),
            answer_chars=REASON_MAX_CHARS + 24 * len(self.params))
        raw: str | None
        try:
            texts = await self.backend.complete(request, self.n, self.temperature,
                                                self.max_tokens)
        except Exception as e:  # any backend failure: the programmatic rewrite still works
            logger.warning("%s: llm rewrite of %s (%s) failed in the backend, falling back: %r",
                           self.name, task.task_id, direction, e)
            reason, raw = f"backend error: {type(e).__name__}: {e}", None
        else:
            rejected = []
            for text in texts:
                checked = self._check(task, direction, text)
                if isinstance(checked, Task):
                    self.stats["llm"] += 1
                    return checked, {"source": "llm", "reason": _reason(text), "raw": text}
                rejected.append(checked)
            reason = "; ".join(rejected) or "the backend returned no text"
            raw = "\n---\n".join(texts)
            logger.info("%s: llm rewrite of %s (%s) rejected, falling back: %s",
                        self.name, task.task_id, direction, reason)
        fallback = self.inner.rewrite(task, direction, critique, seed)
        self.stats["fallback"] += 1
        return fallback, {"source": "fallback", "reason": reason, "raw": raw}


def with_llm_rewrite(family: TaskFamily, backend: CompletionBackend,
                     **settings: Any) -> LLMRewriteFamily:
    """``family`` whose rewrites the backend proposes (``settings``: temperature, max_tokens,
    n, max_observation_chars)."""
    return LLMRewriteFamily(family, backend, **settings)
