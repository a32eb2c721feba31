"""Gymnasium text envs as clawray task families (``make_family("gym:<env id>")``)."""

from __future__ import annotations

import re
import string

import gymnasium
import pytest
from gymnasium import spaces

from clawray.envs import EnvError, demonstrate, make_family
from clawray.envs.gym import GymTextFamily


class GuessEnv(gymnasium.Env):
    """Guess a secret number in [1, high]; ``high`` grows with the one difficulty param."""

    def __init__(self) -> None:
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=200, charset=string.printable)
        self.steps_taken = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        (difficulty,) = (options or {}).get("params", [0.0])
        self.high = 4 + round(96 * difficulty)
        self.secret = int(self.np_random.integers(1, self.high + 1))
        return f"Guess my number between 1 and {self.high}.", {}

    def step(self, action):
        self.steps_taken += 1
        m = re.search(r"-?\d+", action)
        if m is None:
            return "Say a number.", 0.0, False, False, {}
        guess = int(m.group())
        if guess == self.secret:
            return "Correct!", 1.0, True, False, {}
        return ("Too low." if guess < self.secret else "Too high."), 0.0, False, False, {}

    def expert_action(self) -> str:
        return str(self.secret)


class DoorEnv(gymnasium.Env):
    """Pick one of doors 1..5 (Discrete(5, start=1)); dict observations; info["success"]."""

    def __init__(self) -> None:
        self.observation_space = spaces.Dict(
            {"text": spaces.Text(max_length=200, charset=string.printable)})
        self.action_space = spaces.Discrete(5, start=1)
        self.steps_taken = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.prize = int(self.np_random.integers(1, 6))
        return {"text": "Five doors, numbered 1 to 5. Which one do you open?"}, {}

    def step(self, action):
        self.steps_taken += 1
        won = int(action) == self.prize
        # a consolation reward that the success flag overrides
        return ({"text": "You won!" if won else "Empty room."}, 0.5, True, False,
                {"success": won})


class BoxEnv(gymnasium.Env):
    def __init__(self) -> None:
        self.observation_space = spaces.Text(max_length=20)
        self.action_space = spaces.Box(-1.0, 1.0, shape=(2,))


gymnasium.register(id="clawray-test/Guess-v0", entry_point=GuessEnv)
gymnasium.register(id="clawray-test/Door-v0", entry_point=DoorEnv)
gymnasium.register(id="clawray-test/Box-v0", entry_point=BoxEnv)
PARAMS = [{"name": "range", "low": 0.0, "high": 1.0, "doc": "size of the number range"}]


@pytest.fixture(scope="module")
def guess() -> GymTextFamily:
    family = make_family("gym:clawray-test/Guess-v0", params=PARAMS, max_steps=10)
    assert isinstance(family, GymTextFamily) and family.name == "gym:clawray-test/Guess-v0"
    return family


def test_tasks_are_seeded_and_carry_params_to_the_env(guess):
    a, b = guess.generate([0.5], seed=3), guess.generate([0.5], seed=3)
    assert a.task_id == b.task_id
    assert a.spec == {"env_id": "clawray-test/Guess-v0", "params": [0.5], "seed": 3,
                      "goal": "Guess my number between 1 and 52."}
    assert guess.generate([7.0], seed=3).params == (1.0,)
    with pytest.raises(EnvError, match="expected 1 params"):
        guess.generate([0.1, 0.2], seed=3)


def test_reset_step_done_and_success(guess):
    task = guess.generate([0.0], seed=1)
    env = guess.make_env()
    history = env.reset(task)
    assert [m["role"] for m in history] == ["system", "user"]
    assert history[1]["content"] == "Guess my number between 1 and 4."
    secret = env._env.unwrapped.secret
    wrong = 1 if secret != 1 else 2
    miss = env.step(f"I guess {wrong}")
    assert miss.valid and not miss.done and not miss.progress and miss.success is None
    assert miss.messages == [{"role": "user",
                              "content": "Too low." if wrong < secret else "Too high."}]
    hit = env.step(str(secret))
    assert hit.done and hit.success and hit.progress and hit.info["return"] == 1.0
    with pytest.raises(EnvError):
        env.step("1")


def test_max_steps_ends_the_episode_as_a_failure(guess):
    env = guess.make_env()
    env.reset(guess.generate([1.0], seed=2))
    results = [env.step("no idea") for _ in range(10)]
    assert [r.done for r in results] == [False] * 9 + [True]
    assert results[-1].success is False


def test_the_expert_succeeds(guess):
    for seed in range(20):
        demo = demonstrate(guess, guess.generate([seed / 20], seed))
        assert demo.success and len(demo.steps) == 1


def test_rewrite_moves_params_and_keeps_the_seed_and_root(guess):
    task = guess.generate([0.5], seed=4)
    harder = guess.rewrite(task, "harder")
    assert harder.params == (0.75,) and harder.seed == 4
    assert harder.root == task.task_id and harder.depth == 1
    assert harder.spec["goal"] == "Guess my number between 1 and 76."
    easier = guess.rewrite(harder, "easier")
    assert easier.params == (0.5,) and easier.depth == 2 and easier.root == task.task_id
    assert demonstrate(guess, harder).success
    with pytest.raises(EnvError, match="hardest"):
        guess.rewrite(guess.generate([1.0], seed=4), "harder")


def test_discrete_actions_parse_the_first_integer_and_reject_bad_ones_without_stepping():
    family = make_family("gym:clawray-test/Door-v0", max_steps=3)
    task = family.generate([], seed=0)
    assert task.description.startswith("Five doors")
    env = family.make_env()
    env.reset(task)
    for text in ["door 9 please", "the middle one"]:
        result = env.step(text)
        assert not result.valid and not result.done and not result.progress
        assert result.messages[0]["role"] == "user" and "from 1 to 5" in \
            result.messages[0]["content"]
    assert env._env.unwrapped.steps_taken == 0
    prize = env._env.unwrapped.prize
    result = env.step(f"door {prize}, then door {prize % 5 + 1}")
    assert result.valid and result.done and result.success  # info["success"] decides
    env.reset(task)
    result = env.step(str(prize % 5 + 1))
    assert result.done and result.success is False and result.progress  # reward 0.5 > 0


def test_invalid_actions_use_up_the_step_budget():
    family = make_family("gym:clawray-test/Door-v0", max_steps=2)
    env = family.make_env()
    env.reset(family.generate([], seed=0))
    assert not env.step("nope").done
    last = env.step("nope again")
    assert last.done and last.success is False and not last.valid


def test_envs_without_expert_or_params_say_so():
    family = make_family("gym:clawray-test/Door-v0")
    env = family.make_env()
    env.reset(family.generate([], seed=0))
    with pytest.raises(EnvError, match="no expert"):
        env.expert_action()
    with pytest.raises(EnvError, match="no difficulty params"):
        family.rewrite(family.generate([], seed=0), "harder")


def test_unsupported_action_spaces_and_unknown_ids_are_refused():
    with pytest.raises(EnvError, match="action space .*Box.* not supported"):
        make_family("gym:clawray-test/Box-v0")
    with pytest.raises(EnvError, match="cannot make"):
        make_family("gym:clawray-test/Nope-v0")
    with pytest.raises(EnvError, match="name, low and high"):
        make_family("gym:clawray-test/Guess-v0", params=[{"name": "x"}])
