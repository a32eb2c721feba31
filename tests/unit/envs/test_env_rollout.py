"""Episodes against a token-in/token-out policy, GRPO group rows, SFT rows (no Ray)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from clawray.envs import make_family
from clawray.envs.rollout import (group_diagnostics, grpo_advantages, group_rows, play_episode,
                                  render_prompt, state_advantages)
from clawray.inference.engine import SamplingParams, TokenOutput
from clawray.models.chat_template import IM_END
from clawray.samples import rows_to_batch

from tests.support.env_policies import expert_policy, scripted

PARAMS = SamplingParams(max_tokens=48)


@pytest.mark.parametrize("name", ["household", "tool_use"])
def test_the_expert_played_through_token_ids_succeeds_and_rows_are_token_exact(name, tiny_tokenizer):
    family = make_family(name)
    task = family.generate([0.3] * len(family.params), seed=5)
    gen = expert_policy(family, task, tiny_tokenizer)
    ep = asyncio.run(play_episode(family, task, gen, tiny_tokenizer, PARAMS))
    assert ep.success and ep.ended == "done"
    assert all(s.valid and s.progress for s in ep.steps)
    # Each step's prompt is the template of the history so far, exactly what was sent.
    assert [s.prompt_ids for s in ep.steps] == gen.calls
    env = family.make_env()
    env.reset(task)
    tools = getattr(env, "tools", None) or family.tools
    n_msgs = len(env.reset(task))
    assert ep.steps[0].prompt_ids == render_prompt(tiny_tokenizer, ep.messages[:n_msgs], tools)
    assert ep.steps[1].prompt_ids[:len(ep.steps[0].prompt_ids)] == ep.steps[0].prompt_ids


def test_an_unparseable_policy_fails_within_the_budget(tiny_tokenizer):
    family = make_family("household")
    task = family.generate([0.0] * 4, seed=1)
    gen = scripted(tiny_tokenizer, lambda _p: "dance wildly")
    ep = asyncio.run(play_episode(family, task, gen, tiny_tokenizer, PARAMS))
    assert not ep.success and ep.ended == "budget"
    assert len(ep.steps) == task.spec["budget"]
    assert not any(s.valid for s in ep.steps)


def test_a_history_longer_than_the_context_ends_the_episode_as_a_failure(tiny_tokenizer):
    family = make_family("household")
    task = family.generate([0.5] * 4, seed=2)
    gen = scripted(tiny_tokenizer, lambda _p: "look")
    ep = asyncio.run(play_episode(family, task, gen, tiny_tokenizer, PARAMS,
                                  max_prompt_tokens=300))
    assert ep.ended == "context" and not ep.success
    assert all(len(s.prompt_ids) <= 300 for s in ep.steps)


def test_grpo_advantages_standardize_over_the_group_with_population_std():
    adv = grpo_advantages([1, 0, 0, 1])
    assert adv == pytest.approx([1, -1, -1, 1])
    adv = grpo_advantages([1, 0, 0, 0])
    r = np.array([1, 0, 0, 0.0])
    assert adv == pytest.approx(((r - r.mean()) / r.std()).tolist())
    assert grpo_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]
    assert grpo_advantages([0.0]) == [0.0]


def _group(tokenizer, successes):
    family = make_family("household")
    task = family.generate([0.0] * 4, seed=7)
    eps = []
    for ok in successes:
        gen = expert_policy(family, task, tokenizer) if ok else \
            scripted(tokenizer, lambda _p: "dance")
        eps.append(asyncio.run(play_episode(family, task, gen, tokenizer, PARAMS)))
    return eps


def test_group_rows_carry_ids_outcome_and_the_group_advantage_on_every_step(tiny_tokenizer):
    eps = _group(tiny_tokenizer, [True, False])
    rows = group_rows(eps)
    rows_to_batch(rows)  # valid against the Arrow schema
    assert len(rows) == sum(len(e.steps) for e in eps)
    by_traj = {}
    for r in rows:
        by_traj.setdefault(r["trajectory_id"], []).append(r)
    assert len(by_traj) == 2
    for ep in eps:
        mine = by_traj[ep.trajectory_id]
        assert [r["step"] for r in mine] == list(range(len(ep.steps)))
        assert {r["task_id"] for r in mine} == {ep.task.task_id}
        assert {r["outcome"] for r in mine} == {1 if ep.success else -1}
        assert {r["advantage"] for r in mine} == {1.0 if ep.success else -1.0}
        assert all(r["source"] == "env" and r["policy_version"] == 3 for r in mine)
        assert all(sum(r["loss_mask"]) == len(r["response_ids"]) for r in mine)
        assert [r["response_ids"] for r in mine] == [s.response_ids for s in ep.steps]


def test_a_group_without_signal_is_kept_masked_or_dropped(tiny_tokenizer):
    eps = _group(tiny_tokenizer, [False, False])
    kept = group_rows(eps, "keep_masked")
    assert kept and all(sum(r["loss_mask"]) == 0 and r["advantage"] == 0 for r in kept)
    assert group_rows(eps, "drop") == []


def test_sft_rows_are_the_expert_actions_with_end_of_turn(tiny_tokenizer):
    from clawray.envs import demo_tasks
    from clawray.training.sft import expert_rows

    family = make_family("household")
    tasks = demo_tasks(family, 3, 0.5, seed=0)
    assert all(max(family.normalized(t.params)) <= 0.5 + 1e-9 for t in tasks)
    rows = expert_rows(family, tasks, tiny_tokenizer)
    rows_to_batch(rows)
    end = tiny_tokenizer.convert_tokens_to_ids(IM_END)
    assert all(r["kind"] == "sft" and r["response_ids"][-1] == end for r in rows)
    first = rows[0]
    text = tiny_tokenizer.decode(first["response_ids"], skip_special_tokens=True)
    env = family.make_env()
    env.reset(tasks[0])
    assert text == env.expert_action().text()
    assert demo_tasks(family, 3, 0.5, seed=0) == tasks  # seeded


def test_a_history_window_keeps_the_system_message_and_the_last_exchanges():
    from clawray.envs.rollout import context_messages

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u0"},
            {"role": "assistant", "content": "a0"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert context_messages(msgs, None) == msgs
    assert [m["content"] for m in context_messages(msgs, 0)] == ["s", "u2"]
    assert [m["content"] for m in context_messages(msgs, 1)] == ["s", "u1", "a1", "u2"]
    assert context_messages(msgs, 5) == msgs
    tool = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    assert [m["content"] for m in context_messages(tool, 0)] == ["s", "1", "2"]


def test_windowed_prompts_grow_no_longer_than_one_observation(tiny_tokenizer):
    family = make_family("household")
    task = family.generate([0.5] * 4, seed=4)
    gen = expert_policy(family, task, tiny_tokenizer)
    ep = asyncio.run(play_episode(family, task, gen, tiny_tokenizer, PARAMS, history_window=0))
    assert ep.success
    lengths = [len(s.prompt_ids) for s in ep.steps]
    assert max(lengths) < 2 * min(lengths)


def test_trajectory_weighting_gives_every_episode_the_same_total_weight(tiny_tokenizer):
    eps = _group(tiny_tokenizer, [True, False])  # the failure runs to its budget
    assert len(eps[1].steps) > len(eps[0].steps)
    rows = group_rows(eps, step_weighting="trajectory")
    total = {}
    for r in rows:
        total[r["trajectory_id"]] = total.get(r["trajectory_id"], 0.0) + r["advantage"]
    mean_steps = (len(eps[0].steps) + len(eps[1].steps)) / 2
    assert total[eps[0].trajectory_id] == pytest.approx(mean_steps)
    assert total[eps[1].trajectory_id] == pytest.approx(-mean_steps)
    with pytest.raises(ValueError, match="step_weighting"):
        group_rows(eps, step_weighting="episode")


def test_negative_scale_shrinks_only_the_worse_episodes_advantages(tiny_tokenizer):
    eps = _group(tiny_tokenizer, [True, False, False, False])  # r = 1, 0, 0, 0: A = √3, -1/√3
    half = group_rows(eps, negative_scale=0.5)
    adv = {r["trajectory_id"]: r["advantage"] for r in half}
    assert adv[eps[0].trajectory_id] == pytest.approx(3 ** 0.5)
    assert adv[eps[1].trajectory_id] == pytest.approx(-0.5 / 3 ** 0.5)
    masked = group_rows(eps, negative_scale=0.0)
    assert {r["trajectory_id"] for r in masked if sum(r["loss_mask"])} == {eps[0].trajectory_id}
    dropped = group_rows(eps, zero_advantage="drop", negative_scale=0.0)
    assert {r["trajectory_id"] for r in dropped} == {eps[0].trajectory_id}
    assert len(dropped) == len(eps[0].steps)
    with pytest.raises(ValueError, match="negative_scale"):
        group_rows(eps, negative_scale=1.5)


def test_a_seeded_episode_gives_every_step_its_own_seed(tiny_tokenizer):
    from clawray.envs.rollout import STEP_SEED_STRIDE

    family = make_family("household")
    task = family.generate([0.0] * 4, seed=3)
    seeds = []

    async def generate(prompt_ids, params):
        seeds.append(params.seed)
        ids = tiny_tokenizer.encode("dance", add_special_tokens=False)
        return TokenOutput(ids, [-1.0] * len(ids), "stop", policy_version=0)

    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    ep = asyncio.run(play_episode(family, task, generate, tiny_tokenizer, params))
    assert seeds == [11 + i * STEP_SEED_STRIDE for i in range(len(ep.steps))]


def test_a_sub_box_keeps_a_curriculum_within_the_lower_part_of_every_axis():
    from clawray.curriculum.samplers import make_sampler
    from clawray.envs import EnvError
    from clawray.envs.base import SubBox

    inner = make_family("household")
    box = SubBox(inner, 0.4)
    sampler = make_sampler("uniform", box, seed=0)
    tasks = [sampler.next_task() for _ in range(50)]
    assert all(max(inner.normalized(t.params)) <= 0.4 + 1e-9 for t in tasks)
    assert all(t.family == "household" for t in tasks)
    assert box.generate([1.0] * 4, 3) == inner.generate([0.4] * 4, 3)  # clipped to the sub-box
    with pytest.raises(EnvError, match="fraction"):
        SubBox(inner, 0.0)


def _expert_then(family, task, tokenizer, k, then="dance"):
    """The expert's first ``k`` actions, then ``then`` until the budget ends."""
    shadow = family.make_env()
    shadow.reset(task)
    done = [0]

    def texts_for(_prompt):
        if done[0] >= k:
            return then
        done[0] += 1
        action = shadow.expert_action()
        shadow.step(action)
        return action.text()

    return scripted(tokenizer, texts_for)


def _anchored_group(tokenizer):
    """A success (the expert) and a failure that makes the expert's first move, then loops:
    with history window 0 both start from the same prompt and share the first step."""
    family = make_family("household")
    task = family.generate([0.0] * 4, seed=7)
    gens = [expert_policy(family, task, tokenizer), _expert_then(family, task, tokenizer, 1)]
    return [asyncio.run(play_episode(family, task, g, tokenizer, PARAMS, history_window=0))
            for g in gens]


def test_plain_grpo_pushes_down_a_failed_episode_step_that_a_success_pushes_up(tiny_tokenizer):
    ok, bad = _anchored_group(tiny_tokenizer)
    assert ok.success and not bad.success and len(ok.steps) >= 2
    assert bad.steps[0].response_ids == ok.steps[0].response_ids  # the same first move
    d = group_diagnostics([ok, bad])
    assert d["worse_steps"] == len(bad.steps) and d["conflict_steps"] == 1
    rows = group_rows([ok, bad])
    first = [r["advantage"] for r in rows if r["step"] == 0]
    assert first == pytest.approx([1.0, -1.0])  # the same action in the same context, +1 and -1


def test_anchor_state_advantages_compare_steps_taken_from_the_same_prompt(tiny_tokenizer):
    ok, bad = _anchored_group(tiny_tokenizer)
    gamma = 0.9
    adv = state_advantages([ok, bad], gamma)
    # step 0: the same prompt and the same action; returns gamma^(T-1) (success) and 0
    assert adv[0][0] == pytest.approx(1.0) and adv[1][0] == pytest.approx(-1.0)
    # step 1 of both also share a prompt (the same state): the expert's move beats "dance"
    assert ok.steps[1].prompt_ids == bad.steps[1].prompt_ids
    assert adv[0][1] > 0 > adv[1][1]
    # the looping failure revisits its own state: compared only with itself, returns all 0
    assert all(a <= 0 for a in adv[1])
    # a context seen once has nothing to compare with
    prompts = [tuple(s.prompt_ids) for e in (ok, bad) for s in e.steps]
    for e, row in zip((ok, bad), adv):
        for s, a in zip(e.steps, row):
            if prompts.count(tuple(s.prompt_ids)) == 1:
                assert a == 0.0
    with pytest.raises(ValueError, match="gamma"):
        state_advantages([ok, bad], 0.0)


def test_step_weight_mixes_the_two_advantages_and_episode_weight_zero_keeps_only_steps(tiny_tokenizer):
    ok, bad = _anchored_group(tiny_tokenizer)
    st = state_advantages([ok, bad], 0.95)
    mixed = group_rows([ok, bad], step_weight=0.5)
    ep_adv = {ok.trajectory_id: 1.0, bad.trajectory_id: -1.0}
    by_ep = {ok.trajectory_id: st[0], bad.trajectory_id: st[1]}
    for r in mixed:
        want = ep_adv[r["trajectory_id"]] + 0.5 * by_ep[r["trajectory_id"]][r["step"]]
        assert r["advantage"] == pytest.approx(want, abs=1e-6)
    only = group_rows([ok, bad], episode_weight=0.0, step_weight=1.0, zero_advantage="drop")
    assert only and all(r["advantage"] != 0 for r in only)
    assert {(r["trajectory_id"], r["step"]) for r in only} == {
        (e.trajectory_id, t) for e, row in zip((ok, bad), st) for t, a in enumerate(row) if a}
    with pytest.raises(ValueError, match="step_weight"):
        group_rows([ok, bad], step_weight=-1.0)
