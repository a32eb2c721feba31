"""The household task family: seeded generation, the expert and the step oracle (checked against
breadth-first search), the action rules, rewrites, a random baseline and observation length."""

from __future__ import annotations

import json
import random
import statistics
from collections import deque

import pytest

from clawray.envs import Action, EnvError, Task, demonstrate, make_family
from clawray.envs.household import (HouseholdEnv, HouseholdFamily, World, admissible, apply,
                                    counts, plan, satisfied)

FAMILY = HouseholdFamily()


def uniform_tasks(n: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    return [FAMILY.generate([rng.random() for _ in FAMILY.params], rng.randrange(2**31))
            for _ in range(n)]


def actions_in(observation: str) -> list[str]:
    line = [x for x in observation.splitlines() if x.startswith("actions: ")][-1]
    return line[len("actions: "):].split(" | ")


def random_success_rate(tasks: list[Task], seed: int) -> float:
    """Play each task uniformly over the actions the observation lists."""
    rng, wins = random.Random(seed), 0
    for task in tasks:
        env = FAMILY.make_env()
        obs = env.reset(task)[-1]["content"]
        while True:
            result = env.step(rng.choice(actions_in(obs)))
            obs = result.messages[0]["content"]
            if result.done:
                wins += bool(result.success)
                break
    return wins / len(tasks)


def play_expert(task: Task) -> tuple[bool, int, list[bool]]:
    env = FAMILY.make_env()
    env.reset(task)
    progress = []
    while True:
        result = env.step(env.expert_action())
        progress.append(result.progress)
        assert result.valid
        if result.done:
            return bool(result.success), len(progress), progress


def state_key(w: World) -> tuple:
    return (w.at, w.held, frozenset(w.opened),
            tuple(sorted((n, o.state, o.at) for n, o in w.objects.items())))


def bfs_length(world: World, goal) -> int:
    """The true shortest number of actions to the goal, by breadth-first search."""
    frontier, seen = deque([(world, 0)]), {state_key(world)}
    while frontier:
        w, depth = frontier.popleft()
        if satisfied(w, goal):
            return depth
        for action in admissible(w):
            nxt = w.copy()
            apply(nxt, action)
            if state_key(nxt) not in seen:
                seen.add(state_key(nxt))
                frontier.append((nxt, depth + 1))
    raise AssertionError("unsolvable")


def test_generation_is_seeded_and_params_are_clipped():
    a, b = FAMILY.generate([0.3, 0.6, 0.5, 0.2], 7), FAMILY.generate([0.3, 0.6, 0.5, 0.2], 7)
    assert a == b and a.task_id == b.task_id and a.spec == b.spec
    others = {FAMILY.generate([0.3, 0.6, 0.5, 0.2], s).task_id for s in range(20)}
    assert len(others) == 20
    assert FAMILY.generate([-1, 2, 0.5, 9], 3).params == (0.0, 1.0, 0.5, 1.0)
    assert FAMILY.generate([-1, 2, 0.5, 9], 3) == FAMILY.generate([0, 1, 0.5, 1], 3)
    for bad in ([0.5] * 3, [0.5] * 5, [float("nan")] * 4):
        with pytest.raises(EnvError, match="household"):
            FAMILY.generate(bad, 0)
    assert Task.from_dict(json.loads(json.dumps(a.to_dict()))).task_id == a.task_id


def test_difficulty_axes_change_the_world_as_documented():
    easy, hard = FAMILY.generate([0] * 4, 5).spec, FAMILY.generate([1] * 4, 5).spec
    assert len(easy["receptacles"]) == 3 and len(hard["receptacles"]) == 10
    assert len(easy["objects"]) == 1 and len(hard["objects"]) == 9
    assert easy["state"] is None and hard["state"] in ("clean", "hot", "cold")
    assert easy["budget"] == easy["optimal"] + 6 and hard["budget"] == hard["optimal"] + 1
    assert easy["type"] == hard["type"] and easy["target"] == hard["target"]  # same seed, goal
    for task in uniform_tasks(200, 1):
        s = task.spec
        hidden = {r["name"] for r in s["receptacles"] if r["closed"]}
        goal_objects = [o for o in s["objects"] if o["type"] == s["type"]]
        assert all(o["at"] != s["target"] for o in goal_objects)
        if s["state"]:  # a transform is always needed
            assert all(o["state"] != s["state"] for o in goal_objects)
        if task.params[2] >= 2 / 3:
            assert all(o["at"] in hidden for o in goal_objects)


def test_expert_solves_every_task_within_budget_making_progress_each_step():
    tasks = uniform_tasks(400, 2) + [FAMILY.generate([0] * 4, s) for s in range(50)] \
        + [FAMILY.generate([1] * 4, s) for s in range(50)]
    for task in tasks:
        assert demonstrate(FAMILY, task).success
        success, steps, progress = play_expert(task)
        assert success and steps == task.spec["optimal"] <= task.spec["budget"]
        assert all(progress), task.task_id


def test_plan_length_is_optimal_by_breadth_first_search():
    rng = random.Random(3)
    for seed in range(60):
        task = FAMILY.generate([0.15 * rng.random(), 0.3 * rng.random(), rng.random(), 0], seed)
        env = FAMILY.make_env()
        env.reset(task)
        for _ in range(6):  # also from states a random walk reaches (held objects, open doors)
            if satisfied(env.world, env.goal):
                break
            assert len(plan(env.world, env.goal)) == bfs_length(env.world, env.goal)
            apply(env.world, rng.choice(admissible(env.world)))


def test_progress_is_false_for_detours_and_true_for_plan_steps():
    task = FAMILY.generate([0.5, 0.5, 0.5, 0], 11)
    env = FAMILY.make_env()
    env.reset(task)
    best = env.expert_action().content
    detours = [a for a in admissible(env.world) if a != best]
    result = env.step(random.Random(0).choice(detours))
    assert result.valid and not result.progress
    assert env.step(env.expert_action()).progress


def test_invalid_actions_nothing_happens_and_a_step_is_spent():
    task = FAMILY.generate([0, 0, 0, 0], 4)
    env = FAMILY.make_env()
    opening = env.reset(task)
    assert [m["role"] for m in opening] == ["system", "user"]
    for bad in ("fly to the moon", "take mug 1 from shelf 9", "",
                Action.call("go_to", {"place": "shelf 1"})):
        result = env.step(bad)
        assert not result.valid and not result.progress and not result.done
        assert result.messages[0]["content"].startswith("nothing happens.")
        assert result.messages[0]["role"] == "user"
    assert env.steps == 4
    go = env.expert_action().content
    result = env.step("  " + go.upper().replace(" ", "   ") + ". ")
    assert result.valid and result.progress and result.info["action"] == go


def test_out_of_steps_then_step_after_done_raises():
    task = FAMILY.generate([0, 0, 0, 1], 6)
    env = FAMILY.make_env()
    with pytest.raises(EnvError, match="reset"):
        env.step("go to shelf 1")
    env.reset(task)
    for i in range(task.spec["budget"]):
        result = env.step("wait")
        assert result.done == (i == task.spec["budget"] - 1)
    assert result.success is False and result.messages[0]["content"].startswith("out of steps.")
    with pytest.raises(EnvError, match="over"):
        env.step("wait")
    with pytest.raises(EnvError, match="over"):
        env.expert_action()
    env.reset(task)  # a new episode on the same env
    for _ in range(task.spec["optimal"]):
        result = env.step(env.expert_action())
    assert result.done and result.success and "you did it." in result.messages[0]["content"]


def test_observations_are_markov_and_hide_closed_storage():
    task = FAMILY.generate([0, 0, 0, 0], 9)
    env = FAMILY.make_env()
    first = env.reset(task)[1]["content"]
    obj = task.spec["objects"][0]  # the only object at distractors 0
    assert first.startswith(f"task: {task.spec['goal']}.")
    assert f"{obj['at']}: {obj['name']}" in first  # visible where it lies, from the start
    hidden = FAMILY.generate([0, 0, 1, 0], 9)  # the goal object inside closed storage
    name, where = hidden.spec["objects"][0]["name"], hidden.spec["objects"][0]["at"]
    first = env.reset(hidden)[1]["content"]
    assert name not in first and f"{where}: closed." in first
    assert env.step(f"go to {where}").valid
    assert name in env.step(f"open {where}").messages[0]["content"]


def test_random_policy_mostly_fails():
    # Measured over 1000 tasks: params 0 → 0.11, uniform params → 0.003, params 1 → 0.0.
    assert random_success_rate(uniform_tasks(300, 4), seed=0) < 0.25
    easy = [FAMILY.generate([0] * 4, s) for s in range(300)]
    assert random_success_rate(easy, seed=1) < 0.4
    assert all(demonstrate(FAMILY, t).success for t in easy)


@pytest.mark.parametrize("direction", ["harder", "easier"])
def test_rewrites_are_solvable_and_move_the_params(direction):
    sign = 1 if direction == "harder" else -1
    for i, task in enumerate(uniform_tasks(150, 5)):
        try:
            new = FAMILY.rewrite(task, direction, critique="ignored", seed=i)
        except EnvError:
            continue
        assert new.root_id == task.root and new.depth == task.depth + 1 and new.seed == task.seed
        diffs = [sign * (b - a) for a, b in zip(task.params, new.params)]
        assert min(diffs) >= 0 and max(diffs) > 0
        assert new.spec["type"] == task.spec["type"] and new.spec["target"] == task.spec["target"]
        assert new.task_id != task.task_id and demonstrate(FAMILY, new).success
        again = FAMILY.rewrite(new, direction, seed=i)
        assert again.root_id == task.task_id and again.depth == 2


def test_rewrites_walk_to_the_box_limit_then_refuse():
    for direction, end in (("harder", (10, 8, 2, 1)), ("easier", (3, 0, 0, 6))):
        task = FAMILY.generate([0.5] * 4, 8)
        for _ in range(40):
            try:
                task = FAMILY.rewrite(task, direction, seed=task.depth)
            except EnvError as e:
                assert "limit" in str(e)
                break
            assert demonstrate(FAMILY, task).success
        assert counts(task.params) == end  # (receptacles, distractors, level, slack)
    with pytest.raises(EnvError, match="direction"):
        FAMILY.rewrite(task, "sideways")  # type: ignore[arg-type]


def test_observations_are_short_on_the_embedded_tokenizer(tiny_tokenizer):
    def lengths(params: list[float]) -> list[int]:
        out = []
        for seed in range(100):
            env, task = FAMILY.make_env(), FAMILY.generate(params, seed)
            texts = [env.reset(task)[1]["content"]]
            while True:
                result = env.step(env.expert_action())
                texts.append(result.messages[0]["content"])
                if result.done:
                    break
            out += [len(tiny_tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        return out

    easy, hard = statistics.median(lengths([0] * 4)), statistics.median(lengths([1] * 4))
    print(f"median tokens per observation: params 0 → {easy}, params 1 → {hard}")
    assert easy < 90 and easy < hard


def test_make_family_builds_the_household_family():
    family = make_family("household")
    assert isinstance(family, HouseholdFamily) and family.tools is None
    assert [p.name for p in family.params] == ["receptacles", "distractors", "substeps", "budget"]
    task = family.sample(random.Random(0))
    assert task.family == "household" and task.description == task.spec["goal"]
    assert isinstance(family.make_env(), HouseholdEnv)
