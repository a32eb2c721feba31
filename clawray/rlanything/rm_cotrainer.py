"""The RLAnything reward-model co-trainer: the step RM learns from its agreement with outcomes.

What the RM learns from: the JudgeServer scores every step ``i`` of a rollout
``τ`` ``m`` times (``judge_samples``, one engine call). Scoring ``j`` earns the consistency
reward ``R_S = R[τ,i] · S[τ,i,j]`` (the raw step reward times the score it gave, so agreeing
with a clearly good or bad step earns most), or −2 when it gave no parseable score;
``rm_consistency_rewards`` standardizes these over the ``m`` scorings of the step (zero
variance: the step is skipped). Each scoring becomes one ``kind="rm"`` sample row
(``rm_rows``): the RM's own prompt and output ids, its log-probs at sampling time and its
weights version, the standardized reward as the row's scalar ``advantage``, every output token
trained. The learner trains such rows with the same PPO-clip loss as the policy's.

``RMCoTrainer`` is the co-trainer actor: a ``LearnerGroup`` (DeepSpeed) on the RM model, with
``rlanything.rm_lr`` and no KL reference. It keeps its own version sequence (1, 2, … per
publish, continuing from what the JudgeServer already serves) and publishes on its own weight
channel, ``judge_channel(app)``, which only JudgeServer replicas listen on: the policy's
channel and versions are never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray

from clawray.config import ClawRayConfig, TrainingConfig
from clawray.learner.group import LearnerGroup
from clawray.models.loader import judge_model_info
from clawray.names import judge_channel
from clawray.samples import concat, make_row, rows_to_batch
from clawray.weights.control import start_app_control
from clawray.weights.publisher import WeightPublisher

logger = logging.getLogger(__name__)


def rm_rows(samples: Sequence[Mapping[str, Any]], advantages: Sequence[float], task_id: str,
            step: int, trajectory_id: str, *,
            rewards: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """One ``kind="rm"`` sample row per RM scoring of one step.

    ``samples`` are the step's ``m`` outputs of ``JudgeServer.judge_samples``; ``advantages``
    the step's ``rm_consistency_rewards`` (the caller drops steps where it is None);
    ``rewards`` the raw consistency rewards for the ``reward`` column (default: the
    advantages).
    """
    if len(samples) != len(advantages):
        raise ValueError(f"step {step} of {trajectory_id}: {len(samples)} RM samples but "
                         f"{len(advantages)} advantages")
    if rewards is not None and len(rewards) != len(samples):
        raise ValueError(f"step {step} of {trajectory_id}: {len(samples)} RM samples but "
                         f"{len(rewards)} rewards")
    rows = []
    for j, (s, adv) in enumerate(zip(samples, advantages)):
        rows.append(make_row(
            sample_id=f"{trajectory_id}/{step}/rm/{j}", kind="rm", source="env",
            trajectory_id=trajectory_id, task_id=task_id, step=step,
            prompt_ids=list(s["prompt_ids"]), response_ids=list(s["token_ids"]),
            rollout_logprobs=list(s["logprobs"]), policy_version=int(s["policy_version"]),
            policy_version_end=s.get("policy_version_end"), finish_reason=s.get("finish_reason"),
            reward=float(adv if rewards is None else rewards[j]), advantage=float(adv)))
    return rows


def rm_training_config(cfg: ClawRayConfig, **overrides: Any) -> TrainingConfig:
    """The RM learner's settings: the ``training`` section with ``lr = rlanything.rm_lr``, no
    KL reference (``kl_coef = 0``) and ``overrides`` (e.g. ``num_learners``,
    ``learner_num_cpus``). LoRA only when ``training.lora_rank`` asks for it."""
    data = cfg.training_cfg.model_dump()
    data["loss"] = {**data["loss"], "kl_coef": 0.0}
    data.update(lr=cfg.rlanything_cfg.rm_lr, batch_size=cfg.rlanything_cfg.rm_batch_size)
    data.update(overrides)
    return TrainingConfig.model_validate(data)


@ray.remote(num_cpus=0)
class RMCoTrainer:
    """The RM's learner group and its weight channel (one per Serve app).

    ``update`` trains once on a batch of rm rows, ``publish`` pushes the weights to every
    JudgeServer replica as the next RM version. Create it with ``start_rm_cotrainer`` once the
    app (with its JudgeServer) is running.
    """

    def __init__(self, config: dict[str, Any], app: str,
                 training: dict[str, Any] | None = None) -> None:
        cfg = ClawRayConfig.from_dict(config)
        self.cfg = rm_training_config(cfg, **(training or {}))
        self.batch_size = cfg.rlanything_cfg.rm_batch_size
        self.app, self.channel = app, judge_channel(app)
        control = start_app_control(self.channel)
        try:  # the replicas' reports tell which RM version the app already serves
            ray.get(control.wait_replicas.remote(0, self.cfg.sync_timeout_s, 1))
        except TimeoutError as e:
            raise RuntimeError(
                f"no JudgeServer replica listens on {self.channel!r} after "
                f"{self.cfg.sync_timeout_s:g}s: is app {app!r} deployed with training.mode "
                "'rlanything' and rlanything.rm_backend 'server'?") from e
        self.publisher = WeightPublisher(self.channel, lora=bool(self.cfg.lora_rank),
                                         timeout_s=self.cfg.sync_timeout_s)
        self.learner = LearnerGroup(judge_model_info(cfg).path, self.cfg,
                                    placement=cfg.placement_cfg.learner)
        self.publisher.attach(self.learner)
        self._dirty = False  # trained since the last publish
        self._rng = np.random.default_rng(self.cfg.seed)
        logger.info("RM co-trainer for app %s on channel %s, starting at version %d", app,
                    self.channel, self.publisher.version)

    def update(self, batch: Sequence[Mapping[str, Any]] | pa.Table | pa.RecordBatch
               ) -> dict[str, float]:
        """One learner iteration on ``rlanything.rm_batch_size`` rm rows at most (a random
        subset of a larger batch); metrics keys start with ``rm_``. No rows: no update."""
        table = (concat([batch]) if isinstance(batch, (pa.Table, pa.RecordBatch))
                 else pa.Table.from_batches([rows_to_batch(list(batch))]))
        if table.num_rows == 0:
            return {"rm_rows": 0.0, "rm_dropped": 0.0}
        kinds = set(table.column("kind").to_pylist())
        if kinds != {"rm"}:
            raise ValueError(f"the RM co-trainer trains kind 'rm' rows only, got {sorted(kinds)}")
        dropped = max(table.num_rows - self.batch_size, 0)
        if dropped:
            keep = np.sort(self._rng.choice(table.num_rows, self.batch_size, replace=False))
            table = table.take(pa.array(keep))
        metrics = self.learner.update(table)
        self._dirty = True
        out = {f"rm_{k}": float(v) for k, v in metrics.items()}
        out["rm_dropped"] = float(dropped)
        return out

    def publish(self) -> dict[str, Any]:
        """Send the weights as version + 1 on the judge channel and wait until every live
        JudgeServer replica serves them. Nothing trained since the last publish: a no-op
        (``published`` False)."""
        if not self._dirty:
            return {"version": self.publisher.version, "published": False}
        info = self.publisher.publish()
        self._dirty = False
        return {"published": True, **info}

    def version(self) -> int:
        """The RM version last published (or found serving at start)."""
        return self.publisher.version

    def logprobs(self, batch: Sequence[Mapping[str, Any]] | pa.Table) -> list[list[float]]:
        """Per row, the RM learner's current log-prob of each response token (evaluation)."""
        table = batch if isinstance(batch, pa.Table) else \
            pa.Table.from_batches([rows_to_batch(list(batch))])
        return self.learner.logprobs(table)

    def save(self, path: str) -> dict[str, Any]:
        """DeepSpeed checkpoint of the RM (model, optimizer, step) with its version."""
        state = {"rm_version": self.publisher.version, "channel": self.channel}
        self.learner.save(path, state)
        return state

    def load(self, path: str) -> dict[str, Any]:
        """Restore a ``save``; when the JudgeServer serves another version than the saved one,
        the restored weights are republished as the next version (versions never go back)."""
        state = self.learner.load(path)
        self._dirty = False
        self.publisher.resume(int(state["policy_version"]))
        return {**state, "version": self.publisher.version}

    def shutdown(self) -> None:
        """Free the learner ranks (idempotent)."""
        self.learner.shutdown()


def start_rm_cotrainer(cfg: ClawRayConfig, app: str, *, num_learners: int | None = None,
                       learner_num_cpus: float | None = None,
                       learner_num_gpus: float | None = None) -> Any:
    """An ``RMCoTrainer`` actor for ``app``'s JudgeServer (the app must be running).

    Its learner ranks take ``training``'s resources unless given here (the RM is often
    smaller than the policy); the actor itself reserves no CPU."""
    if cfg.rlanything_cfg.rm_backend != "server":
        raise ValueError("the RM co-trainer trains the app's JudgeServer: it needs "
                         f"rlanything.rm_backend 'server', not {cfg.rlanything_cfg.rm_backend!r}")
    overrides = {k: v for k, v in {"num_learners": num_learners,
                                   "learner_num_cpus": learner_num_cpus,
                                   "learner_num_gpus": learner_num_gpus}.items() if v is not None}
    return RMCoTrainer.remote(cfg.to_dict(), app, overrides)
