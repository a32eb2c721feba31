"""EnvRunner actors: play GRPO groups against the served policy and write their rows.

Each ``EnvRunner`` (an async Ray actor) keeps ``environments.concurrency`` groups in flight.
A group is: lease one task from the ``CurriculumActor``, play ``group_size`` episodes of it at
once through the app's policy (a Serve deployment handle: ``PolicyServer`` in the split layout,
the ingress's handle-only ``generate`` when colocated), turn the finished group into rows
(``rollout.group_rows``), ``add`` them to the env ``SampleBuffer`` (acknowledged only once
durable), then ``report`` the outcomes to the curriculum. A group is written whole or not at
all: a runner that dies mid-group leaves nothing half written, and ``EnvRunnerGroup`` gives its
open leases back to the curriculum (the same tasks are played again by another runner) and
starts a replacement; ``stats()["runner_restarts"]`` and the curriculum's ``retried`` count make
that visible.

``EnvRunnerGroup`` lives in the training driver (the ``Trainer``); its runners are spread over
the cluster's nodes (``SPREAD``) and share the driver's fate.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError

from clawray.buffer.actor import start_sample_buffer
from clawray.config import ClawRayConfig
from clawray.curriculum.actor import get_or_create_curriculum
from clawray.envs import make_family
from clawray.envs.base import Task
from clawray.envs.rollout import Episode, group_diagnostics, group_rows, play_episode
from clawray.inference.engine import SamplingParams
from clawray.models.loader import load_tokenizer, policy_model_info
from clawray.names import NAMESPACE, curriculum_name, env_buffer_name
from clawray.placement import actor_options

logger = logging.getLogger(__name__)
GROUP_TRIES = 3


def env_names(app: str, cfg: ClawRayConfig) -> dict[str, str]:
    return {"buffer": env_buffer_name(app, cfg.environments_cfg.buffer_suffix),
            "curriculum": curriculum_name(app)}


def policy_handle(app: str, cfg: ClawRayConfig) -> Any:
    """The deployment whose ``generate(prompt_ids, params)`` serves this app's policy."""
    name = "PolicyServer" if cfg.serving_cfg.layout == "split" else "Ingress"
    return serve.get_deployment_handle(name, app_name=app)


@ray.remote
class EnvRunner:
    """Plays episodes of the configured family; see the module docstring."""

    def __init__(self, config: dict[str, Any], app: str, runner_id: str) -> None:
        self.cfg = ClawRayConfig.from_dict(config)
        e = self.cfg.environments_cfg
        self.env_cfg, self.app, self.runner_id = e, app, runner_id
        self.family = make_family(e.family, **e.family_kwargs)
        info = policy_model_info(self.cfg)
        self.tokenizer = load_tokenizer(info.path)
        max_len = self.cfg.model_cfg.max_model_len or info.max_model_len
        self.max_prompt = e.max_prompt_tokens or max(16, max_len - e.max_tokens)
        self.params = SamplingParams(max_tokens=e.max_tokens, temperature=e.temperature,
                                     top_p=e.top_p)
        self.handle = policy_handle(app, self.cfg)
        names = env_names(app, self.cfg)
        self.buffer = ray.get_actor(names["buffer"], namespace=NAMESPACE)
        self.curriculum = ray.get_actor(names["curriculum"], namespace=NAMESPACE)
        self._stop = asyncio.Event()
        self.started = time.time()
        self.counts = {"groups": 0, "episodes": 0, "successes": 0, "steps": 0, "tokens": 0,
                       "rows": 0, "group_retries": 0, "in_flight": 0,
                       "worse_steps": 0, "conflict_steps": 0, "anchored_steps": 0}
        self.busy_s = 0.0

    async def _generate(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        outputs = await self.handle.generate.remote(prompt_ids, params)
        return outputs[0]

    async def _play(self, task: Task, n: int, params: SamplingParams) -> list[Episode]:
        e = self.env_cfg
        return list(await asyncio.gather(*(
            play_episode(self.family, task, self._generate, self.tokenizer, params,
                         e.max_steps, self.max_prompt, history_window=e.history_window)
            for _ in range(n))))

    async def _one_group(self) -> bool:
        leases = await self.curriculum.lease.remote(self.runner_id, 1)
        if not leases:
            await asyncio.sleep(0.05)
            return False
        lease = leases[0]
        task = Task.from_dict(lease["task"])
        self.counts["in_flight"] += 1
        try:
            for attempt in range(GROUP_TRIES):
                try:
                    episodes = await self._play(task, self.env_cfg.group_size, self.params)
                    break
                except Exception:  # noqa: BLE001 - a replica restarting, a transient error
                    if attempt == GROUP_TRIES - 1:
                        raise
                    self.counts["group_retries"] += 1
                    logger.warning("runner %s: group of %s failed, retrying", self.runner_id,
                                   task.task_id, exc_info=True)
                    await asyncio.sleep(0.5)
            e = self.env_cfg
            rows = group_rows(episodes, e.zero_advantage, step_weighting=e.step_weighting,
                              negative_scale=e.negative_scale, episode_weight=e.episode_weight,
                              step_weight=e.step_weight, gamma=e.step_gamma)
            if rows:
                await self.buffer.add.remote(rows)  # durable before it returns
            rewards = [ep.reward for ep in episodes]
            await self.curriculum.report.remote(
                lease["lease_id"], rewards,
                {"steps": [len(ep.steps) for ep in episodes],
                 "ended": [ep.ended for ep in episodes]})
        finally:
            self.counts["in_flight"] -= 1
        c = self.counts
        c["groups"] += 1
        c["episodes"] += len(episodes)
        c["successes"] += sum(ep.success for ep in episodes)
        c["steps"] += sum(len(ep.steps) for ep in episodes)
        c["tokens"] += sum(ep.tokens for ep in episodes)
        c["rows"] += len(rows)
        for key, n in group_diagnostics(episodes).items():
            c[key] += n
        return True

    async def run(self, max_groups: int | None = None) -> dict[str, Any]:
        """Play groups until ``stop()`` (or ``max_groups`` groups); returns ``stats()``."""
        self._stop.clear()
        t0 = time.perf_counter()
        target = None if max_groups is None else self.counts["groups"] + max_groups
        claimed = [self.counts["groups"]]

        async def worker() -> None:
            while not self._stop.is_set():
                if target is not None:
                    if claimed[0] >= target:
                        return
                    claimed[0] += 1
                await self._one_group()

        try:
            await asyncio.gather(*(worker() for _ in range(self.env_cfg.concurrency)))
        finally:
            self.busy_s += time.perf_counter() - t0
        return self.stats()

    def stop(self) -> None:
        self._stop.set()

    async def play_groups(self, tasks: list[dict[str, Any]], n: int) -> list[list[Episode]]:
        """``n`` episodes of each task, returned (not written, not reported): the synchronous
        loop of ``training.mode: rlanything`` scores and trains on them itself."""
        groups = await asyncio.gather(*(self._play(Task.from_dict(d), n, self.params)
                                        for d in tasks))
        c = self.counts
        for episodes in groups:
            c["groups"] += 1
            c["episodes"] += len(episodes)
            c["successes"] += sum(ep.success for ep in episodes)
            c["steps"] += sum(len(ep.steps) for ep in episodes)
            c["tokens"] += sum(ep.tokens for ep in episodes)
        return list(groups)

    def stats(self) -> dict[str, Any]:
        return {"runner_id": self.runner_id, "node_id": ray.get_runtime_context().get_node_id(),
                "busy_s": self.busy_s, **self.counts}

    async def evaluate(self, tasks: list[dict[str, Any]], temperature: float = 0.0,
                       seeds: list[int] | None = None,
                       concurrency: int | None = None) -> list[dict[str, Any]]:
        """Play each task once (greedy by default; with ``seeds``, one per task, sampling is
        reproducible for given weights); nothing is written or reported."""
        sem = asyncio.Semaphore(concurrency or self.env_cfg.concurrency * self.env_cfg.group_size)

        async def one(d: dict[str, Any], seed: int | None) -> dict[str, Any]:
            params = SamplingParams(max_tokens=self.env_cfg.max_tokens, temperature=temperature,
                                    top_p=self.env_cfg.top_p, seed=seed)
            async with sem:
                ep = (await self._play(Task.from_dict(d), 1, params))[0]
            return {"task_id": ep.task.task_id, "success": ep.success, "steps": len(ep.steps),
                    "ended": ep.ended, "difficulty": self.family.difficulty(ep.task)}

        seeds = seeds if seeds is not None else [None] * len(tasks)
        return list(await asyncio.gather(*(one(d, s) for d, s in zip(tasks, seeds))))


class EnvRunnerGroup:
    """N EnvRunners, their curriculum and env buffer, kept running (driver side)."""

    def __init__(self, cfg: ClawRayConfig, app: str) -> None:
        self.cfg, self.app = cfg, app
        e, c = cfg.environments_cfg, cfg.curriculum_cfg
        names = env_names(app, cfg)
        # A group waits for its rows to be durable before its slot leases the next task, so
        # the env buffer seals sooner than the live one (bench/README.md: 0.54x -> 0.85x of
        # the generation limit for one runner).
        buffer_cfg = cfg.buffer_cfg.model_copy(update={
            "path": cfg.buffer_cfg.path.rstrip("/") + "-env",
            "seal_age_s": min(cfg.buffer_cfg.seal_age_s, e.buffer_seal_age_s)})
        self.buffer = start_sample_buffer(buffer_cfg, name=names["buffer"], namespace=NAMESPACE,
                                          placement=cfg.placement_cfg.buffer)
        self.curriculum = get_or_create_curriculum(
            names["curriculum"], namespace=NAMESPACE, family_name=e.family,
            family_kwargs=e.family_kwargs, sampler=c.sampler,
            sampler_kwargs={"seed": e.seed, **c.sampler_kwargs},
            checkpoint_path=c.checkpoint_path, checkpoint_every=c.checkpoint_every,
            max_difficulty=c.max_difficulty, pool=e.pool("train"),
            runtime_env=e.runtime_env)
        ray.get(self.buffer.ping.remote())
        self.runners: dict[str, Any] = {}
        self.runs: dict[str, Any] = {}
        self.restarts = 0
        self.max_groups: int | None = None
        self.finished: dict[str, dict[str, Any]] = {}
        self._next = 0
        for _ in range(e.num_runners):
            self._spawn()

    def _spawn(self) -> str:
        rid = f"{self.app}-runner-{self._next}-{uuid.uuid4().hex[:6]}"
        self._next += 1
        # SPREAD ignores actors that request no resources (they land on a random node).
        self.runners[rid] = EnvRunner.options(
            num_cpus=max(self.cfg.environments_cfg.runner_num_cpus, 0.01),
            scheduling_strategy="SPREAD",
            max_restarts=0, runtime_env=self.cfg.environments_cfg.runtime_env,
            **actor_options(self.cfg.placement_cfg.env_runners),
        ).remote(self.cfg.to_dict(), self.app, rid)
        return rid

    def start(self, max_groups: int | None = None) -> None:
        """Start (or restart) every idle runner's play loop (``max_groups`` each; a
        replacement for a runner that died gets the same limit)."""
        self.max_groups = max_groups
        for rid, runner in self.runners.items():
            if rid not in self.runs:
                self.runs[rid] = runner.run.remote(max_groups)

    def poll(self) -> dict[str, Any]:
        """Replace runners that died (their leases go back to the curriculum); returns what
        changed: ``{"replaced": [...], "released": n}``."""
        replaced, released = [], 0
        done, _ = ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=0)
        done_set = set(done)
        for rid in [r for r, ref in self.runs.items() if ref in done_set]:
            ref = self.runs.pop(rid)
            try:
                self.finished[rid] = ray.get(ref)
                continue  # a run that ended normally (max_groups, stop)
            except RayActorError:
                pass
            except Exception:  # noqa: BLE001 - the run raised: treat the runner as broken
                logger.exception("env runner %s failed; replacing it", rid)
                ray.kill(self.runners[rid])
            del self.runners[rid]
            released += ray.get(self.curriculum.release.remote(rid))
            self.restarts += 1
            new = self._spawn()
            self.runs[new] = self.runners[new].run.remote(self.max_groups)
            replaced.append((rid, new))
        return {"replaced": replaced, "released": released}

    def stats(self) -> dict[str, Any]:
        """Summed runner counters (live runners, plus finished runs) and the curriculum's."""
        per = []
        for rid, runner in self.runners.items():
            try:
                per.append(ray.get(runner.stats.remote(), timeout=10))
            except Exception:  # noqa: BLE001 - a runner dying right now
                if rid in self.finished:
                    per.append(self.finished[rid])
        keys = ("groups", "episodes", "successes", "steps", "tokens", "rows", "group_retries",
                "in_flight", "worse_steps", "conflict_steps", "anchored_steps")
        out: dict[str, Any] = {k: sum(p.get(k, 0) for p in per) for k in keys}
        out["runners"] = len(self.runners)
        out["runner_restarts"] = self.restarts
        out["nodes"] = len({p["node_id"] for p in per})
        out["curriculum"] = ray.get(self.curriculum.metrics.remote())
        return out

    def _spread(self, items: list[Any], call: Any) -> list[Any]:
        """Deal ``items`` round-robin over the runners, run ``call(runner, share, i)`` on each,
        and put the results back in the order of ``items``."""
        runners = list(self.runners.values())
        k = len(runners)
        parts = ray.get([call(r, items[i::k], i) for i, r in enumerate(runners)])
        out: list[Any] = [None] * len(items)
        for i, part in enumerate(parts):
            out[i::k] = part
        return out

    def evaluate(self, tasks: list[Task], temperature: float = 0.0,
                 seed: int | None = None) -> list[dict[str, Any]]:
        """Play ``tasks`` once each, split over the runners (no rows, no curriculum reports).
        With ``seed``, episode ``i`` samples with seed ``seed + i``: reproducible per weights."""
        seeds = None if seed is None else [seed + i for i in range(len(tasks))]
        k = len(self.runners)
        return self._spread([t.to_dict() for t in tasks], lambda r, share, i: r.evaluate.remote(
            share, temperature, None if seeds is None else seeds[i::k]))

    def play(self, tasks: list[Task], n: int) -> list[list[Episode]]:
        """``n`` episodes of every task, the tasks split over the runners; in task order."""
        return self._spread([t.to_dict() for t in tasks],
                            lambda r, share, i: r.play_groups.remote(share, n))

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the play loops; in-flight groups finish and are written."""
        for runner in self.runners.values():
            runner.stop.remote()
        if self.runs:
            ray.wait(list(self.runs.values()), num_returns=len(self.runs), timeout=timeout_s)
        for rid, ref in list(self.runs.items()):
            try:
                self.finished[rid] = ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - still running past the timeout, or died
                pass
        self.runs.clear()

    def shutdown(self) -> None:
        self.stop()
        for runner in self.runners.values():
            ray.kill(runner)
        self.runners.clear()
