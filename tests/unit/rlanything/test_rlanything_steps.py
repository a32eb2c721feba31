"""Episodes cut into RM steps, the step-RM request, and the synthetic oracle judge (no Ray)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from clawray.envs import make_family
from clawray.envs.rollout import play_episode
from clawray.inference.engine import SamplingParams
from clawray.judging.step_rm import parse_step_score
from clawray.rlanything.oracle import OracleJudge
from clawray.rlanything.steps import expert_alternatives, step_contexts, step_rm_request

from tests.support.env_policies import expert_policy, scripted

PARAMS = SamplingParams(max_tokens=48)


def _expert_episode(tokenizer, seed=5):
    family = make_family("household")
    task = family.generate([0.3] * 4, seed=seed)
    ep = asyncio.run(play_episode(family, task, expert_policy(family, task, tokenizer),
                                  tokenizer, PARAMS))
    assert ep.success
    return ep


def test_an_episode_is_cut_into_its_steps_with_action_observation_and_oracle(tiny_tokenizer):
    ep = _expert_episode(tiny_tokenizer)
    ctxs = step_contexts(ep)
    assert len(ctxs) == len(ep.steps) >= 2
    assert [c.action for c in ctxs] == [s.text for s in ep.steps]
    assert all(c.progress and c.valid for c in ctxs)
    assert ctxs[0].task_text.startswith("task: ")
    # Step 1's history ends with the observation step 0 produced.
    assert ctxs[1].history[-1]["content"] == ctxs[0].observation
    assert ctxs[1].history[-2] == {"role": "assistant", "content": ctxs[0].action}


def test_a_policy_that_repeats_an_invalid_action_gets_no_progress_steps(tiny_tokenizer):
    family = make_family("household")
    task = family.generate([0.3] * 4, seed=5)
    gen = scripted(tiny_tokenizer, lambda _p: "jump over the moon")
    ep = asyncio.run(play_episode(family, task, gen, tiny_tokenizer, PARAMS, max_steps=4))
    ctxs = step_contexts(ep)
    assert [c.progress for c in ctxs] == [False] * len(ep.steps)


def test_expert_alternatives_are_the_experts_step_at_the_policys_own_states(tiny_tokenizer):
    family = make_family("household")
    task = family.generate([0.3] * 4, seed=5)
    gen = scripted(tiny_tokenizer, lambda _p: "jump over the moon")
    ep = asyncio.run(play_episode(family, task, gen, tiny_tokenizer, PARAMS, max_steps=4))
    policy, alt = step_contexts(ep), expert_alternatives(family, ep)
    assert len(alt) == len(policy) == 4
    # the same states (histories), the expert's action instead, which makes progress there
    assert [a.history for a in alt] == [p.history for p in policy]
    assert all(a.progress and a.valid and a.action != p.action for a, p in zip(alt, policy))
    # the invalid action changed nothing: every state is the first, so is the expert's step
    assert len({(a.action, a.observation) for a in alt}) == 1
    # no episode took these steps: they have no trajectory outcome
    assert all(a.outcome is None for a in alt) and all(p.outcome is False for p in policy)
    # on the expert's own episode the alternatives are its steps, exactly, but for the outcome
    expert = _expert_episode(tiny_tokenizer)
    assert expert_alternatives(family, expert) == [dataclasses.replace(c, outcome=None)
                                                   for c in step_contexts(expert)]
    assert all(c.outcome is True for c in step_contexts(expert))


def test_the_step_rm_request_shows_task_state_action_and_next_observation(tiny_tokenizer):
    ep = _expert_episode(tiny_tokenizer)
    ctx = step_contexts(ep)[1]
    req = step_rm_request(ctx, history_window=0)
    user = req.messages[-1]["content"]
    assert req.kind == "step_rm" and req.context is ctx
    assert ctx.task_text.splitlines()[0] in user
    assert ctx.action in user and ctx.observation.splitlines()[-1] in user
    # Window 0: only the state the action was taken in, not step 0's action.
    assert ctx.history[-1]["content"] in user
    assert f"## The action taken at this step\n{step_contexts(ep)[0].action}" not in user
    full = step_rm_request(ctx, history_window=None).messages[-1]["content"]
    assert step_contexts(ep)[0].action in full.split("## The action taken")[0]


@pytest.mark.parametrize("p", [1.0, 0.8, 0.5])
def test_the_oracle_judge_is_right_with_its_chosen_rates_and_reproducible(tiny_tokenizer, p):
    ep = _expert_episode(tiny_tokenizer)
    bad = asyncio.run(play_episode(make_family("household"), ep.task,
                                   scripted(tiny_tokenizer, lambda _p: "go nowhere"),
                                   tiny_tokenizer, PARAMS, max_steps=3))
    judge = OracleJudge(p, p, salt="t")
    right = []
    for c in step_contexts(ep) + step_contexts(bad):
        scores = [parse_step_score(t) for t in judge(step_rm_request(c), 200, 0.8)]
        assert set(scores) <= {1, -1}
        right += [s == (1 if c.progress else -1) for s in scores]
        assert judge(step_rm_request(c), 200, 0.8) == judge(step_rm_request(c), 200, 0.8)
    assert abs(np.mean(right) - p) < 0.03


def test_the_oracle_judge_refuses_requests_that_are_not_steps():
    with pytest.raises(ValueError, match="step-RM requests only"):
        OracleJudge()(object(), 1, 0.8)
    with pytest.raises(ValueError, match="p_minus"):
        OracleJudge(1.0, 1.5)
