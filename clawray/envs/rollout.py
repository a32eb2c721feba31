"""Playing episodes against a token-in/token-out policy, and turning GRPO groups into rows.

No Ray here: ``play_episode`` takes any ``generate(prompt_ids, params) -> TokenOutput``
coroutine (a Serve handle in ``EnvRunner``, an in-process engine in ``clawray sft``'s
evaluation and in tests), so the episode logic is testable in milliseconds.

Token exactness: each step's prompt is the chat template applied to the history so far (with
the env's tools), encoded once; the response ids and log-probs are the engine's own. The
model's text is decoded from those ids and parsed into an ``Action`` exactly as serving parses
a completion (``<tool_call>`` blocks become tool calls). Each step becomes one sample row whose
prompt is the full history (RLAnything's convention), or, with ``history_window=k``, the system
message and the last ``k`` exchanges before the current observation: for environments whose
observations are Markov (household re-describes the whole state every step) ``k = 0`` keeps
prompts short and the decision in plain sight, which a small model needs.

GRPO (outcome reward): a task's G rollouts form a group; every step of rollout ``k`` gets the
advantage ``(r_k - mean(r)) / std(r)`` (population std; a group whose rewards are all equal
gets 0 everywhere: it carries no signal). Rewards are 1 for success and 0 for failure.

Failed episodes usually run to their step budget while successes end early, so with the
learner's token mean a group's failures outweigh its successes by their length.
``step_weighting="trajectory"`` scales each step's advantage by ``mean_steps / steps`` of its
episode (over the group), so every episode carries the same total weight; ``"step"`` keeps
the plain per-step advantage.

``negative_scale`` multiplies the negative advantages (1: plain GRPO). With 0 a group teaches
only through its better-than-average episodes: on the tiny household model, pushing sampled
wrong actions down also pushed the right ones down (their tokens overlap), and plain GRPO
lowered held-out success while the positive-only update raised it (docs/environments.md).
Episodes whose advantage becomes 0 get loss mask 0, or no rows with ``zero_advantage="drop"``.

Anchor-state step advantages (GiGPO, Feng et al. 2025): the episodes of a group start from the
same state and, while the policy is unsure, pass through the same states again. Steps whose
prompt ids are identical (the same decision in the same context) form a step group; each step's
discounted return ``gamma ** (T - 1 - t) * r`` is compared within it, ``(G - mean) / std``. A row's
advantage is ``episode_weight * A_episode + step_weight * A_step``. With ``episode_weight`` 0
only decisions that some episode of the group made better from the very same context are pushed
down, and the push up and down of the tokens two actions share cancels in that context: the
plain episode advantage instead pushes every step of a failed episode down, including the steps
where it did exactly what a successful episode did (``group_diagnostics`` counts them).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any, Awaitable, Callable, Sequence

import numpy as np

from clawray.envs.base import Task, TaskFamily
from clawray.inference.engine import SamplingParams, TokenOutput
from clawray.samples import make_row

Generate = Callable[[list[int], SamplingParams], Awaitable[TokenOutput]]
STD_EPS = 1e-6
STEP_SEED_STRIDE = 1_000_003


@dataclasses.dataclass
class StepRecord:
    """One agent step: the exact ids in and out, what the env made of it."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    policy_version: int
    policy_version_end: int | None
    finish_reason: str
    text: str
    valid: bool
    progress: bool
    token_versions: list[int] | None = None  # the policy version of each response token


@dataclasses.dataclass
class Episode:
    """A finished episode (``ended`` says why: "done", "budget", "context" or "max_steps")."""

    task: Task
    trajectory_id: str
    steps: list[StepRecord]
    success: bool
    ended: str
    messages: list[dict[str, Any]]

    @property
    def reward(self) -> float:
        return 1.0 if self.success else 0.0

    @property
    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.steps)


def context_messages(messages: list[dict[str, Any]], window: int | None) -> list[dict[str, Any]]:
    """The messages a step's prompt shows: all (``window=None``), or the leading system
    messages plus the last ``window`` assistant turns and what followed each, and the
    environment's latest messages."""
    if window is None:
        return messages
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    tail = messages[lead:]
    turns = [i for i, m in enumerate(tail) if m["role"] == "assistant"]
    if window < len(turns):
        start = turns[len(turns) - window - 1] + 1  # just after the dropped assistant turn
        tail = tail[start:]
    return messages[:lead] + tail


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt ids serving would build for this history (chat template, then encode)."""
    text = tokenizer.apply_chat_template(messages, tools=tools or None,
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def play_episode(family: TaskFamily, task: Task, generate: Generate, tokenizer: Any,
                       params: SamplingParams, max_steps: int = 50,
                       max_prompt_tokens: int | None = None,
                       trajectory_id: str | None = None,
                       history_window: int | None = None) -> Episode:
    """Play ``task`` to the end with the policy behind ``generate``.

    With ``params.seed`` set, step ``i`` samples with seed ``seed + i * STEP_SEED_STRIDE``: the
    episode is reproducible for given weights, and a repeated observation does not replay the
    same draw (one seed for every step would repeat a wrong action until the budget runs out
    whenever an observation repeats, e.g. after "nothing happens")."""
    env = family.make_env()
    messages = env.reset(task)
    tools = getattr(env, "tools", None) or family.tools
    steps: list[StepRecord] = []
    traj = trajectory_id or uuid.uuid4().hex
    for _ in range(max_steps):
        prompt = render_prompt(tokenizer, context_messages(messages, history_window), tools)
        if max_prompt_tokens is not None and len(prompt) > max_prompt_tokens:
            return Episode(task, traj, steps, False, "context", messages)
        step_params = params if params.seed is None else dataclasses.replace(
            params, seed=params.seed + len(steps) * STEP_SEED_STRIDE)
        out = await generate(prompt, step_params)
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        action = env.as_action(text)
        result = env.step(action)
        steps.append(StepRecord(prompt, list(out.token_ids), list(out.logprobs),
                                out.policy_version, out.policy_version_end, out.finish_reason,
                                text, result.valid, result.progress, out.versions()))
        messages = messages + [action.message()] + result.messages
        if result.done:
            ended = "done" if result.success else str(result.info.get("ended", "budget"))
            return Episode(task, traj, steps, bool(result.success), ended, messages)
    return Episode(task, traj, steps, False, "max_steps", messages)


def grpo_advantages(rewards: Sequence[float]) -> list[float]:
    """``(r - mean) / std`` over one group (population std); all-equal rewards give 0."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.size == 0:
        return []
    std = r.std()
    if std < STD_EPS:
        return [0.0] * r.size
    return ((r - r.mean()) / std).tolist()


def state_advantages(episodes: Sequence[Episode], gamma: float = 0.95) -> list[list[float]]:
    """Per episode, per step: the anchor-state advantage ``(G - mean) / std`` of the step's
    discounted return ``G = gamma ** (T - 1 - t) * reward`` among all steps of the group whose
    prompt ids are the same; 0 for a context seen once or whose returns are all equal, and 0
    everywhere in a group whose episodes all scored the same (no outcome signal: discounting
    alone would rank equal outcomes by length)."""
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    adv = [[0.0] * len(ep.steps) for ep in episodes]
    if not any(grpo_advantages([e.reward for e in episodes])):
        return adv
    anchors: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for i, ep in enumerate(episodes):
        for t, st in enumerate(ep.steps):
            anchors.setdefault(tuple(st.prompt_ids), []).append((i, t))
    for members in anchors.values():
        if len(members) < 2:
            continue
        returns = [episodes[i].reward * gamma ** (len(episodes[i].steps) - 1 - t)
                   for i, t in members]
        for (i, t), a in zip(members, grpo_advantages(returns)):
            adv[i][t] = a
    return adv


def group_diagnostics(episodes: Sequence[Episode]) -> dict[str, int]:
    """Counts that show what the plain episode advantage does to a group: ``worse_steps``
    (steps of below-average episodes, all pushed down), ``conflict_steps`` (those whose
    context and action equal a step of an above-average episode: pushed down there, up here),
    ``anchored_steps`` (steps whose context recurs in the group with different returns: where
    a step advantage has something to compare)."""
    adv = grpo_advantages([e.reward for e in episodes])
    better = {(tuple(st.prompt_ids), tuple(st.response_ids))
              for ep, a in zip(episodes, adv) if a > 0 for st in ep.steps}
    worse = [st for ep, a in zip(episodes, adv) if a < 0 for st in ep.steps]
    state = state_advantages(episodes)
    return {"worse_steps": len(worse),
            "conflict_steps": sum((tuple(st.prompt_ids), tuple(st.response_ids)) in better
                                  for st in worse),
            "anchored_steps": sum(a != 0 for steps in state for a in steps)}


def group_rows(episodes: Sequence[Episode], zero_advantage: str = "keep_masked",
               source: str = "env", step_weighting: str = "step",
               negative_scale: float = 1.0, episode_weight: float = 1.0,
               step_weight: float = 0.0, gamma: float = 0.95) -> list[dict[str, Any]]:
    """Sample rows of one GRPO group (every episode of one task), in episode and step order.

    Each row's advantage is ``episode_weight`` × the episode's GRPO advantage (scaled per
    ``step_weighting``) plus ``step_weight`` × its anchor-state advantage
    (``state_advantages``); ``negative_scale`` then scales the negative ones. Zero-advantage
    rows are kept with loss mask 0 (``keep_masked``: written, never trained) or left out
    (``drop``)."""
    advantages = grpo_advantages([e.reward for e in episodes])
    if zero_advantage == "drop" and not any(advantages):
        return []
    if step_weighting == "trajectory":
        mean_steps = float(np.mean([max(len(e.steps), 1) for e in episodes]))
        advantages = [a * mean_steps / max(len(e.steps), 1) for e, a in zip(episodes, advantages)]
    elif step_weighting != "step":
        raise ValueError(f"step_weighting must be 'step' or 'trajectory', got {step_weighting!r}")
    if not 0.0 <= negative_scale <= 1.0:
        raise ValueError(f"negative_scale must be in [0, 1], got {negative_scale}")
    if episode_weight < 0 or step_weight < 0:
        raise ValueError(f"episode_weight and step_weight must be >= 0, got {episode_weight}, "
                         f"{step_weight}")
    state = (state_advantages(episodes, gamma) if step_weight
             else [[0.0] * len(e.steps) for e in episodes])
    now = time.time()
    rows = []
    for ep, ep_adv, step_adv in zip(episodes, advantages, state):
        outcome = 1 if ep.success else -1
        for i, st in enumerate(ep.steps):
            adv = episode_weight * ep_adv + step_weight * step_adv[i]
            adv = adv * negative_scale if adv < 0 else adv
            if adv == 0 and zero_advantage == "drop":
                continue  # e.g. a failed episode under negative_scale 0: nothing to train
            rows.append(make_row(
                sample_id=f"{ep.trajectory_id}/{i}", kind="rl", source=source,
                trajectory_id=ep.trajectory_id, task_id=ep.task.task_id, step=i,
                prompt_ids=st.prompt_ids, response_ids=st.response_ids,
                rollout_logprobs=st.logprobs, policy_version=st.policy_version,
                policy_version_end=st.policy_version_end, token_versions=st.token_versions,
                loss_mask=[1 if adv != 0 else 0] * len(st.response_ids),
                reward=ep.reward, outcome=outcome, advantage=float(adv),
                finish_reason=st.finish_reason, created_at=now))
    return rows
