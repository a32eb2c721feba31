"""The tool_use family: seeded tasks, the expert, the step oracle, malformed calls, rewrites."""

from __future__ import annotations

import json
import random

import pytest

from clawray.envs import Action, EnvError, demonstrate, make_family
from clawray.envs.tool_use import ToolUseEnv, ToolUseFamily, final_number


@pytest.fixture(scope="module")
def family() -> ToolUseFamily:
    fam = make_family("tool_use")
    assert isinstance(fam, ToolUseFamily)
    return fam


def random_tasks(family: ToolUseFamily, n: int, seed: int = 0):
    rng = random.Random(seed)
    return [family.sample(rng) for _ in range(n)]


def tool_names(tools) -> list[str]:
    return [t["function"]["name"] for t in tools]


def test_same_params_and_seed_give_the_same_task(family):
    a = family.generate([0.3, 0.6, 0.2, 0.9], seed=11)
    b = family.generate([0.3, 0.6, 0.2, 0.9], seed=11)
    assert a.task_id == b.task_id and a.spec == b.spec
    others = {family.generate([0.3, 0.6, 0.2, 0.9], seed=s).task_id for s in range(20)}
    assert len(others) == 20


def test_params_are_clipped_and_counted(family):
    task = family.generate([-3.0, 2.0, 0.5, 7.0], seed=1)
    assert task.params == (0.0, 1.0, 0.5, 1.0)
    with pytest.raises(EnvError, match="expected 4 params"):
        family.generate([0.5, 0.5], seed=1)


def test_difficulty_params_move_the_task_the_documented_way(family):
    easy = [family.generate([0, 0, 0, 0], s).spec for s in range(50)]
    hard = [family.generate([1, 1, 1, 1], s).spec for s in range(50)]
    assert all(len(s["plan"]) == 1 and s["digits"] == 1 and s["n_distractors"] == 0
               and s["slack"] == 4 for s in easy)
    assert all(len(s["plan"]) == 6 and s["digits"] == 3 and s["n_distractors"] == 4
               and s["slack"] == 1 for s in hard)
    assert all(all(100 <= v <= 999 for v in s["table"].values()) for s in hard)
    assert set(tool_names(ToolUseFamily.tools)) >= set(tool_names(hard[0]["tools"]))


def test_expert_always_succeeds_and_every_expert_step_is_progress(family):
    for task in random_tasks(family, 300):
        demo = demonstrate(family, task)
        assert demo.success, task.to_dict()
        assert len(demo.steps) == task.spec["optimal_steps"] <= task.spec["budget"]
        env = family.make_env()
        env.reset(task)
        for _, action in demo.steps:
            assert env.step(action).progress


def test_random_policy_mostly_fails(family):
    rng = random.Random(7)
    wins, tasks = 0, random_tasks(family, 300, seed=3)
    for task in tasks:
        env = family.make_env()
        env.reset(task)
        while True:
            if rng.random() < 0.5:
                tool = rng.choice(env.tools)["function"]
                props = tool["parameters"]["properties"]
                action = Action.call(tool["name"], {k: rng.randint(0, 20) for k in props})
            else:
                action = Action(content=f"I think it is {rng.randint(0, 999)}")
            result = env.step(action)
            if result.done:
                wins += bool(result.success)
                break
    assert wins / len(tasks) < 0.1


def test_tool_results_come_back_as_tool_messages_with_the_call_ids(family):
    task = family.generate([0.5, 0.0, 0.0, 0.0], seed=4)
    env = family.make_env()
    env.reset(task)
    first = task.spec["items"][0]["name"]
    action = Action("", [
        {"id": "call_a", "type": "function",
         "function": {"name": "lookup", "arguments": json.dumps({"name": first})}},
        {"id": "call_b", "type": "function",
         "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})}},
    ])
    result = env.step(action)
    assert [(m["role"], m["tool_call_id"]) for m in result.messages] == [
        ("tool", "call_a"), ("tool", "call_b")]
    assert result.messages[0]["content"] == str(task.spec["table"][first])
    assert result.messages[1]["content"] == "5"
    assert result.valid and result.progress and not result.done


def test_plural_and_case_insensitive_lookups(family):
    task = next(t for t in random_tasks(family, 50) if t.spec["flavour"] == "zoo")
    env = family.make_env()
    env.reset(task)
    name = task.spec["items"][0]["name"]
    result = env.step(Action.call("lookup", {"name": name.upper()}))
    assert result.valid and result.messages[0]["content"] == str(task.spec["table"][name])


@pytest.mark.parametrize("text_or_action", [
    '<tool_call>\n{"name": "add", "arguments": {a: 1}}\n</tool_call>',  # bad JSON in the block
    Action.call("divide", {"a": 1, "b": 2}),  # unknown tool
    Action.call("add", {"a": 1}),  # missing argument
    Action.call("add", {"a": 1, "b": "two"}),  # ill-typed argument
    Action.call("add", {"a": 1, "b": 2, "c": 3}),  # extra argument
    Action.call("lookup", {"name": "unicorn"}),  # not in the table
    Action("", [{"id": "call_x", "type": "function",
                 "function": {"name": "add", "arguments": "{not json"}}]),
])
def test_malformed_calls_get_an_error_and_do_not_end_the_episode(family, text_or_action):
    task = family.generate([0.5, 0.5, 0.0, 0.0], seed=2)
    env = family.make_env()
    env.reset(task)
    result = env.step(text_or_action)
    assert not result.valid and not result.done and not result.progress
    assert len(result.messages) == 1 and result.messages[0]["content"].startswith("error:")
    if isinstance(text_or_action, Action):
        assert result.messages[0]["role"] == "tool"
        assert result.messages[0]["tool_call_id"] == text_or_action.tool_calls[0]["id"]
    else:
        assert result.messages[0]["role"] == "user"
    assert demonstrate(family, task).success  # the task is still solvable afterwards


def test_the_final_answer_rule(family):
    assert final_number("Total: 1,234 coins.") == 1234
    assert final_number("3 apples cost 12.0") == 12
    assert final_number("no number here") is None
    task = family.generate([0.2, 0.2, 0.0, 0.0], seed=9)
    answer = task.spec["answer"]
    for text, ok in [(f"It is {answer}.", True), (f"{answer} or maybe {answer + 1}", False),
                     ("I don't know", False)]:
        env = family.make_env()
        env.reset(task)
        result = env.step(text)
        assert result.done and result.success is ok and result.progress is ok


def test_running_out_of_steps_ends_the_episode_as_a_failure(family):
    task = family.generate([0.5, 0.5, 0.5, 1.0], seed=5)
    env = family.make_env()
    env.reset(task)
    for i in range(task.spec["budget"]):
        result = env.step(Action.call("add", {"a": 0, "b": 0}))
        assert result.done is (i == task.spec["budget"] - 1)
    assert result.success is False and result.info["reason"] == "out of steps"
    with pytest.raises(EnvError):
        env.step("42")
    with pytest.raises(EnvError):
        env.expert_action()


@pytest.mark.parametrize("direction", ["harder", "easier"])
def test_rewrites_are_solvable_and_keep_root_depth_and_flavour(family, direction):
    from clawray.envs.tool_use import _hardness

    moved = 0
    for task in random_tasks(family, 60, seed=5):
        new = family.rewrite(task, direction, seed=1)
        assert new.root == task.task_id and new.depth == 1 and new.family == task.family
        assert new.spec["flavour"] == task.spec["flavour"]
        assert demonstrate(family, new).success
        delta = _hardness(new.spec) - _hardness(task.spec)
        assert (delta >= 0) if direction == "harder" else (delta <= 0)
        moved += delta != 0
        again = family.rewrite(new, direction)
        assert again.root == task.task_id and again.depth == 2
    assert moved >= 50


def test_history_renders_through_the_chat_template_and_actions_round_trip(family):
    from clawray.models.loader import load_tokenizer
    from clawray.models.tiny import build_embedded_default

    tok = load_tokenizer(build_embedded_default())
    for task in random_tasks(family, 20, seed=8):
        env = family.make_env()
        history = env.reset(task)
        while True:
            action = env.expert_action()
            parsed = Action.from_text(action.text())
            assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                    for c in parsed.tool_calls] == [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in action.tool_calls]
            assert parsed.content == action.content
            result = env.step(action)
            history = history + [action.message()] + result.messages
            if result.done:
                break
        prompt = tok.apply_chat_template(history, tools=env.tools, add_generation_prompt=True,
                                         tokenize=False)
        assert task.spec["goal"] in prompt and "<tool_response>" in prompt
        assert all(name in prompt for name in tool_names(env.tools))


def test_env_tools_need_a_task():
    with pytest.raises(EnvError, match="reset"):
        ToolUseEnv().tools
