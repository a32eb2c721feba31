"""RLAnything's environment adaptation: rewrite a task harder when the policy solves it at
accuracy >= 0.8, easier at <= 0.2, and keep a rewrite only if it moved accuracy the intended
way (``docs/rlanything.md``). The core lives here; the Ray actor in ``env_adapter_actor.py``.

The adapter holds ``n_slots`` task slots. A slot has an *active* task and at most one *pending
candidate* (a harder or easier rewrite of it). One training step goes:

1. ``tasks_for_step()``: the trainer rolls out the step's slots' active tasks and pending
   candidates (a GRPO group each): every slot, or ``per_step`` slots in turn (``step_slots``).
2. ``report(results)``: per task, the 0/1 rewards of its rollouts and a critique of its failed
   steps (``core.failure_steps`` / ``core.programmatic_critique``).

   - A candidate is accepted iff ``core.accept_candidate(direction, acc_at_proposal, acc′)``:
     it becomes the slot's active task (its ``root_id`` is the rewrite's, so the chain's root
     is kept). A rejected one is deleted and its task id is returned in
     ``exclude_task_ids``: the trainer must not train on its rollouts.
   - The slot's accuracy (the active task's, or the accepted candidate's: its rollouts were
     measured on the same policy at the same step, so the new active task needs no extra step)
     picks a direction with ``core.adaptation_direction`` (acc ≥ 0.8 harder, ≤ 0.2 easier). A
     slot without a pending candidate then gets one: ``family.rewrite(task, direction,
     critique, seed)``, or ``await family.arewrite(...)`` for an LLM-driven family (all slots'
     rewrites run concurrently). A rewrite raising ``EnvError`` (the task is at the edge of
     the box) is logged as a ``no_rewrite`` event.
3. The next step rolls the new candidates out, and so on.

Results that match no slot's current active or pending task (a wrong slot, a stale task id, a
repeated result) are counted as ``unknown`` and never fail the report; unknown *candidate*
results are excluded from training as well, since nobody vetted their task. A report with the
same ``step_id`` as the previous one (a retry after the actor restarted) returns the previous
answer unchanged.

``EnvAdapterCore`` is plain Python (``state()`` / ``from_state`` round-trip exactly, rng
included); ``EnvAdapter`` (``clawray/rlanything/env_adapter_actor.py``) is its async Ray actor,
checkpointed like ``CurriculumActor``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from clawray.config import JudgeConfig
from clawray.files import write_json_atomic
from clawray.envs import EnvError, Task, TaskFamily, make_family
from clawray.envs.base import Direction, Pooled, SubBox
from clawray.envs.llm_rewrite import with_llm_rewrite
from clawray.judging.backends import make_backend
from clawray.rlanything.core import accept_candidate, accuracy, adaptation_direction

logger = logging.getLogger(__name__)

STATE_VERSION = 1
LOG_LIMIT = 1000  # history / event entries kept in the state (counters keep the totals)
REASON_CHARS = 300


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """Slots and thresholds; the defaults are RLAnything's (docs/rlanything.md, "The rules")."""

    n_slots: int = 8
    seed: int = 0
    max_difficulty: float = 1.0  # initial tasks within this lower fraction of every axis
    harder_at: float = 0.8
    easier_at: float = 0.2
    accept_low: float = 0.2
    accept_high: float = 0.8
    adapt: bool = True  # False: fixed task slots, never rewritten (the "no adaptation" baseline)
    # Slots played per step, round-robin (0: every slot every step). With more slots than this
    # the slots are a task set the steps cycle through, as a dataset is in the paper, instead of
    # the same few tasks at every step; a slot's pending candidate is played with its slot.
    per_step: int = 0

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {self.n_slots}")
        if not 0 <= self.per_step <= self.n_slots:
            raise ValueError(f"per_step must be in [0, n_slots={self.n_slots}] (0: every slot), "
                             f"got {self.per_step}")
        if not 0 < self.max_difficulty <= 1:
            raise ValueError(f"max_difficulty must be in (0, 1], got {self.max_difficulty}")
        if not 0 <= self.easier_at < self.harder_at <= 1:
            raise ValueError("need 0 <= easier_at < harder_at <= 1, got "
                             f"{self.easier_at}, {self.harder_at}")
        if not 0 <= self.accept_low <= self.accept_high <= 1:
            raise ValueError("need 0 <= accept_low <= accept_high <= 1, got "
                             f"{self.accept_low}, {self.accept_high}")


@dataclasses.dataclass
class Pending:
    """A proposed rewrite waiting for its rollouts."""

    task: Task
    direction: Direction
    acc_at_proposal: float
    step: int
    source: str  # "rewrite" (programmatic), "llm" or "fallback" (LLMRewriteFamily)

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task.to_dict(), "direction": self.direction,
                "acc_at_proposal": self.acc_at_proposal, "step": self.step,
                "source": self.source}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Pending:
        return cls(Task.from_dict(d["task"]), d["direction"], float(d["acc_at_proposal"]),
                   int(d["step"]), str(d["source"]))


@dataclasses.dataclass
class Slot:
    active: Task
    acc: float | None = None  # the active task's last accuracy
    pending: Pending | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"active": self.active.to_dict(), "acc": self.acc,
                "pending": self.pending.to_dict() if self.pending else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Slot:
        return cls(Task.from_dict(d["active"]), None if d["acc"] is None else float(d["acc"]),
                   Pending.from_dict(d["pending"]) if d["pending"] else None)


@dataclasses.dataclass(frozen=True)
class _Request:
    """One rewrite to make in this report."""

    slot: int
    task: Task
    direction: Direction
    acc: float
    critique: str | None
    seed: int


_Made = tuple[Task | None, dict[str, str]]  # the rewrite (None: failed) and its info


class EnvAdapterCore:
    """The adapter's state and rules (no Ray). One report at a time: ``areport`` must not be
    interleaved with other calls (the actor holds a lock)."""

    def __init__(self, family: TaskFamily, config: AdapterConfig | None = None) -> None:
        self.family, self.config = family, config or AdapterConfig()
        sampling = (SubBox(family, self.config.max_difficulty)
                    if self.config.max_difficulty < 1.0 else family)
        self.rng = np.random.default_rng(self.config.seed)
        self.slots = [Slot(sampling.sample(self.rng)) for _ in range(self.config.n_slots)]
        self.step = 0  # reports processed
        self.history: list[dict[str, Any]] = []  # candidate decisions
        self.events: list[dict[str, Any]] = []  # rewrites that could not be made
        self.accepted_over_time: list[list[int]] = []  # [step, cumulative accepted]
        self.counts = {"reports": 0, "proposed": 0, "accepted": 0, "rejected": 0,
                       "no_rewrite": 0, "rewrite_errors": 0, "unknown_reports": 0,
                       "superseded": 0, "repeated_reports": 0}
        self.sources: dict[str, int] = {}
        self.last_report: dict[str, Any] | None = None  # {"step_id", "result"}

    # ---------------------------------------------------------------- serving

    def step_slots(self) -> list[int]:
        """The slots the next step plays: all, or ``per_step`` of them in turn (the same until
        the step is reported, so a retried step plays the same tasks)."""
        n, k = len(self.slots), self.config.per_step
        if k == 0:
            return list(range(n))
        return [(self.step * k + j) % n for j in range(k)]

    def tasks_for_step(self) -> list[dict[str, Any]]:
        """The step's slots' active tasks and pending candidates: ``{"slot", "role", "task"}``."""
        out = []
        for i in self.step_slots():
            s = self.slots[i]
            out.append({"slot": i, "role": "active", "task": s.active.to_dict()})
            if s.pending is not None:
                out.append({"slot": i, "role": "candidate", "task": s.pending.task.to_dict()})
        return out

    def report(self, results: Sequence[Mapping[str, Any]],
               step_id: int | None = None) -> dict[str, Any]:
        """``areport`` for synchronous callers (an async family's rewrites run in a fresh
        event loop, so there must be no running one)."""
        if not hasattr(self.family, "arewrite"):
            return self._report(results, step_id)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.areport(results, step_id))
        raise RuntimeError("EnvAdapterCore.report was called inside a running event loop with "
                           "an async (LLM) family; use `await core.areport(results)`")

    async def areport(self, results: Sequence[Mapping[str, Any]],
                      step_id: int | None = None) -> dict[str, Any]:
        """One step's results (see the module docstring). Each result is ``{"slot", "role",
        "task_id", "rewards": [0/1 per rollout], "critique": str | None}``. Returns
        ``{"step", "accepted", "rejected", "proposed", "no_rewrite", "exclude_task_ids",
        "unknown", "superseded"}``."""
        repeated = self._repeated(step_id)
        if repeated is not None:
            return repeated
        out, requests = self._decide(results)
        made = await asyncio.gather(*(self._arewrite(r) for r in requests))
        return self._install(out, requests, list(made), step_id)

    def _report(self, results: Sequence[Mapping[str, Any]],
                step_id: int | None) -> dict[str, Any]:
        repeated = self._repeated(step_id)
        if repeated is not None:
            return repeated
        out, requests = self._decide(results)
        return self._install(out, requests, [self._rewrite(r) for r in requests], step_id)

    def _repeated(self, step_id: int | None) -> dict[str, Any] | None:
        if step_id is not None and self.last_report and self.last_report["step_id"] == step_id:
            self.counts["repeated_reports"] += 1
            logger.warning("report of step_id %s repeated (a retry): returning its result",
                           step_id)
            return self.last_report["result"]
        return None

    # ---------------------------------------------------------------- the rules

    def _decide(self, results: Sequence[Mapping[str, Any]]
                ) -> tuple[dict[str, Any], list[_Request]]:
        """Judge the candidates, record accuracies, and list the rewrites to make."""
        accs = [_check_result(r, k) for k, r in enumerate(results)]  # before any change
        self.step += 1
        step, cfg = self.step, self.config
        out: dict[str, Any] = {"step": step, "accepted": [], "rejected": [], "proposed": [],
                               "no_rewrite": [], "exclude_task_ids": [], "unknown": 0,
                               "superseded": 0}
        matched: dict[tuple[int, str], tuple[Mapping[str, Any], float]] = {}
        for r, acc in zip(results, accs):
            slot, role = r.get("slot"), r.get("role")
            current = self._current(slot, role)
            if current is None or current.task_id != r.get("task_id") \
                    or (slot, role) in matched:
                out["unknown"] += 1
                logger.warning("step %d: result for slot %r role %r task %r matches no current "
                               "task of that slot; ignored", step, slot, role, r.get("task_id"))
                if role == "candidate" and isinstance(r.get("task_id"), str):
                    out["exclude_task_ids"].append(r["task_id"])
                continue
            matched[(slot, role)] = (r, acc)

        requests = []
        for i, s in enumerate(self.slots):
            measured: tuple[float, str | None] | None = None
            if (i, "candidate") in matched:
                r, acc = matched[(i, "candidate")]
                p, s.pending = s.pending, None
                assert p is not None  # matched against it above
                ok = accept_candidate(p.direction, p.acc_at_proposal, acc, cfg.accept_low,
                                      cfg.accept_high)
                entry = {"step": step, "slot": i, "from": s.active.task_id,
                         "to": p.task.task_id, "direction": p.direction,
                         "acc_before": p.acc_at_proposal, "acc_after": acc, "accepted": ok,
                         "source": p.source}
                self.history = (self.history + [entry])[-LOG_LIMIT:]
                if ok:
                    s.active, s.acc = p.task, acc
                    measured = (acc, r.get("critique"))
                    out["accepted"].append(entry)
                else:
                    out["rejected"].append(entry)
                    out["exclude_task_ids"].append(p.task.task_id)
            if (i, "active") in matched:
                r, acc = matched[(i, "active")]
                if measured is not None:  # the slot moved on to the accepted candidate
                    out["superseded"] += 1
                else:
                    s.acc = acc
                    measured = (acc, r.get("critique"))
            if measured is None or s.pending is not None or not cfg.adapt:
                continue
            direction = adaptation_direction(measured[0], cfg.harder_at, cfg.easier_at)
            if direction is not None:
                requests.append(_Request(i, s.active, direction, measured[0], measured[1],
                                         int(self.rng.integers(2**31))))
        return out, requests

    def _current(self, slot: Any, role: Any) -> Task | None:
        """The task a result for ``(slot, role)`` must be about, if any."""
        if not isinstance(slot, int) or isinstance(slot, bool) \
                or not 0 <= slot < len(self.slots):
            return None
        s = self.slots[slot]
        if role == "active":
            return s.active
        return s.pending.task if role == "candidate" and s.pending is not None else None

    def _rewrite(self, req: _Request) -> _Made:
        try:
            task = self.family.rewrite(req.task, req.direction, req.critique, req.seed)
        except EnvError as e:
            return None, {"event": "no_rewrite", "reason": str(e)}
        except Exception as e:  # a broken family must not lose the step's decisions
            logger.exception("rewrite of %s (%s) failed", req.task.task_id, req.direction)
            return None, {"event": "rewrite_error", "reason": f"{type(e).__name__}: {e}"}
        return task, {"source": "rewrite", "reason": ""}

    async def _arewrite(self, req: _Request) -> _Made:
        arewrite = getattr(self.family, "arewrite", None)
        if arewrite is None:
            return self._rewrite(req)
        try:
            task, info = await arewrite(req.task, req.direction, req.critique, req.seed)
        except EnvError as e:
            return None, {"event": "no_rewrite", "reason": str(e)}
        except Exception as e:
            logger.exception("async rewrite of %s (%s) failed", req.task.task_id, req.direction)
            return None, {"event": "rewrite_error", "reason": f"{type(e).__name__}: {e}"}
        return task, {"source": str(info.get("source", "rewrite")),
                      "reason": str(info.get("reason") or "")}

    def _install(self, out: dict[str, Any], requests: list[_Request], made: list[_Made],
                 step_id: int | None) -> dict[str, Any]:
        """Make the rewrites the slots' pending candidates; finish the report."""
        step = out["step"]
        for req, (task, info) in zip(requests, made):
            if task is not None and task.task_id == req.task.task_id:
                task, info = None, {"event": "no_rewrite", "reason": "the rewrite is the same task"}
            elif task is not None and task.root != req.task.root:
                task, info = None, {"event": "rewrite_error",
                                    "reason": f"the rewrite changed the root to {task.root}"}
            if task is None:
                event = {"step": step, "slot": req.slot, "event": info["event"],
                         "task": req.task.task_id, "direction": req.direction, "acc": req.acc,
                         "reason": info["reason"][:REASON_CHARS]}
                self.events = (self.events + [event])[-LOG_LIMIT:]
                self.counts["no_rewrite" if info["event"] == "no_rewrite"
                            else "rewrite_errors"] += 1
                out["no_rewrite"].append(event)
                continue
            self.slots[req.slot].pending = Pending(task, req.direction, req.acc, step,
                                                   info["source"])
            self.sources[info["source"]] = self.sources.get(info["source"], 0) + 1
            out["proposed"].append({"step": step, "slot": req.slot, "from": req.task.task_id,
                                    "to": task.task_id, "direction": req.direction,
                                    "acc": req.acc, "source": info["source"],
                                    "reason": info["reason"][:REASON_CHARS]})
        c = self.counts
        c["reports"] += 1
        c["proposed"] += len(out["proposed"])
        c["accepted"] += len(out["accepted"])
        c["rejected"] += len(out["rejected"])
        c["unknown_reports"] += out["unknown"]
        c["superseded"] += out["superseded"]
        if out["accepted"]:
            self.accepted_over_time = (self.accepted_over_time
                                       + [[step, c["accepted"]]])[-LOG_LIMIT:]
        if step_id is not None:
            self.last_report = {"step_id": step_id, "result": out}
        return out

    # ---------------------------------------------------------------- metrics and state

    def metrics(self) -> dict[str, Any]:
        decided = self.counts["accepted"] + self.counts["rejected"]
        return {**self.counts, **{f"source/{k}": v for k, v in self.sources.items()},
                "step": self.step,
                "pending": sum(s.pending is not None for s in self.slots),
                "acceptance_rate": self.counts["accepted"] / decided if decided else math.nan,
                "accepted_over_time": [list(x) for x in self.accepted_over_time],
                "mean_active_difficulty": float(np.mean(
                    [self.family.difficulty(s.active) for s in self.slots])),
                "slot_depth": [s.active.depth for s in self.slots],
                "last_accuracy": [s.acc for s in self.slots]}

    def state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "family": self.family.name,
                "config": dataclasses.asdict(self.config), "rng": self.rng.bit_generator.state,
                "step": self.step, "slots": [s.to_dict() for s in self.slots],
                "history": self.history, "events": self.events,
                "accepted_over_time": self.accepted_over_time, "counts": dict(self.counts),
                "sources": dict(self.sources), "last_report": self.last_report}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], family: TaskFamily) -> EnvAdapterCore:
        """The adapter ``state()`` described, over ``family`` (which must have its name)."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unknown env adapter state version {state.get('version')!r}")
        if state.get("family") != family.name:
            raise ValueError(f"env adapter state is for family {state.get('family')!r}, not "
                             f"{family.name!r}")
        core = cls.__new__(cls)  # no fresh slots: everything comes from the state
        core.family, core.config = family, AdapterConfig(**state["config"])
        core.rng = np.random.default_rng()
        core.rng.bit_generator.state = state["rng"]
        core.step = int(state["step"])
        core.slots = [Slot.from_dict(s) for s in state["slots"]]
        core.history = [dict(e) for e in state["history"]]
        core.events = [dict(e) for e in state["events"]]
        core.accepted_over_time = [[int(a), int(b)] for a, b in state["accepted_over_time"]]
        core.counts = {k: int(v) for k, v in state["counts"].items()}
        core.sources = {k: int(v) for k, v in state["sources"].items()}
        core.last_report = state["last_report"]
        return core

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write ``state()`` as JSON, atomically (temp file + ``os.replace``); the path."""
        return write_json_atomic(path, self.state())

    @classmethod
    def load(cls, path: str | os.PathLike[str], family: TaskFamily) -> EnvAdapterCore:
        return cls.from_state(json.loads(Path(path).read_text()), family)


def _check_result(r: Any, k: int) -> float:
    """The accuracy of result ``k``, after checking its shape (bad input fails the report
    before anything changes; an unknown slot or task id does not)."""
    if not isinstance(r, Mapping):
        raise ValueError(f"result {k}: expected a dict, got {type(r).__name__}")
    rewards = r.get("rewards")
    if not isinstance(rewards, (list, tuple)) or not rewards or not all(
            isinstance(x, (int, float)) and math.isfinite(x) for x in rewards):
        raise ValueError(f"result {k} (slot {r.get('slot')!r}): 'rewards' must be a non-empty "
                         f"list of finite numbers, got {rewards!r}")
    if r.get("critique") is not None and not isinstance(r["critique"], str):
        raise ValueError(f"result {k}: 'critique' must be a str or None, got "
                         f"{type(r['critique']).__name__}")
    return accuracy(rewards)


def build_family(family_name: str, family_kwargs: dict[str, Any] | None = None,
                 llm_rewrite: dict[str, Any] | None = None,
                 judge_handle: Any = None, pool: str | None = None) -> TaskFamily:
    """The family ``make_family`` names, restricted to ``pool``'s tasks when given
    (``Pooled``: generated tasks and programmatic rewrites), with LLM-driven rewrites when
    ``llm_rewrite`` is given: ``{"judge": <JudgeConfig fields>, "temperature", "max_tokens",
    "n", ...}`` (the other keys go to ``LLMRewriteFamily``); ``judge_handle`` serves
    ``backend="server"``."""
    family = make_family(family_name, **(family_kwargs or {}))
    if pool is not None:
        family = Pooled(family, pool)
    if llm_rewrite is None:
        return family
    settings = dict(llm_rewrite)
    backend = make_backend(JudgeConfig(**settings.pop("judge", {})), judge_handle)
    return with_llm_rewrite(family, backend, **settings)
