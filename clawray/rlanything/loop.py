"""``training.mode: rlanything``: one synchronous RLAnything step, driver side.

The env runners usually play on their own and stream GRPO groups into the env buffer; here the
trainer drives them, because every phase of a step works on the same batch, in this order:

1. **rollouts**: the ``EnvAdapter``'s tasks for this step (every slot's active task and its
   pending candidate) are played ``environments.group_size`` times each by the runners;
2. **RM scores**: every step of every episode is scored ``rlanything.m`` times by the step-wise
   reward model (a ``JudgeServer`` replica samples the m scorings in one call, token-exact, so
   they can be trained on; or a function / external judge);
3. **failure critiques**: per task, a summary of the steps of failed rollouts that every RM
   scoring marked −1 (``core.failure_steps`` → ``core.programmatic_critique``);
4. **env proposals and acceptance**: the adapter accepts or rejects last step's candidates by
   their accuracy now, and proposes rewrites of the slots whose accuracy left the band;
5. **policy update**: step rewards ``R = O + (λ/m) Σ S``, per-step advantages over the task's
   rollouts (``core.step_advantages``), rows only from tasks with accuracy in the policy band
   and never from rejected candidates; written to the env buffer (durable) and trained on;
6. **RM update**: consistency rewards of every scoring (``core.rm_consistency_rewards``) from
   tasks inside the RM band, trained by the ``RMCoTrainer`` (its own learner and version);
7. **weight syncs**: the policy's (by the ``Trainer``) and the RM's (judge channel).

Every phase is timed (``time_<phase>_s``); the RM's step accuracy against the environment's step
oracle is measured on every step (``rm_step_acc``: single scorings; ``rm_majority_acc``: the
majority of m; per class ``rm_plus_acc`` = p+, ``rm_minus_acc`` = p-, ``rm_balanced_acc`` and
``rm_mu`` = p+ + p-, since plain accuracy rewards the majority class), which is how RM quality
is evaluated (the oracle never enters a reward). ``target_*`` measure the same per class for
the consistency target the co-trainer pushes each scoring toward, sign(R) of the step's reward
(at lambda = 1 the trajectory outcome or 0, so it agrees with the step oracle only as far as
the outcome does: docs/rlanything.md, "Theorem 1 in the co-training data"), over every scored
step; ``trained_target_*`` over the steps the co-trainer actually trains on (tasks in the RM
band whose m scorings are rewarded unequally), measured in every row. ``rm_outcome_*`` measure
the RM's single scorings per class of the trajectory outcome instead (steps of successful
episodes should score +1, of failed ones -1): Theorem 1's mu, agreement with the outcome, which
is what consistency co-training trains toward.

The policy's rows use the prompt the policy actually saw: the full history, or the last
``environments.history_window`` exchanges when the environment's observations are Markov.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import ray
from ray import serve

from clawray.buffer.actor import start_sample_buffer
from clawray.buffer.core import fetch
from clawray.config import ClawRayConfig, RLAnythingConfig
from clawray.envs.base import Task
from clawray.envs.rollout import Episode
from clawray.judging.backends import FunctionBackend, make_backend
from clawray.judging.step_rm import parse_step_score
from clawray.names import NAMESPACE, env_adapter_name, rm_buffer_name
from clawray.rlanything import core
from clawray.rlanything.env_adapter_actor import get_or_create_env_adapter
from clawray.rlanything.rm_cotrainer import rm_rows, start_rm_cotrainer
from clawray.rlanything.steps import StepContext, step_contexts, step_rm_request
from clawray.samples import make_row

logger = logging.getLogger(__name__)
SCORING_CONCURRENCY = 64


@dataclasses.dataclass
class ScoredStep:
    """One step, its m RM scores (None: unparseable) and, from a JudgeServer, the exact
    samples (ids and log-probs) the scores came from."""

    ctx: StepContext
    scores: list[int | None]
    samples: list[dict[str, Any]] | None


class StepScorer:
    """m scorings per step through the configured RM backend."""

    def __init__(self, cfg: ClawRayConfig, app: str) -> None:
        self.r = cfg.rlanything_cfg
        self.history_window = cfg.environments_cfg.history_window
        self.handle = None
        self.backend = None
        if self.r.rm_backend == "server":
            self.handle = serve.get_deployment_handle("JudgeServer", app_name=app)
        elif self.r.rm_backend == "function":
            self.backend = FunctionBackend(self.r.rm_function)
        else:
            self.backend = make_backend(cfg.judge_cfg.model_copy(update={"backend": "openai"}))

    async def _one(self, ctx: StepContext, sem: asyncio.Semaphore,
                   seed: int | None = None) -> ScoredStep:
        request = step_rm_request(ctx, self.history_window)
        r = self.r
        async with sem:
            if self.handle is not None:
                samples = await self.handle.judge_samples.remote(
                    request.messages, r.m, r.temperature, r.max_tokens, seed)
                texts = [s["text"] for s in samples]
            else:
                samples = None
                texts = await self.backend.complete(request, r.m, r.temperature, r.max_tokens)
        return ScoredStep(ctx, [parse_step_score(t) for t in texts], samples)

    async def score_steps(self, contexts: Sequence[StepContext],
                          seed: int | None = None) -> list[ScoredStep]:
        """Each step scored m times (an evaluation set of steps, outside any episode). With a
        ``seed``, step i's scorings are sampled with seed ``seed + i`` by a JudgeServer, so two
        evaluations of the same weights agree (other backends ignore it)."""
        sem = asyncio.Semaphore(SCORING_CONCURRENCY)
        return list(await asyncio.gather(*(
            self._one(c, sem, None if seed is None else seed + i)
            for i, c in enumerate(contexts))))

    async def score(self, groups: Sequence[Sequence[Episode]]) -> list[list[list[ScoredStep]]]:
        """``out[task][rollout][step]``, every step of every episode scored."""
        sem = asyncio.Semaphore(SCORING_CONCURRENCY)

        async def episode(ep: Episode) -> list[ScoredStep]:
            return list(await asyncio.gather(*(self._one(c, sem) for c in step_contexts(ep))))

        return [list(await asyncio.gather(*(episode(ep) for ep in g))) for g in groups]


@dataclasses.dataclass
class TaskResult:
    """What one task's rollouts give: rows for both learners, the critique, the numbers."""

    accuracy: float
    policy_rows: list[dict[str, Any]]
    rm_rows: list[dict[str, Any]]
    critique: str | None
    rm_right: int  # single scorings agreeing with the step oracle
    rm_scored: int  # parseable single scorings
    rm_unparseable: int
    majority_right: int
    majority_n: int
    # Per class of the step oracle, (right, n): the RM's single scorings on progress (plus)
    # and no-progress (minus) steps, and the consistency target sign(R) the co-trainer pushes
    # every scoring toward (at lambda = 1: the trajectory outcome, or 0).
    rm_plus: tuple[int, int] = (0, 0)
    rm_minus: tuple[int, int] = (0, 0)
    target_plus: tuple[int, int] = (0, 0)
    target_minus: tuple[int, int] = (0, 0)
    # The same target on the steps the co-trainer trains on (``trained_target``): tasks in the
    # RM band whose m scorings are rewarded unequally. Measured whether or not this row trains
    # the RM, so every row reports what co-training would push toward.
    trained_target_plus: tuple[int, int] = (0, 0)
    trained_target_minus: tuple[int, int] = (0, 0)
    # (steps pushed toward +1, steps pushed either way) among those: which way co-training
    # pushes the RM overall, whatever the oracle says (at lambda = 1 it follows the outcomes).
    trained_target_positive: tuple[int, int] = (0, 0)
    # The RM's single scorings per class of the trajectory outcome (Theorem 1's mu): steps of
    # successful episodes scored +1 (plus), steps of failed ones scored -1 (minus).
    rm_outcome_plus: tuple[int, int] = (0, 0)
    rm_outcome_minus: tuple[int, int] = (0, 0)


def task_result(episodes: Sequence[Episode], scored: Sequence[Sequence[ScoredStep]],
                r: RLAnythingConfig, train_rm: bool) -> TaskResult:
    """Rewards, advantages, rows and the critique of one task's rollouts (pure; no Ray)."""
    outcomes = [1 if ep.success else -1 for ep in episodes]
    acc = core.accuracy(outcomes)
    rewards = [core.step_rewards(o, [s.scores for s in steps], r.lam) if steps else []
               for o, steps in zip(outcomes, scored)]
    advantages = core.step_advantages(rewards, r.single_rollout)
    policy_rows: list[dict[str, Any]] = []
    if core.policy_task_filter(acc, *r.policy_band):
        now = time.time()
        for k, i in core.trained_steps(advantages):
            ep, st = episodes[k], episodes[k].steps[i]
            policy_rows.append(make_row(
                sample_id=f"{ep.trajectory_id}/{i}", kind="rl", source="env",
                trajectory_id=ep.trajectory_id, task_id=ep.task.task_id, step=i,
                prompt_ids=st.prompt_ids, response_ids=st.response_ids,
                rollout_logprobs=st.logprobs, policy_version=st.policy_version,
                policy_version_end=st.policy_version_end, token_versions=st.token_versions,
                loss_mask=[1] * len(st.response_ids), reward=float(rewards[k][i]),
                outcome=outcomes[k], advantage=float(advantages[k][i]),
                finish_reason=st.finish_reason, created_at=now))
    rm_out: list[dict[str, Any]] = []
    trained: list[tuple[bool, float]] = []  # (oracle progress, R) of the steps trained on
    if core.rm_task_filter(acc, *r.rm_band):
        for k, steps in enumerate(scored):
            for i, s in enumerate(steps):
                adv = core.rm_consistency_rewards(rewards[k][i], s.scores)
                if adv is None or not s.samples:
                    continue
                trained.append((s.ctx.progress, rewards[k][i]))
                if train_rm:
                    rm_out += rm_rows(s.samples, adv, episodes[k].task.task_id, i,
                                      episodes[k].trajectory_id)
    critique = None
    failed = [(ep, steps) for ep, steps in zip(episodes, scored) if not ep.success]
    if failed:
        parts = []
        for ep, steps in failed[:2]:
            bad = core.failure_steps([s.scores for s in steps])
            parts.append(core.programmatic_critique(
                [{"action": s.ctx.action, "observation": s.ctx.observation} for s in steps],
                bad, max_items=4))
        critique = "\n".join(parts)
    flat = [s for steps in scored for s in steps]
    right = sum(v == (1 if s.ctx.progress else -1) for s in flat for v in s.scores
                if v is not None)
    parseable = sum(v is not None for s in flat for v in s.scores)
    majority = [(np.sign(sum(v for v in s.scores if v is not None)), s.ctx.progress)
                for s in flat]
    by_class = {}
    for progress, name in ((True, "plus"), (False, "minus")):
        want = 1 if progress else -1
        votes = [v for s in flat if s.ctx.progress == progress for v in s.scores
                 if v is not None]
        targets = [np.sign(rw) for k, steps in enumerate(scored) for rw, s in
                   zip(rewards[k], steps) if s.ctx.progress == progress and rw != 0]
        by_class[f"rm_{name}"] = (sum(v == want for v in votes), len(votes))
        by_class[f"target_{name}"] = (int(sum(t == want for t in targets)), len(targets))
        signs = [np.sign(rw) for p, rw in trained if p == progress and rw != 0]
        by_class[f"trained_target_{name}"] = (int(sum(t == want for t in signs)), len(signs))
        # Against the outcome, the class is the episode's success instead of the step's progress.
        votes = [v for ep, steps in zip(episodes, scored) if bool(ep.success) == progress
                 for s in steps for v in s.scores if v is not None]
        by_class[f"rm_outcome_{name}"] = (sum(v == want for v in votes), len(votes))
    pushed = [rw for _, rw in trained if rw != 0]
    by_class["trained_target_positive"] = (sum(rw > 0 for rw in pushed), len(pushed))
    return TaskResult(acc, policy_rows, rm_out, critique, right, parseable,
                      sum(v is None for s in flat for v in s.scores),
                      sum(m == (1 if p else -1) for m, p in majority), len(majority),
                      **by_class)


def class_accuracy(results: Sequence[TaskResult], prefix: str) -> dict[str, float | None]:
    """p+ (progress steps called progress), p- (no-progress steps called no progress),
    their mean (balanced accuracy) and mu = p+ + p- over ``results``, for the RM's single
    scorings (``prefix`` "rm"), the co-trainer's consistency target ("target",
    "trained_target"), or the RM's scorings against the trajectory outcome ("rm_outcome":
    p+ on steps of successful episodes); None where a class had no step."""
    plus, minus = _share(results, f"{prefix}_plus"), _share(results, f"{prefix}_minus")
    both = plus is not None and minus is not None
    return {f"{prefix}_plus_acc": plus, f"{prefix}_minus_acc": minus,
            f"{prefix}_balanced_acc": (plus + minus) / 2 if both else None,
            f"{prefix}_mu": plus + minus if both else None}


def _share(results: Sequence[TaskResult], name: str) -> float | None:
    """``right / n`` of a ``(right, n)`` count summed over ``results``; None when n is 0."""
    right = sum(getattr(x, name)[0] for x in results)
    n = sum(getattr(x, name)[1] for x in results)
    return right / n if n else None


class RLAnythingLoop:
    """The driver's side of ``training.mode: rlanything`` (see the module docstring)."""

    def __init__(self, cfg: ClawRayConfig, app: str, envs: Any) -> None:

        self.cfg, self.app, self.envs = cfg, app, envs
        r = self.r = cfg.rlanything_cfg
        e = cfg.environments_cfg
        family = e.family
        self.adapter = get_or_create_env_adapter(
            env_adapter_name(app), namespace=NAMESPACE, runtime_env=e.runtime_env,
            family_name=family, family_kwargs=e.family_kwargs,
            pool=e.pool("train"), n_slots=r.slots, per_step=r.slots_per_step, seed=e.seed,
            max_difficulty=cfg.curriculum_cfg.max_difficulty,
            harder_at=r.harder_at, easier_at=r.easier_at, adapt=r.adapt_env,
            accept_low=r.accept_band[0], accept_high=r.accept_band[1],
            checkpoint_path=r.checkpoint_path, **self._rewrite_settings(cfg, app))
        self.scorer = StepScorer(cfg, app)
        self.train_rm = r.co_train_rm and r.rm_backend == "server"
        self.rm = None
        self.rm_buffer = None
        if self.train_rm:
            self.rm = start_rm_cotrainer(cfg, app)
            self.rm_buffer = start_sample_buffer(
                cfg.buffer_cfg.model_copy(update={"path": cfg.buffer_cfg.path.rstrip("/") + "-rm",
                                                  "seal_age_s": e.buffer_seal_age_s}),
                name=rm_buffer_name(app), namespace=NAMESPACE, placement=cfg.placement_cfg.buffer)
            ray.get(self.rm_buffer.ping.remote())
        self.step_no = 0

    @staticmethod
    def _rewrite_settings(cfg: ClawRayConfig, app: str) -> dict[str, Any]:
        """``rlanything.llm_rewrite``: rewrites proposed through the RM's backend."""
        r = cfg.rlanything_cfg
        if not r.llm_rewrite:
            return {}
        judge = cfg.judge_cfg.model_dump()
        judge.update(backend=r.rm_backend, function=r.rm_function)
        out: dict[str, Any] = {"llm_rewrite": {"judge": judge, "temperature": r.temperature}}
        if r.rm_backend == "server":
            out["judge_handle"] = serve.get_deployment_handle("JudgeServer", app_name=app)
        return out

    def rollouts_and_rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                         dict[str, Any]]:
        """Phases 1-4; returns (policy rows, RM rows, metrics)."""
        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        slots = ray.get(self.adapter.tasks_for_step.remote())
        tasks = [Task.from_dict(s["task"]) for s in slots]
        groups = self.envs.play(tasks, self.cfg.environments_cfg.group_size)
        timings["rollout"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        scored = asyncio.run(self.scorer.score(groups))
        timings["rm_score"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        results = [task_result(g, s, self.r, self.train_rm) for g, s in zip(groups, scored)]
        timings["critique"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        decision = ray.get(self.adapter.report.remote([
            {"slot": s["slot"], "role": s["role"], "task_id": t.task_id,
             "rewards": [ep.reward for ep in g], "critique": res.critique}
            for s, t, g, res in zip(slots, tasks, groups, results)], self.step_no))
        timings["adapt"] = time.perf_counter() - t0
        excluded = set(decision.get("exclude_task_ids", []))
        policy_rows = [row for t, res in zip(tasks, results) if t.task_id not in excluded
                       for row in res.policy_rows]
        rm_rows = [row for t, res in zip(tasks, results) if t.task_id not in excluded
                   for row in res.rm_rows]
        episodes = [ep for g in groups for ep in g]
        scored_n = sum(x.rm_scored for x in results)
        metrics = {
            "rla_tasks": len(tasks), "rla_candidates": sum(s["role"] == "candidate" for s in slots),
            "rla_episodes": len(episodes),
            "rla_success": float(np.mean([ep.success for ep in episodes])) if episodes else 0.0,
            "rla_active_success": _mean([ep.success for s, g in zip(slots, groups) for ep in g
                                         if s["role"] == "active"]),
            "rla_steps": sum(len(ep.steps) for ep in episodes),
            "rla_policy_rows": len(policy_rows), "rla_rm_rows": len(rm_rows),
            "rm_step_acc": sum(x.rm_right for x in results) / max(scored_n, 1),
            "rm_majority_acc": (sum(x.majority_right for x in results)
                                / max(sum(x.majority_n for x in results), 1)),
            "rm_unparseable": sum(x.rm_unparseable for x in results),
            **class_accuracy(results, "rm"), **class_accuracy(results, "target"),
            **class_accuracy(results, "trained_target"), **class_accuracy(results, "rm_outcome"),
            "trained_target_positive_share": _share(results, "trained_target_positive"),
            "env_accepted": len(decision.get("accepted", [])),
            "env_rejected": len(decision.get("rejected", [])),
            "env_proposed": len(decision.get("proposed", [])),
            "env_excluded_tasks": len(excluded),
            **{f"time_{k}_s": v for k, v in timings.items()}}
        self.step_no += 1
        return policy_rows, rm_rows, metrics

    def rm_update(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Phase 6 and the RM's weight sync: durable rows, one RM update, publish."""
        if self.rm is None or not rows:
            return {}
        t0 = time.perf_counter()
        ray.get(self.rm_buffer.add.remote(rows))  # durable before it is trained on
        slices = ray.get(self.rm_buffer.take.remote(len(rows), 10.0, 1))
        table = fetch(slices, ray.get)
        out = dict(ray.get(self.rm.update.remote(table)))
        # trained: consumed (unacknowledged, they would be delivered again after the lease)
        ray.get(self.rm_buffer.ack.remote(sorted({s.lease for s in slices if s.lease})))
        out["time_rm_update_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        sync = ray.get(self.rm.publish.remote())
        out["rm_version"] = sync.get("version")
        if out["rm_version"] is not None:
            ray.get(self.rm_buffer.set_policy_version.remote(int(out["rm_version"])))
        out["time_rm_sync_s"] = time.perf_counter() - t0
        return out

    def metrics(self) -> dict[str, Any]:
        return ray.get(self.adapter.metrics.remote())

    def save(self, path: str) -> None:
        """The adapter's state (``path``/env_adapter.json) and the RM learner (``path``/rm)."""
        ray.get(self.adapter.save.remote(str(Path(path) / "env_adapter.json")))
        if self.rm is not None:
            ray.get(self.rm.save.remote(str(Path(path) / "rm")))

    def shutdown(self) -> None:
        if self.rm is not None:
            try:
                ray.get(self.rm.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for actor in (self.rm, self.rm_buffer):
            if actor is not None:
                ray.kill(actor)


def _mean(values: Sequence[Any]) -> float | None:
    return float(np.mean(values)) if len(values) else None
