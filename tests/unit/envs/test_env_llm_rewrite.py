"""LLM-driven rewrites: the prompt, the proposal parser, and ``LLMRewriteFamily`` accepting a
proposal that moves difficulty the right way (the expert still solves the task) or falling back
to the family's programmatic rewrite when the proposal is wrong, unparseable or the backend
fails."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from clawray.envs import EnvError, Task, demonstrate, make_family
from clawray.envs.base import SubBox
from clawray.envs.household import HouseholdFamily
from clawray.envs.llm_rewrite import (LLMRewriteFamily, build_rewrite_prompt, parse_rewrite,
                                      with_llm_rewrite)
from clawray.envs.tool_use import ToolUseFamily
from clawray.judging.backends import FunctionBackend
from clawray.judging.prompts import JudgeRequest

HOUSEHOLD = HouseholdFamily()
TOOL_USE = ToolUseFamily()
CRITIQUE = "the agent never opened closed storage and ran out of steps twice"


def answer(params: list[Any], reason: str = "more distractors", thinking: str = "") -> str:
    return (thinking or "The agent copes with few receptacles; add clutter.") + "\n" + \
        json.dumps({"params": params, "reason": reason})


class Canned:
    """A backend that returns fixed texts (or raises) and records its calls."""

    def __init__(self, *texts: str, error: Exception | None = None) -> None:
        self.texts, self.error = list(texts), error
        self.calls: list[tuple[JudgeRequest, int, float, int]] = []

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        self.calls.append((request, n, temperature, max_tokens))
        if self.error is not None:
            raise self.error
        return self.texts[:n]


def propose_harder(request: JudgeRequest, n: int, temperature: float) -> list[str]:
    """A judge function (imported by path by ``FunctionBackend``)."""
    return [answer([0.9, 0.9, 0.9, 0.9], "everything harder")] * n


@pytest.fixture
def house_task() -> Task:
    return HOUSEHOLD.generate([0.2, 0.2, 0.2, 0.2], seed=11)


# ---------------------------------------------------------------------------- prompt
@pytest.mark.parametrize("family", [HOUSEHOLD, TOOL_USE], ids=lambda f: f.name)
def test_prompt_names_every_axis_the_direction_the_critique_and_the_task(family):
    task = family.generate([0.3, 0.4, 0.5, 0.6], seed=3)
    system, user = build_rewrite_prompt(family, task, "harder", CRITIQUE)
    assert system["role"] == "system" and user["role"] == "user"
    assert "harder" in system["content"] and '{"params"' in system["content"]
    for p in family.params:
        assert p.name in user["content"] and p.doc in user["content"]
    assert "low 0, high 1" in user["content"]
    assert "[0.3, 0.4, 0.5, 0.6]" in user["content"]
    assert CRITIQUE in user["content"] and "make the task harder" in user["content"]
    assert task.description in user["content"]
    opening = family.make_env().reset(task)[-1]["content"]
    assert opening in user["content"]  # what the agent sees at reset


def test_prompt_without_critique_says_so_and_bounds_the_observation(house_task):
    _, user = build_rewrite_prompt(HOUSEHOLD, house_task, "easier", None,
                                   max_observation_chars=40)
    assert "failed attempts:\n(none given)" in user["content"]
    assert "make the task easier" in user["content"] and "[... truncated]" in user["content"]


# ---------------------------------------------------------------------------- parser
def test_parse_rewrite_takes_the_last_params_object():
    text = ('First idea: {"params": [0.1, 0.1, 0.1, 0.1], "reason": "x"}. Better:\n'
            '```json\n{"params": [0.5, 0.25, 1, 0], "reason": "y"}\n```\n'
            '{"note": "no params here"}')
    assert parse_rewrite(text, HOUSEHOLD) == [0.5, 0.25, 1.0, 0.0]


@pytest.mark.parametrize("text", [
    "no json at all",
    '{"params": [0.5, 0.5, 0.5]}',  # too short
    '{"params": [0.5, 0.5, 0.5, 0.5, 0.5]}',  # too long
    '{"params": [0.5, "0.5", 0.5, 0.5]}',  # a string
    '{"params": [0.5, true, 0.5, 0.5]}',  # a boolean
    '{"params": [0.5, null, 0.5, 0.5]}',
    '{"params": [0.5, NaN, 0.5, 0.5]}',
    '{"params": {"receptacles": 0.5}}',
    '{"params": [0.5, 0.5, 0.5, 0.5]} then {"params": [1, 2]}',  # the last one decides
    '{"params": [0.5, 0.5, 0.5, 0.5',  # truncated
])
def test_parse_rewrite_rejects_missing_wrong_length_and_non_numbers(text):
    assert parse_rewrite(text, HOUSEHOLD) is None


def test_parse_rewrite_clips_to_the_family_box():
    assert parse_rewrite('{"params": [-3, 0.5, 7, 1.0]}', HOUSEHOLD) == [0.0, 0.5, 1.0, 1.0]
    small = SubBox(HOUSEHOLD, 0.5)
    assert parse_rewrite('{"params": [1, 1, 1, 0.2]}', small) == [0.5, 0.5, 0.5, 0.2]


# ---------------------------------------------------------------------------- llm rewrites
async def test_a_harder_proposal_gives_an_llm_task_that_keeps_the_root_and_is_solvable(
        house_task):
    backend = Canned(answer([0.6, 0.5, 0.7, 0.4], "hide the object in closed storage"))
    family = LLMRewriteFamily(HOUSEHOLD, backend, temperature=0.3, max_tokens=200)
    new, info = await family.arewrite(house_task, "harder", CRITIQUE, seed=5)

    assert info == {"source": "llm", "reason": "hide the object in closed storage",
                    "raw": backend.texts[0]}
    assert new.params == (0.6, 0.5, 0.7, 0.4)
    assert new.spec == HOUSEHOLD.generate(new.params, house_task.seed).spec
    assert HOUSEHOLD.difficulty(new) > HOUSEHOLD.difficulty(house_task)
    assert (new.root_id, new.depth, new.seed) == (house_task.task_id, 1, house_task.seed)
    assert new.spec["type"] == house_task.spec["type"]  # same goal stream
    assert demonstrate(HOUSEHOLD, new).success
    assert family.stats == {"llm": 1, "fallback": 0}
    request, n, temperature, max_tokens = backend.calls[0]
    assert (n, temperature, max_tokens) == (1, 0.3, 200)
    assert request.kind == "env_rewrite" and CRITIQUE in request.messages[1]["content"]


async def test_a_chain_of_rewrites_keeps_the_first_root(house_task):
    first = HOUSEHOLD.rewrite(house_task, "harder", seed=1)
    family = LLMRewriteFamily(HOUSEHOLD, Canned(answer([0.0, 0.0, 0.0, 0.0], "simplest")))
    new, info = await family.arewrite(first, "easier")
    assert info["source"] == "llm"
    assert HOUSEHOLD.difficulty(new) < HOUSEHOLD.difficulty(first)
    assert (new.root_id, new.depth) == (house_task.task_id, 2)
    assert demonstrate(HOUSEHOLD, new).success


async def test_the_first_acceptable_of_n_proposals_is_taken(house_task):
    backend = Canned("no idea", answer([0.1, 0.1, 0.1, 0.1]), answer([0.9, 0.2, 0.2, 0.2], "b"),
                     answer([1, 1, 1, 1], "c"))
    family = LLMRewriteFamily(HOUSEHOLD, backend, n=4)
    new, info = await family.arewrite(house_task, "harder")
    assert backend.calls[0][1] == 4
    assert (info["source"], info["reason"]) == ("llm", "b")
    assert new.params == (0.9, 0.2, 0.2, 0.2)


@pytest.mark.parametrize("text, why", [
    (answer([0.1, 0.1, 0.1, 0.1], "easier by mistake"), "is not harder"),
    (answer([0.21, 0.2, 0.2, 0.2], "tiny nudge"), "gives the same task"),  # same counts
    ("I would add more receptacles.", "no valid proposal"),
    (answer([0.9, 0.9, 0.9]), "no valid proposal"),
])
async def test_a_wrong_or_unparseable_proposal_falls_back_to_the_programmatic_rewrite(
        house_task, text, why):
    family = LLMRewriteFamily(HOUSEHOLD, Canned(text))
    new, info = await family.arewrite(house_task, "harder", CRITIQUE, seed=7)
    assert info["source"] == "fallback" and why in info["reason"] and info["raw"] == text
    assert new == HOUSEHOLD.rewrite(house_task, "harder", CRITIQUE, seed=7)
    assert family.stats == {"llm": 0, "fallback": 1}


async def test_a_failing_backend_falls_back_and_logs(house_task, caplog):
    family = LLMRewriteFamily(HOUSEHOLD, Canned(error=TimeoutError("judge timed out")))
    with caplog.at_level(logging.WARNING, logger="clawray.envs.llm_rewrite"):
        new, info = await family.arewrite(house_task, "easier", None, seed=2)
    assert info == {"source": "fallback", "raw": None,
                    "reason": "backend error: TimeoutError: judge timed out"}
    assert new == HOUSEHOLD.rewrite(house_task, "easier", None, seed=2)
    assert house_task.task_id in caplog.text and "judge timed out" in caplog.text
    assert family.stats == {"llm": 0, "fallback": 1}


async def test_tool_use_llm_rewrite_and_fallback():
    task = TOOL_USE.generate([0.2, 0.2, 0.2, 0.2], seed=4)
    family = LLMRewriteFamily(TOOL_USE, Canned(answer([0.8, 0.6, 0.5, 0.5], "more steps")))
    assert family.tools == TOOL_USE.tools and family.name == "tool_use"
    new, info = await family.arewrite(task, "harder", "the agent stops after one lookup")
    assert info["source"] == "llm"
    assert TOOL_USE.difficulty(new) > TOOL_USE.difficulty(task)
    assert (new.root_id, new.depth) == (task.task_id, 1)
    assert new.spec["flavour"] == task.spec["flavour"]
    assert demonstrate(family, new).success

    garbage = LLMRewriteFamily(TOOL_USE, Canned('{"params": "harder please"}'))
    fallback, info = await garbage.arewrite(task, "harder", None, seed=3)
    assert info["source"] == "fallback"
    assert fallback == TOOL_USE.rewrite(task, "harder", None, seed=3)
    assert demonstrate(TOOL_USE, fallback).success


async def test_a_function_backend_by_import_path_drives_a_made_family(house_task):
    family = with_llm_rewrite(make_family("household"),
                              FunctionBackend(f"{__name__}:propose_harder"), n=2)
    new, info = await family.arewrite(house_task, "harder")
    assert (info["source"], info["reason"]) == ("llm", "everything harder")
    assert new.params == (0.9, 0.9, 0.9, 0.9)
    assert demonstrate(family, new).success


async def test_proposals_stay_in_a_sub_box():
    small = SubBox(HOUSEHOLD, 0.5)
    task = small.generate([0.1, 0.1, 0.1, 0.1], seed=9)
    new, info = await LLMRewriteFamily(small, Canned(answer([1, 1, 1, 1]))).arewrite(
        task, "harder")
    assert info["source"] == "llm" and new.params == (0.5, 0.5, 0.5, 0.5)


# ---------------------------------------------------------------------------- sync path, errors
def test_sync_rewrite_runs_the_backend_when_no_loop_is_running(house_task):
    family = LLMRewriteFamily(HOUSEHOLD, Canned(answer([0.6, 0.6, 0.6, 0.6])))
    new = family.rewrite(house_task, "harder")
    assert new.params == (0.6, 0.6, 0.6, 0.6) and family.stats["llm"] == 1


async def test_sync_rewrite_inside_a_running_loop_says_to_use_arewrite(house_task):
    backend = Canned(answer([0.6, 0.6, 0.6, 0.6]))
    family = LLMRewriteFamily(HOUSEHOLD, backend)
    with pytest.raises(EnvError, match=r"running event loop.*await family\.arewrite"):
        family.rewrite(house_task, "harder")
    assert backend.calls == []


async def test_bad_direction_and_settings_are_rejected(house_task):
    backend = Canned(answer([0.6, 0.6, 0.6, 0.6]))
    family = LLMRewriteFamily(HOUSEHOLD, backend)
    with pytest.raises(EnvError, match="direction"):
        await family.arewrite(house_task, "sideways")  # type: ignore[arg-type]
    assert backend.calls == []
    with pytest.raises(EnvError, match="n and max_observation_chars"):
        LLMRewriteFamily(HOUSEHOLD, backend, n=0)
    with pytest.raises(EnvError, match="temperature"):
        LLMRewriteFamily(HOUSEHOLD, backend, temperature=-1)


def test_the_wrapper_delegates_generation_and_difficulty(house_task):
    family = with_llm_rewrite(HOUSEHOLD, Canned())
    assert family.params == HOUSEHOLD.params and family.tools is None
    assert family.generate(house_task.params, house_task.seed) == house_task
    assert family.difficulty(house_task) == HOUSEHOLD.difficulty(house_task)
    assert type(family.make_env()) is type(HOUSEHOLD.make_env())
