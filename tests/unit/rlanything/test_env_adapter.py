"""RLAnything's environment adaptation: rewrites proposed at acc ≥ 0.8 / ≤ 0.2, one pending
candidate per slot, acceptance and rejection (rejected rollouts excluded), edge-of-box and
unknown reports, exact state round trips, household and LLM-driven rewrites, and the actor
resuming from its checkpoint after a kill."""

from __future__ import annotations

import json
import uuid
from typing import Any, Sequence

import pytest

from clawray.envs import EnvError, Param, Task, TaskFamily, TextEnv, demonstrate, make_family
from clawray.envs.base import Direction
from clawray.envs.household import HouseholdFamily
from clawray.envs.llm_rewrite import LLMRewriteFamily
from clawray.judging.prompts import JudgeRequest
from clawray.rlanything.env_adapter import AdapterConfig, EnvAdapterCore, build_family
from clawray.rlanything.env_adapter_actor import get_or_create_env_adapter

N = 10  # rollouts per task: accuracies are multiples of 0.1


class LineFamily(TaskFamily):
    """One axis ``level`` in [0, 1]; difficulty = level; a rewrite moves it by 0.2 (clipped)
    and records the rewrite seed in the spec, so proposals depend on the adapter's rng."""

    name = "line"
    params = (Param("level", 0.0, 1.0),)

    def __init__(self) -> None:
        self.refuse: set[str] = set()
        self.calls: list[tuple[str, str, str | None, int]] = []

    def generate(self, params: Sequence[float], seed: int) -> Task:
        (x,) = self.clip(params)
        return Task(self.name, (x,), int(seed), {"goal": f"reach {x:.3f}", "x": round(x, 6)})

    def rewrite(self, task: Task, direction: Direction, critique: str | None = None,
                seed: int = 0) -> Task:
        self.calls.append((task.task_id, direction, critique, seed))
        if direction in self.refuse:
            raise EnvError(f"line: refusing to make {task.task_id} {direction}")
        (x,) = task.params
        (new,) = self.clip([x + (0.2 if direction == "harder" else -0.2)])
        if new == x:
            raise EnvError(f"line: {task.task_id} is already the {direction}st task")
        return task.derived((new,), {"goal": f"reach {new:.3f}", "x": round(new, 6),
                                     "variant": seed % 997})

    def make_env(self) -> TextEnv:
        raise EnvError("line tasks are not playable")


def adapter(n_slots: int = 3, levels: Sequence[float] = (0.5, 0.5, 0.5),
            family: TaskFamily | None = None, **cfg: Any) -> EnvAdapterCore:
    """An adapter whose slots start at ``levels`` (the tests place the active tasks)."""
    family = family or LineFamily()
    core = EnvAdapterCore(family, AdapterConfig(n_slots=n_slots, seed=3, **cfg))
    for slot, x in zip(core.slots, levels):
        slot.active = family.generate([x], 100 + int(10 * x))
    return core


def results(core: EnvAdapterCore, accs: dict[tuple[int, str], float]) -> list[dict[str, Any]]:
    """Results with accuracy ``accs[(slot, role)]`` for this step's tasks (others omitted)."""
    out = []
    for t in core.tasks_for_step():
        key = (t["slot"], t["role"])
        if key in accs:
            k = round(accs[key] * N)
            out.append({"slot": t["slot"], "role": t["role"],
                        "task_id": Task.from_dict(t["task"]).task_id,
                        "rewards": [1] * k + [0] * (N - k), "critique": f"critique {key}"})
    return out


def step(core: EnvAdapterCore, **accs: float) -> dict[str, Any]:
    """``step(core, a0=1.0, c0=0.5)``: slot 0's active at acc 1.0, its candidate at 0.5."""
    keys = {(int(k[1:]), "active" if k[0] == "a" else "candidate"): v for k, v in accs.items()}
    return core.report(results(core, keys))


# ---------------------------------------------------------------------------- triggers
def test_harder_at_08_easier_at_02_and_nothing_in_between():
    core = adapter(levels=(0.5, 0.5, 0.5))
    out = step(core, a0=0.8, a1=0.5, a2=0.2)
    assert [(p["slot"], p["direction"], p["acc"]) for p in out["proposed"]] == [
        (0, "harder", 0.8), (2, "easier", 0.2)]
    assert core.slots[0].pending.task.params == (pytest.approx(0.7),)
    assert core.slots[2].pending.task.params == (pytest.approx(0.3),)
    assert core.slots[1].pending is None and core.slots[1].acc == 0.5
    # the step's critique reaches the rewrite, with a seed from the adapter's rng
    assert [c[1:3] for c in core.family.calls] == [("harder", "critique (0, 'active')"),
                                                   ("easier", "critique (2, 'active')")]
    roles = [(t["slot"], t["role"]) for t in core.tasks_for_step()]
    assert roles == [(0, "active"), (0, "candidate"), (1, "active"), (2, "active"),
                     (2, "candidate")]
    out = step(core, a1=0.7, a2=0.3)  # 0.3 is above easier_at; candidates not rolled out
    assert out["proposed"] == [] and core.slots[2].pending is not None


def test_thresholds_are_configurable():
    core = adapter(levels=(0.5, 0.5), n_slots=2, harder_at=0.9, easier_at=0.0)
    assert step(core, a0=0.8, a1=0.1)["proposed"] == []
    assert [p["slot"] for p in step(core, a0=0.9, a1=0.0)["proposed"]] == [0, 1]


def test_at_most_one_pending_candidate_per_slot():
    core = adapter(n_slots=1, levels=(0.5,))
    first = step(core, a0=1.0)["proposed"][0]["to"]
    for _ in range(3):  # triggered again while the candidate is pending: no second proposal
        assert step(core, a0=1.0)["proposed"] == []
    assert core.slots[0].pending.task.task_id == first
    assert [t["role"] for t in core.tasks_for_step()] == ["active", "candidate"]
    assert core.metrics()["proposed"] == 1 and len(core.family.calls) == 1


def test_per_step_plays_the_slots_in_turn_and_a_candidate_with_its_slot():
    core = adapter(n_slots=3, levels=(0.5, 0.5, 0.5), per_step=2)
    assert core.step_slots() == [0, 1]
    assert core.step_slots() == [0, 1]  # unchanged until the step is reported (a retry)
    out = step(core, a0=1.0, a1=0.5)
    assert [p["slot"] for p in out["proposed"]] == [0]
    # the next step wraps round: slots 2 and 0, and slot 0's candidate is played with it
    assert [(t["slot"], t["role"]) for t in core.tasks_for_step()] == [
        (2, "active"), (0, "active"), (0, "candidate")]
    out = step(core, a2=0.0, a0=1.0, c0=0.5)
    assert [e["slot"] for e in out["accepted"]] == [0]
    assert [p["slot"] for p in out["proposed"]] == [2]
    assert [t["slot"] for t in core.tasks_for_step()] == [1, 2, 2]
    # a slot the step did not play keeps its pending candidate untouched
    core2 = adapter(n_slots=3, levels=(0.5, 0.5, 0.5), per_step=1)
    step(core2, a0=1.0)
    pending = core2.slots[0].pending.task.task_id
    step(core2, a1=0.5)
    step(core2, a2=0.5)
    assert core2.slots[0].pending.task.task_id == pending
    assert [(t["slot"], t["role"]) for t in core2.tasks_for_step()] == [
        (0, "active"), (0, "candidate")]


def test_per_step_zero_or_all_plays_every_slot_and_out_of_range_is_an_error():
    for k in (0, 3):
        core = adapter(n_slots=3, levels=(0.5, 0.5, 0.5), per_step=k)
        step(core, a0=0.5, a1=0.5, a2=0.5)
        assert core.step_slots() == [0, 1, 2]
    with pytest.raises(ValueError, match="per_step must be in"):
        AdapterConfig(n_slots=3, per_step=4)
    with pytest.raises(ValueError, match="per_step must be in"):
        AdapterConfig(n_slots=3, per_step=-1)


def test_per_step_survives_a_state_round_trip():
    core = EnvAdapterCore(LineFamily(), AdapterConfig(n_slots=4, seed=11, per_step=3))
    _play(core, 2)
    restored = EnvAdapterCore.from_state(json.loads(json.dumps(core.state())), LineFamily())
    assert restored.config.per_step == 3 and restored.step_slots() == core.step_slots()
    assert _play(restored, 4) == _play(core, 4)


# ---------------------------------------------------------------------------- acceptance
@pytest.mark.parametrize("direction,acc,acc_new,accepted", [
    ("harder", 1.0, 0.5, True),
    ("harder", 1.0, 0.2, True),  # the band's edge counts
    ("harder", 0.8, 0.7, True),
    ("harder", 1.0, 0.0, False),  # nobody solves it
    ("harder", 0.8, 0.8, False),  # not harder in practice
    ("harder", 0.8, 0.9, False),
    ("harder", 1.0, 0.1, False),  # too hard: below 0.2
    ("easier", 0.0, 0.5, True),
    ("easier", 0.0, 0.8, True),
    ("easier", 0.2, 0.3, True),
    ("easier", 0.1, 0.0, False),
    ("easier", 0.2, 0.2, False),
    ("easier", 0.1, 0.9, False),  # too easy: above 0.8
])
def test_candidate_accepted_iff_reference_rule(direction, acc, acc_new, accepted):
    core = adapter(n_slots=1, levels=(0.5,))
    old = core.slots[0].active
    (proposal,) = step(core, a0=acc)["proposed"]
    assert proposal["direction"] == direction
    cand = core.slots[0].pending.task
    out = step(core, c0=acc_new)
    entry = {"step": 2, "slot": 0, "from": old.task_id, "to": cand.task_id,
             "direction": direction, "acc_before": acc, "acc_after": acc_new,
             "accepted": accepted, "source": "rewrite"}
    assert core.history == [entry]
    if accepted:
        assert out["accepted"] == [entry] and out["rejected"] == []
        assert out["exclude_task_ids"] == []
        assert core.slots[0].active == cand and core.slots[0].acc == acc_new
        assert cand.root_id == old.task_id and cand.depth == 1
    else:
        assert out["rejected"] == [entry] and out["accepted"] == []
        assert out["exclude_task_ids"] == [cand.task_id]  # its rollouts are not trained on
        assert core.slots[0].active == old
    served = [Task.from_dict(t["task"]).task_id for t in core.tasks_for_step()]
    assert (cand.task_id in served) == accepted  # a rejected candidate is deleted


def test_accepted_candidate_keeps_the_root_and_is_judged_at_once():
    core = adapter(n_slots=1, levels=(0.2,))
    root = core.slots[0].active.task_id
    step(core, a0=1.0)
    out = step(core, a0=1.0, c0=0.8)  # accepted (0.8 < 1.0); still ≥ 0.8: harder again
    assert len(out["accepted"]) == 1 and out["superseded"] == 1  # the old active's result
    (again,) = out["proposed"]
    assert again["from"] == out["accepted"][0]["to"] and again["direction"] == "harder"
    assert again["acc"] == 0.8
    step(core, c0=0.5)
    active = core.slots[0].active
    assert active.depth == 2 and active.root_id == root
    assert active.params == (pytest.approx(0.6),)
    m = core.metrics()
    assert m["accepted_over_time"] == [[2, 1], [3, 2]] and m["slot_depth"] == [2]
    assert m["accepted"] == 2 and m["acceptance_rate"] == 1.0


def test_rejected_candidate_frees_the_slot_for_a_new_proposal_in_the_same_step():
    core = adapter(n_slots=1, levels=(0.5,))
    step(core, a0=1.0)
    out = step(core, a0=0.9, c0=0.0)
    assert len(out["rejected"]) == 1 and out["exclude_task_ids"] == [out["rejected"][0]["to"]]
    (new,) = out["proposed"]
    assert new["acc"] == 0.9 and core.slots[0].pending.task.task_id == new["to"]
    assert new["to"] != out["rejected"][0]["to"]  # another rewrite seed


# ---------------------------------------------------------------------------- no rewrite
def test_rewrite_raising_env_error_is_a_no_rewrite_event():
    family = LineFamily()
    family.refuse = {"easier"}
    core = adapter(n_slots=2, levels=(1.0, 0.5), family=family)
    out = step(core, a0=1.0, a1=0.0)  # slot 0 is at the top edge; slot 1 is refused
    assert out["proposed"] == []
    assert [(e["slot"], e["event"], e["direction"]) for e in out["no_rewrite"]] == [
        (0, "no_rewrite", "harder"), (1, "no_rewrite", "easier")]
    assert "already the harderst" in out["no_rewrite"][0]["reason"]
    assert core.events == out["no_rewrite"]
    assert all(s.pending is None for s in core.slots)
    assert core.metrics()["no_rewrite"] == 2
    step(core, a0=1.0)  # tried again next time (the policy may have changed)
    assert core.metrics()["no_rewrite"] == 3


def test_a_broken_rewrite_is_logged_and_the_steps_decisions_are_kept():
    class Broken(LineFamily):
        def rewrite(self, task, direction, critique=None, seed=0):
            raise KeyError("bug")

    core = adapter(n_slots=1, levels=(0.5,), family=Broken())
    out = step(core, a0=1.0)
    assert out["no_rewrite"][0]["event"] == "rewrite_error" and "KeyError" in out[
        "no_rewrite"][0]["reason"]
    assert core.metrics()["rewrite_errors"] == 1 and core.step == 1


# ---------------------------------------------------------------------------- bad reports
def test_unknown_reports_are_counted_and_never_crash():
    core = adapter(n_slots=2, levels=(0.5, 0.5))
    step(core, a0=1.0)
    good = results(core, {(0, "active"): 0.5, (1, "active"): 0.5})
    stale = good[0]["task_id"]
    bad = [
        {**good[0], "slot": 7},  # no such slot
        {**good[0], "slot": "0"},
        {**good[1], "task_id": stale},  # another slot's task
        {**good[0], "role": "judge"},
        {**good[1], "role": "candidate"},  # slot 1 has no candidate: excluded too
        dict(good[0]),  # a repeat of slot 0's active result
    ]
    out = core.report(good + bad)
    assert out["unknown"] == 6 and out["exclude_task_ids"] == [good[1]["task_id"]]
    assert core.slots[0].pending is not None and core.slots[1].acc == 0.5
    assert core.metrics()["unknown_reports"] == 6
    # the candidate is decided; a late report of it is unknown now
    cand = results(core, {(0, "candidate"): 0.5})
    core.report(cand)
    assert core.report(cand)["unknown"] == 1


def test_malformed_results_fail_before_anything_changes():
    core = adapter(n_slots=1, levels=(0.5,))
    good = results(core, {(0, "active"): 1.0})
    for bad in ([{**good[0], "rewards": []}], [{**good[0], "rewards": [1, float("nan")]}],
                [{**good[0], "critique": 3}], ["not a dict"]):
        with pytest.raises(ValueError):
            core.report(good + bad)
    assert core.step == 0 and core.slots[0].pending is None and core.family.calls == []


def test_a_repeated_step_id_returns_the_first_answer():
    core = adapter(n_slots=1, levels=(0.5,))
    res = results(core, {(0, "active"): 1.0})
    first = core.report(res, step_id=41)
    assert core.report(res, step_id=41) == first
    assert core.step == 1 and core.metrics()["repeated_reports"] == 1


# ---------------------------------------------------------------------------- state
def _play(core: EnvAdapterCore, steps: int) -> list[dict[str, Any]]:
    """Deterministic steps that never settle: an active task below level 0.5 is always
    solved, above never; a candidate is solved half the time if its rewrite seed (the spec's
    variant, drawn from the adapter's rng) is even, else never (rejected)."""
    outs = []
    for _ in range(steps):
        res = []
        for t in core.tasks_for_step():
            level, variant = t["task"]["params"][0], t["task"]["spec"].get("variant", 0)
            acc = (float(level < 0.5) if t["role"] == "active"
                   else 0.5 if variant % 2 == 0 else 0.0)
            k = round(acc * N)
            res.append({"slot": t["slot"], "role": t["role"],
                        "task_id": Task.from_dict(t["task"]).task_id,
                        "rewards": [1] * k + [0] * (N - k), "critique": None})
        outs.append(core.report(res))
    return outs


def test_state_round_trip_is_exact_and_proposes_the_same():
    core = EnvAdapterCore(LineFamily(), AdapterConfig(n_slots=4, seed=11))
    _play(core, 3)
    state = json.loads(json.dumps(core.state()))
    restored = EnvAdapterCore.from_state(state, LineFamily())
    assert json.dumps(restored.state(), sort_keys=True) == json.dumps(core.state(),
                                                                      sort_keys=True)
    after = _play(core, 6)
    assert _play(restored, 6) == after
    assert restored.state() == core.state()
    assert all(any(o[k] for o in after) for k in ("proposed", "accepted", "rejected"))
    with pytest.raises(ValueError, match="family"):
        EnvAdapterCore.from_state(state, HouseholdFamily())


def test_save_is_atomic_json_and_load_restores(tmp_path):
    core = EnvAdapterCore(LineFamily(), AdapterConfig(n_slots=2, seed=1))
    _play(core, 2)
    path = core.save(tmp_path / "sub" / "adapter.json")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["adapter.json"]
    assert EnvAdapterCore.load(path, LineFamily()).state() == json.loads(
        json.dumps(core.state()))


def test_initial_tasks_are_seeded_and_within_max_difficulty():
    a = EnvAdapterCore(LineFamily(), AdapterConfig(n_slots=6, seed=5, max_difficulty=0.3))
    b = EnvAdapterCore(LineFamily(), AdapterConfig(n_slots=6, seed=5, max_difficulty=0.3))
    assert a.tasks_for_step() == b.tasks_for_step()
    assert all(s.active.params[0] <= 0.3 for s in a.slots)
    m = a.metrics()
    assert m["mean_active_difficulty"] == pytest.approx(
        sum(s.active.params[0] for s in a.slots) / 6)
    assert m["last_accuracy"] == [None] * 6 and m["pending"] == 0


# ---------------------------------------------------------------------------- real families
def test_household_cycle_proposes_a_harder_task_the_expert_solves():
    family = make_family("household")
    core = EnvAdapterCore(family, AdapterConfig(n_slots=2, seed=2, max_difficulty=0.5))
    old = [s.active for s in core.slots]
    out = core.report(results(core, {(0, "active"): 1.0, (1, "active"): 0.5}))
    (proposal,) = out["proposed"]
    cand = core.slots[0].pending.task
    assert proposal["to"] == cand.task_id and cand.root_id == old[0].task_id
    assert family.difficulty(cand) > family.difficulty(old[0])
    assert demonstrate(family, cand).success
    out = core.report(results(core, {(0, "candidate"): 0.5, (1, "active"): 0.5}))
    assert [e["to"] for e in out["accepted"]] == [cand.task_id]
    assert core.slots[0].active == cand and core.slots[1].active == old[1]


def household_proposal(request: JudgeRequest, n: int, temperature: float) -> list[str]:
    """A judge function for ``build_family``'s function backend."""
    return ['harder: more clutter\n{"params": [0.2, 0.9, 0.2, 0.2], "reason": "clutter"}'] * n


class FakeBackend:
    """An async environment model that moves the distractors axis in the asked direction."""

    def __init__(self) -> None:
        self.calls = 0

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        self.calls += 1
        harder = "make the task harder" in request.messages[1]["content"]
        params = [0.2, 0.9 if harder else 0.0, 0.2, 0.2]
        return [json.dumps({"params": params, "reason": "distractors"})] * n


async def test_llm_family_rewrites_through_the_async_path():
    family = LLMRewriteFamily(HouseholdFamily(), FakeBackend())
    core = EnvAdapterCore(family, AdapterConfig(n_slots=2, seed=0))
    core.slots[0].active = family.generate([0.2, 0.2, 0.2, 0.2], seed=11)
    core.slots[1].active = family.generate([0.2, 0.5, 0.2, 0.2], seed=12)
    out = await core.areport(results(core, {(0, "active"): 1.0, (1, "active"): 0.0}))
    assert [(p["direction"], p["source"], p["reason"]) for p in out["proposed"]] == [
        ("harder", "llm", "distractors"), ("easier", "llm", "distractors")]
    assert family.stats == {"llm": 2, "fallback": 0} and family.backend.calls == 2
    assert core.slots[0].pending.task.params[1] == pytest.approx(0.9)  # the model's point
    assert core.metrics()["source/llm"] == 2
    assert demonstrate(family, core.slots[0].pending.task).success
    with pytest.raises(RuntimeError, match="areport"):  # the sync call inside a loop
        core.report([])


def test_sync_report_runs_an_llm_familys_rewrites_and_build_family_wires_the_backend():
    family = build_family("household", llm_rewrite={
        "judge": {"backend": "function", "function": f"{__name__}:household_proposal"},
        "temperature": 0.0})
    assert isinstance(family, LLMRewriteFamily) and family.temperature == 0.0
    core = EnvAdapterCore(family, AdapterConfig(n_slots=1))
    core.slots[0].active = family.generate([0.2, 0.2, 0.2, 0.2], seed=11)
    (proposal,) = core.report(results(core, {(0, "active"): 1.0}))["proposed"]
    assert proposal["source"] == "llm" and family.stats["llm"] == 1


# ---------------------------------------------------------------------------- actor
@pytest.mark.ray
def test_actor_resumes_slots_and_candidates_from_its_checkpoint(ray_cluster, tmp_path):
    ray = ray_cluster
    ckpt = str(tmp_path / "adapter.json")

    def make():
        actor = get_or_create_env_adapter(
            f"env-adapter-{uuid.uuid4().hex[:8]}", namespace="clawray-tests",
            family_name="household", n_slots=2, seed=4, checkpoint_path=ckpt)
        assert ray.get(actor.ping.remote(), timeout=60) == "pong"
        return actor

    a = make()
    tasks = ray.get(a.tasks_for_step.remote())
    assert [(t["slot"], t["role"]) for t in tasks] == [(0, "active"), (1, "active")]
    res = [{"slot": t["slot"], "role": t["role"], "task_id": Task.from_dict(t["task"]).task_id,
            "rewards": [1, 1, 1, 1] if t["slot"] == 0 else [1, 0, 0, 1], "critique": None}
           for t in tasks]
    out = ray.get(a.report.remote(res, step_id=1))
    assert [p["slot"] for p in out["proposed"]] == [0]
    before = ray.get(a.state.remote())
    assert before["slots"][0]["pending"] is not None
    ray.kill(a, no_restart=True)

    b = make()
    assert ray.get(b.state.remote()) == before
    assert ray.get(b.report.remote(res, step_id=1)) == out  # a retried report
    m = ray.get(b.metrics.remote())
    assert (m["proposed"], m["pending"], m["last_accuracy"]) == (1, 1, [1.0, 0.5])
    tasks = ray.get(b.tasks_for_step.remote())
    cand = next(t for t in tasks if t["role"] == "candidate")
    out = ray.get(b.report.remote([{"slot": 0, "role": "candidate",
                                    "task_id": Task.from_dict(cand["task"]).task_id,
                                    "rewards": [1, 0, 0, 0], "critique": None}], step_id=2))
    assert len(out["accepted"]) == 1
    assert ray.get(b.save.remote()) == ckpt
    ray.kill(b, no_restart=True)
