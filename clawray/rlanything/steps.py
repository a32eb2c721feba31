"""From a played episode to what the step-wise reward model judges, one record per step.

An ``Episode`` (``envs/rollout.py``) keeps the whole message history: the environment's reset
messages, then for every step the agent's assistant message followed by the environment's
messages. ``step_contexts`` cuts it back into steps: for step ``i``, the messages before the
action (``history``), the action's text, the observation that followed it, and the
environment's step oracle (``progress``: did the action make progress?). The oracle is carried
only to *evaluate* reward models (RM step accuracy) and to drive the synthetic oracle judge of
``oracle.py``; it never enters a training reward.

``expert_alternatives`` gives, at every state an episode visited, the step the family's expert
would have taken there instead (its action, the observation it got, the oracle's label): steps
from the policy's own states, which a reward model's warm start can learn from without telling
expert trajectories from the policy's apart instead of progress from no progress.

``step_rm_request`` renders a step as a step-RM prompt (``judging/step_rm.py``): the task is the
environment's first observation, the history is the last ``history_window`` exchanges before the
action (``None``: all of it), as the policy's own prompts are cut (``context_messages``).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from clawray.envs.base import TaskFamily
from clawray.envs.rollout import Episode, context_messages
from clawray.judging.prompts import JudgeRequest
from clawray.judging.step_rm import build_step_rm_prompt


@dataclasses.dataclass
class StepContext:
    """One agent step as the reward model sees it (plus the oracle, for evaluation only)."""

    task_text: str
    history: list[dict[str, Any]]
    action: str
    observation: str
    progress: bool
    valid: bool
    step: int
    # The trajectory's outcome (did the episode succeed), which Theorem 1's mu is measured
    # against; None for a step no episode took (``expert_alternatives``).
    outcome: bool | None = None


def _text(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def step_contexts(episode: Episode) -> list[StepContext]:
    """The episode's steps in order (``len(result) == len(episode.steps)``)."""
    msgs = episode.messages
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if len(assistant) != len(episode.steps):
        raise ValueError(f"episode {episode.trajectory_id}: {len(assistant)} assistant messages "
                         f"for {len(episode.steps)} steps")
    first_user = next((m for m in msgs if m["role"] != "system"), None)
    task_text = _text(first_user) if first_user is not None else ""
    out = []
    for k, (i, st) in enumerate(zip(assistant, episode.steps)):
        end = assistant[k + 1] if k + 1 < len(assistant) else len(msgs)
        observation = "\n".join(_text(m) for m in msgs[i + 1:end])
        out.append(StepContext(task_text, msgs[:i], st.text, observation, st.progress,
                               st.valid, k, bool(episode.success)))
    return out


def expert_alternatives(family: TaskFamily, episode: Episode) -> list[StepContext]:
    """For each step of ``episode``, the expert's action at the same state instead (one context
    per step, the same history; ``progress``/``valid`` are the oracle's for the expert's action).

    The episode is replayed in a fresh environment of ``family``; at each state a copy of it
    takes the expert's action, then the original takes the policy's."""
    env = family.make_env()
    env.reset(episode.task)
    out = []
    for ctx, st in zip(step_contexts(episode), episode.steps):
        shadow = copy.deepcopy(env)
        action = shadow.expert_action()
        result = shadow.step(action)
        out.append(dataclasses.replace(
            ctx, action=action.text(), progress=result.progress, valid=result.valid, outcome=None,
            observation="\n".join(_text(m) for m in result.messages)))
        env.step(env.as_action(st.text))
    return out


def step_rm_request(ctx: StepContext, history_window: int | None = 0) -> JudgeRequest:
    """The step-RM prompt for ``ctx`` (kind ``"step_rm"``; ``context`` is the ``StepContext``,
    so a function judge can read the step, e.g. the oracle judge in tests)."""
    history = [m for m in context_messages(ctx.history, history_window) if m["role"] != "system"]
    messages = build_step_rm_prompt(ctx.task_text, history, ctx.action, ctx.observation,
                                    max_history_chars=4000, max_message_chars=2000)
    return JudgeRequest(kind="step_rm", messages=messages, context=ctx)  # type: ignore[arg-type]
