"""The training loop: RLlib's ``Algorithm`` shape on Tune's ``Trainable`` contract.

``Trainer(config=cfg.to_dict())`` works on its own (``train()``, ``fit(n)``, ``save()``,
``restore()``) and as a Tune trainable (``tune.Tuner(Trainer, param_space=cfg.to_dict())``
runs, checkpoints and sweeps clawray configs). One iteration (``step``)::

    take   ≤ batch_size samples from the mode's batch source (object refs, no copy): the
           app's SampleBuffer in ``live`` mode, the env runners' buffer in ``env`` mode, in
           ``mixed`` mode ``env_fraction`` of the batch from it and the rest from live
           sessions, one synchronous RLAnything step in ``rlanything`` mode (``_take_*``)
    update one LearnerGroup iteration (DeepSpeed ranks read the refs zero-copy)
    sync   publish the new weights; wait until every serving replica runs them
    log    windowed stats (RLlib MetricsLogger), Ray metrics (Prometheus), a JSONL line,
           TensorBoard event files and W&B / MLflow runs (tracking.py, ``tracking:``)

In ``env`` and ``mixed`` modes the trainer also runs an ``EnvRunnerGroup`` (runners playing
GRPO groups against the same app, fed by the ``CurriculumActor``); each iteration replaces dead
runners and logs their throughput, success rate and the curriculum's metrics (``env_*``).
In ``rlanything`` mode the trainer drives the runners itself, one synchronous RLAnything step
per iteration (``rlanything/loop.py``): rollouts, m step-RM scores, critiques, environment
adaptation, then the policy update on those rows, then the reward model's update and sync.

Serving never pauses for training: replicas swap weights between generation steps, samples
carry the policy version they came from, and ``buffer.max_staleness`` plus the learner's
truncated importance weights handle samples from older versions (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray
from ray import serve, tune
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.util.metrics import Gauge
from tqdm.auto import tqdm

from clawray.buffer.core import Slice, fetch
from clawray.config import ClawRayConfig
from clawray.gate.actor import start_policy_gate
from clawray.learner.group import LearnerGroup
from clawray.models.loader import policy_model_info
from clawray.placement import check_placement
from clawray.rlanything.loop import RLAnythingLoop
from clawray.rollout.runner import EnvRunnerGroup
from clawray.samples import policy_user_of
from clawray.serve.app import build_app
from clawray.sessions.pipeline import start_live_pipeline
from clawray.training.per_user import next_take, plan_updates
from clawray.training.tracking import Tracker
from clawray.weights.nccl import check_nccl_available
from clawray.weights.publisher import WeightPublisher

logger = logging.getLogger(__name__)

WINDOW = 20  # iterations in the smoothed (windowed) stats


@dataclasses.dataclass
class Batch:
    """What a batch source took: the policy's rows (slices of object refs), and in
    ``rlanything`` mode the reward model's rows and the step's metrics."""

    slices: list[Any]
    rm_rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
LOGGED = ("reward_mean", "loss", "clip_frac", "is_weight_mean", "grad_norm", "tokens_per_s",
          "staleness_mean", "env_success", "env_episodes_per_s", "rla_success", "rm_step_acc")


class _Gauges:
    """Per-iteration values as Ray metrics (scraped by Prometheus with the rest of Ray's)."""

    def __init__(self, app: str) -> None:
        self.app = app
        self.gauges = {k: Gauge(f"clawray_train_{k}", description=f"training: {k}",
                                tag_keys=("app",))
                       for k in (*LOGGED, "policy_version", "samples", "sync_seconds")}

    def set(self, result: dict[str, Any]) -> None:
        for key, gauge in self.gauges.items():
            value = result.get(key)
            if isinstance(value, (int, float)) and np.isfinite(value):
                gauge.set(float(value), tags={"app": self.app})


TRAINED_IDS_KEPT = 200_000  # sample ids remembered to drop rows delivered again


class TrainedIds:
    """The most recent ``cap`` trained sample ids (insertion order), saved with checkpoints."""

    def __init__(self, cap: int, ids: list[str] = ()) -> None:  # type: ignore[assignment]
        self.cap = cap
        self._ids: dict[str, None] = {}
        self.add(list(ids))

    def add(self, ids: list[str]) -> None:
        for sid in ids:
            self._ids[sid] = None
        while len(self._ids) > self.cap:
            del self._ids[next(iter(self._ids))]

    def __contains__(self, sid: object) -> bool:
        return sid in self._ids

    def recent(self) -> list[str]:
        return list(self._ids)


def batch_stats(table: pa.Table, version: int) -> dict[str, float]:
    """What the iteration trained on: rewards, kinds, trainable share, staleness."""
    rewards = np.asarray(table.column("reward").to_numpy(), dtype=np.float64)
    versions = np.asarray(table.column("policy_version").to_numpy(), dtype=np.int64)
    kinds = table.column("kind").to_pylist()
    out = {"samples": float(table.num_rows), "reward_mean": float(rewards.mean()),
           "staleness_mean": float((version - versions).mean()),
           "staleness_max": float((version - versions).max())}
    for kind in sorted(set(kinds)):
        out[f"samples_{kind}"] = float(kinds.count(kind))
    return out


class LearnerLost(RuntimeError):
    """A learner rank died (its process or its node): the job stops, saying how to resume."""


class Trainer(tune.Trainable):
    """clawray's algorithm; ``config`` is a clawray config as a dict (``cfg.to_dict()``)."""

    # ---------------------------------------------------------------- Trainable contract

    def setup(self, config: dict[str, Any]) -> None:
        self.cfg = ClawRayConfig.from_dict(config).check()
        t = self.cfg.training_cfg
        self.app = t.app
        self.checkpoint_dir = Path(t.checkpoint_dir).expanduser()
        self.metrics_path = Path(t.metrics_path).expanduser() if t.metrics_path else \
            self.checkpoint_dir / "metrics.jsonl"
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        # TensorBoard (default), W&B, MLflow: the same results, one run per trainer start;
        # first, so a tracker turned on without its package stops the job before it starts
        self.tracker = Tracker(self.cfg.tracking_cfg,
                               f"{self.app}-{time.strftime('%Y%m%d-%H%M%S')}",
                               self.metrics_path.parent, config=self.cfg.to_dict())
        inf = self.cfg.inference_cfg
        nccl = inf.weight_transfer == "nccl"  # vLLM replicas created for NCCL (GPU)
        if nccl:
            check_nccl_available()  # before anything starts: a clear error without CUDA/vLLM
        # a learner rank, the buffer or a runner that no node can hold would wait forever
        check_placement(self.cfg, ray.nodes(), ("learner", "buffer") + (
            ("env_runners",) if t.mode != "live" else ()))
        self._ensure_app()
        self.pipeline = start_live_pipeline(self.cfg, self.app)
        self.publisher = WeightPublisher(self.app, lora=bool(t.lora_rank),
                                         timeout_s=t.sync_timeout_s,
                                         followers=[self.pipeline.buffer],
                                         transport="nccl" if nccl else "object_store",
                                         ranks_per_replica=inf.tensor_parallel_size)
        self.learner = LearnerGroup(policy_model_info(self.cfg).path, t,
                                    placement=self.cfg.placement_cfg.learner)
        self.publisher.attach(self.learner)
        self.envs = None
        self.rla = None
        if t.mode != "live":
            self.envs = EnvRunnerGroup(self.cfg, self.app)
            self.publisher.followers.append(self.envs.buffer)
        if t.per_user:
            self._republish_adapters()
        # The policy gate (docs/gate.md): versions are proposed to it as candidates; the
        # trainer follows its line (restarts from the incumbent when a candidate is abandoned,
        # drops rows the abandoned versions sampled) and reports judged turns for the canary.
        self.gate = start_policy_gate(self.app, self.cfg.gate_cfg) \
            if self.cfg.gate_cfg.enabled else None
        self._gate_line: int | None = None
        self._gate_abandoned: set[int] = set()
        if self.gate is not None:
            self._follow_gate()
        self.updates = 0
        self.user_updates: dict[str, int] = {}  # per-user mode: each user's last update number
        self._user_take = self.cfg.training_cfg.batch_size  # per-user mode: the next take
        # Exactly-once in effect: rows come under a lease, acknowledged once trained (or once
        # a checkpoint holds the update, with training.checkpoint_every); rows delivered again
        # (an expired lease, a restarted buffer) that were trained already are dropped here.
        self.trained = TrainedIds(TRAINED_IDS_KEPT)
        self._unacked: list[tuple[Any, list[int]]] = []  # (buffer, leases) not yet acked
        self.metrics = MetricsLogger()
        self.gauges = _Gauges(self.app)
        if self.envs is not None:
            if t.mode == "rlanything":
                self.rla = RLAnythingLoop(self.cfg, self.app, self.envs)
            else:
                self.envs.start()
            self._env_prev: dict[str, Any] = {}
            self._env_t = time.perf_counter()

    def _ensure_app(self) -> None:
        """Attach to the running Serve app named ``training.app``, or start it."""
        try:
            running = self.app in serve.status().applications
        except Exception:  # noqa: BLE001 - no Serve controller yet
            running = False
        if not running:
            logger.info("Serve app %r is not running: starting it", self.app)
            serve.run(build_app(self.cfg), name=self.app,
                      route_prefix="/" if self.app == "clawray" else f"/{self.app}")

    def step(self) -> dict[str, Any]:
        """One iteration: follow the gate, take a batch from the mode's source, train on it
        (one shared update, or each user's adapter), then the mode's own after-update work
        (RLAnything's RM update, env runner stats) and the logs."""
        started = time.perf_counter()
        result: dict[str, Any] = {"policy_version": self.version, "samples": 0,
                                  "samples_repeated": 0}
        if self.gate is not None:
            result.update(self._follow_gate())
        with self.metrics.log_time("time_take_s", reduce="mean", window=WINDOW):
            batch = self._take_batch()
        result.update(batch.metrics)
        if batch.slices:
            result.update(self._train(batch.slices))
        if self.rla is not None:
            result.update(self.rla.rm_update(batch.rm_rows))
            result["env_adapter"] = self.rla.metrics()
        if self.envs is not None:
            result.update(self._env_stats())
        self._log(result, started)
        return result

    def _lost_message(self, e: Exception) -> str:
        t, b = self.cfg.training_cfg, self.cfg.buffer_cfg
        cause = str(e).strip().splitlines()
        where = next((line.strip() for line in cause if line.strip().startswith("ip:")), "")
        why = next((line.strip() for line in reversed(cause) if line.strip()), type(e).__name__)
        lease = (f"again once its lease ends ({b.lease_s:g} s)" if b.lease_s is not None
                 else "again to the next trainer")
        return (f"a learner rank died ({where or 'node unknown'}: {why}). The job stops: "
                f"restart it when the cluster can hold the learner again (placement.learner "
                f"{self.cfg.placement_cfg.learner.model_dump()}, {t.num_learners} rank(s), "
                f"{t.placement_strategy}); it resumes from the last checkpoint under "
                f"{self.checkpoint_dir} (this run is at policy version {self.version}). The "
                f"batch it was training was not acknowledged: the buffer delivers it {lease}.")

    def _train(self, slices: list[Any]) -> dict[str, Any]:
        """Train on a taken batch: per-user, each picked user's adapter on their rows; else,
        less rows trained already (and, with the gate, rows of abandoned versions), one shared
        update, published every ``sync_every`` updates."""
        t = self.cfg.training_cfg
        table = fetch(slices, ray.get)
        out: dict[str, Any] = {}
        if t.per_user:
            out.update(batch_stats(table, self.version))
            with self.metrics.log_time("time_update_s", reduce="mean", window=WINDOW):
                out.update(self._per_user_update(table, slices))
            return out  # acknowledged row by row; no shared update
        if self.gate is not None:
            out.update(self._gate_observe(table))
        table, slices, out["samples_repeated"] = self._drop_trained(table, slices)
        if not slices:
            return out
        out.update(batch_stats(table, self.version))
        with self.metrics.log_time("time_update_s", reduce="mean", window=WINDOW):
            try:
                out.update(self.learner.update(slices))
            except ray.exceptions.RayActorError as e:
                raise LearnerLost(self._lost_message(e)) from e
        self.trained.add(table.column("sample_id").to_pylist())
        self.updates += 1
        if out.get("optimizer_steps", 0) and self.updates % t.sync_every == 0:
            with self.metrics.log_time("time_sync_s", reduce="mean", window=WINDOW):
                sync = self._publish()
            out.update({f"sync_{k}": v for k, v in sync.items()
                        if k in ("bytes", "seconds", "send_s", "apply_s")})
            if "gate" in sync:  # what the policy gate made of the new version
                out["gate"] = sync["gate"]
            out["policy_version"] = self.version
        return out

    def _log(self, result: dict[str, Any], started: float) -> None:
        """Windowed stats, Ray gauges, the JSONL line, the trackers; then the checkpoint (or
        the acknowledgement) of what this iteration trained."""
        t = self.cfg.training_cfg
        for key in LOGGED:
            if key in result:
                self.metrics.log_value(key, result[key], window=WINDOW)
        self.metrics.log_value("samples_total", result["samples"], reduce="sum")
        result["smoothed"] = {k: float(v) for k, v in self.metrics.reduce(compile=True).items()}
        result["iteration_s"] = time.perf_counter() - started
        self.gauges.set(result)
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({"iteration": self.iteration + 1, "time": time.time(),
                                **_jsonable(result)}) + "\n")
        self.tracker.log(self.iteration + 1, result)
        if t.checkpoint_every and (self.iteration + 1) % t.checkpoint_every == 0:
            self.save_checkpoint(str(self.checkpoint_dir))  # acknowledges what it holds
        elif not t.checkpoint_every:
            self._ack()

    def _republish_adapters(self) -> int:
        """Per-user mode, at start: publish every stored adapter the app does not serve at its
        version (a new app, or a control actor that restarted and forgot its table), so users
        get their own policy again without waiting for their next update. Returns how many."""
        served = self.publisher.status().get("adapters", {})
        stale = {u: v for u, v in self.learner.stored_adapters().items()
                 if (served.get(u) or 0) < v}
        for user, version in sorted(stale.items()):
            self.publisher.publish_adapter(user, self.learner.adapter_payload(user), version)
        if stale:
            logger.info("per-user: republished %d stored adapters to app %r", len(stale),
                        self.app)
        return len(stale)

    def _per_user_update(self, table: pa.Table, slices: list[Any]) -> dict[str, Any]:
        """Per-user policies: update the adapters of the users ``plan_updates`` picks, each on
        their own rows, publish each beside the others, and acknowledge just the rows trained
        (rows already trained, or of no user, are consumed too); the others go back to the
        buffer for a later iteration."""
        t = self.cfg.training_cfg
        users = policy_user_of(table).to_pylist()
        ids = table.column("sample_id").to_pylist()
        done = np.array([sid in self.trained or u is None for sid, u in zip(ids, users)])
        plan = plan_updates([None if d else u for d, u in zip(done, users)], self.user_updates,
                            min_rows=t.per_user_min_rows, max_rows=t.per_user_max_rows,
                            max_users=t.per_user_max_users)
        out: dict[str, Any] = {"users_trained": [p.user for p in plan], "user_versions": {},
                               "user_rows": 0, "sync_s": 0.0}
        losses = []
        for p in plan:
            r = self.learner.update_user(p.user, table.take(pa.array(p.rows)))
            self.updates += 1
            self.user_updates[p.user] = self.updates
            sync = self.publisher.publish_adapter(p.user, r["payload"], r["version"])
            out["sync_s"] += sync["seconds"]
            out["user_versions"][p.user] = r["version"]
            out["user_rows"] += len(p.rows)
            losses.append(r["metrics"].get("loss", 0.0))
            done[p.rows] = True
            self.trained.add([ids[i] for i in p.rows])
        if losses:
            out["loss"] = float(np.mean(losses))
        out["users_waiting"] = len({u for d, u in zip(done, users) if not d})
        asked = self._user_take
        self._user_take = next_take(asked, t.batch_size, trained=bool(plan), taken=len(ids),
                                    cap=t.per_user_max_take)
        if self._user_take > asked:
            logger.info("per-user: no user had %d rows among the %d taken; the next take asks "
                        "for %d", t.per_user_min_rows, len(ids), self._user_take)
        # acknowledge row by row: each lease's flags in its slices' order
        pending, self._unacked = self._unacked, []
        flags: dict[int, list[bool]] = {}
        pos = 0
        for s in slices:
            flags.setdefault(s.lease, []).extend(done[pos:pos + s.length].tolist())
            pos += s.length
        for buffer, leases in pending:
            ray.get([buffer.ack_rows.remote(lease, flags[lease]) for lease in leases
                     if lease in flags])
        return out

    def _leased(self, buffer: Any, slices: list[Any]) -> list[Any]:
        """Remember the leases of a take, to acknowledge once their rows are trained."""
        leases = sorted({s.lease for s in slices if s.lease is not None})
        if leases:
            self._unacked.append((buffer, leases))
        return slices

    def _ack(self) -> None:
        """Tell the buffers the leased rows are trained (consumed)."""
        pending, self._unacked = self._unacked, []
        ray.get([buffer.ack.remote(leases) for buffer, leases in pending])

    def _drop_trained(self, table: pa.Table, slices: list[Any]) -> tuple[pa.Table, list[Any], int]:
        """Rows delivered again that were trained already (by ``sample_id``) are dropped, and
        with the policy gate rows sampled by abandoned versions; the rest goes to the learner
        as one new slice when anything was dropped. Returns the rows trained already."""
        ids = table.column("sample_id").to_pylist()
        versions = table.column("policy_version").to_pylist()
        keep = [i for i, sid in enumerate(ids) if sid not in self.trained
                and versions[i] not in self._gate_abandoned]
        repeated = sum(sid in self.trained for sid in ids)
        if len(keep) == len(ids):
            return table, slices, 0
        if repeated:
            logger.warning("%d rows delivered again were trained already: dropped", repeated)
        if len(ids) - len(keep) > repeated:
            logger.info("gate: %d rows sampled by abandoned versions dropped",
                        len(ids) - len(keep) - repeated)
        table = table.take(pa.array(keep, pa.int64())).combine_chunks()
        if not keep:
            return table, [], repeated
        batch = table.to_batches()[0]
        return table, [Slice(-1, ray.put(batch), 0, batch.num_rows)], repeated

    # ---------------------------------------------------------------- batch sources
    # One per training.mode: each takes this iteration's batch (slices of object refs, under
    # leases ``_leased`` remembers for the acknowledgement).

    def _take_batch(self) -> Batch:
        return {"live": self._take_live, "env": self._take_env, "mixed": self._take_mixed,
                "rlanything": self._take_rlanything}[self.cfg.training_cfg.mode]()

    def _take_live(self) -> Batch:
        """Live sessions' rows (per-user: as many as ``next_take`` asked for last time)."""
        t = self.cfg.training_cfg
        live = self.pipeline.buffer
        n = self._user_take if t.per_user else t.batch_size
        return Batch(self._leased(live, ray.get(live.take.remote(n, t.take_timeout_s,
                                                                 t.min_batch))))

    def _take_env(self) -> Batch:
        """The env runners' GRPO rows."""
        t = self.cfg.training_cfg
        env = self.envs.buffer
        return Batch(self._leased(env, ray.get(env.take.remote(t.batch_size, t.take_timeout_s,
                                                               t.min_batch))))

    def _take_mixed(self) -> Batch:
        """``env_fraction`` of the batch from the env runners, the rest from live sessions;
        whichever side falls short is topped up from the other, and a batch still below
        ``min_batch`` goes back at once."""
        t = self.cfg.training_cfg
        live, env = self.pipeline.buffer, self.envs.buffer
        n_env = round(t.batch_size * t.env_fraction)
        n_live = t.batch_size - n_env
        first = len(self._unacked)
        env_ref = env.take.remote(n_env, t.take_timeout_s, 0) if n_env else None
        live_ref = live.take.remote(n_live, t.take_timeout_s, 0) if n_live else None
        env_part = self._leased(env, ray.get(env_ref)) if env_ref else []
        live_part = self._leased(live, ray.get(live_ref)) if live_ref else []
        slices = env_part + live_part
        short = t.batch_size - sum(s.length for s in slices)
        if short > 0:
            other = env if sum(s.length for s in live_part) < n_live else live
            have = ray.get(other.stats.remote()).get("available", 0)
            if have:
                slices += self._leased(other, ray.get(other.take.remote(min(short, have), 0.0, 1)))
        if sum(s.length for s in slices) < t.min_batch:  # too few: give them back at once
            mine, self._unacked = self._unacked[first:], self._unacked[:first]
            ray.get([buffer.release.remote(leases) for buffer, leases in mine])
            return Batch([])
        return Batch(slices)

    def _take_rlanything(self) -> Batch:
        """One RLAnything step up to the updates: its policy rows go through the env buffer
        (durable before they are trained on), its RM rows wait for ``rm_update``."""
        policy_rows, rm_rows, metrics = self.rla.rollouts_and_rows()
        slices: list[Any] = []
        if policy_rows:
            ray.get(self.envs.buffer.add.remote(policy_rows))
            slices = self._leased(self.envs.buffer, ray.get(self.envs.buffer.take.remote(
                len(policy_rows), self.cfg.training_cfg.take_timeout_s, 1)))
        return Batch(slices, rm_rows, metrics)

    def _env_stats(self) -> dict[str, Any]:
        """Runner replacement, throughput since the last iteration, curriculum metrics."""
        poll = self.envs.poll()
        stats = self.envs.stats()
        now = time.perf_counter()
        dt = max(now - self._env_t, 1e-9)
        prev = self._env_prev

        def new(key: str) -> float:  # the counter's growth since the last iteration
            return stats[key] - prev.get(key, 0)

        out: dict[str, Any] = {
            "env_episodes_per_s": new("episodes") / dt,
            "env_tokens_per_s": new("tokens") / dt,
            "env_success": new("successes") / max(new("episodes"), 1),
            # plain GRPO pushes these down while pushing the same (context, action) up
            # elsewhere in the group (clawray.envs.rollout.group_diagnostics)
            "env_conflict_share": new("conflict_steps") / max(new("worse_steps"), 1),
            "env_anchored_share": new("anchored_steps") / max(new("steps"), 1),
            "env_runners": stats["runners"], "env_runner_restarts": stats["runner_restarts"],
            "env_released_leases": poll["released"], "env_groups": stats["groups"],
            "env_curriculum": stats["curriculum"]}
        self._env_prev, self._env_t = stats, now
        return out

    @property
    def version(self) -> int:
        """The policy version serving runs (the publisher's; one place, not copies)."""
        return self.publisher.version

    def _publish(self) -> dict[str, Any]:
        """Send version + 1 to serving and wait until every replica runs it; with the policy
        gate, propose it as a candidate (served as its own adapter, to its canary only, once
        it passed shadow evaluation)."""
        if self.gate is None:
            return self.publisher.publish()
        version = self.publisher.version + 1
        sent = self.learner.put_weights(version)
        ev = ray.get(self.gate.propose.remote(version, sent["payload"], self._gate_line))
        self.publisher.version = version
        return {"bytes": sent["bytes"], "seconds": sent["seconds"], "gate": ev["event"]}

    def _follow_gate(self) -> dict[str, Any]:
        """Follow the gate's line: at start and whenever a candidate was abandoned (rejected,
        rolled back), restart the learner's adapter from the line's head (the newest version
        not abandoned: the incumbent, or a pending candidate) and drop the abandoned versions'
        rows from now on. Versions continue after the newest the gate has seen."""
        info = ray.get(self.gate.line.remote())
        self._gate_abandoned = set(info["abandoned"])
        if info["published"] > self.publisher.version:
            self.publisher.version = int(info["published"])
            self.learner.set_version(self.publisher.version)
        if info["line"] == self._gate_line:
            return {}
        head = int(info["head"])
        self.learner.restart_lora(ray.get(self.gate.payload.remote(head)))
        logger.info("gate: the learner restarts from version %d (line %d)", head, info["line"])
        self._gate_line = info["line"]
        return {"gate_restarted_from": head}

    def _gate_observe(self, table: pa.Table) -> dict[str, Any]:
        """Report the batch's judged turns (the version that served them, reward, when, and
        whether judged, rated by the user or regenerated) for the canary; one per turn, rows
        trained already skipped."""
        cols = {c: table.column(c).to_pylist() for c in
                ("sample_id", "kind", "judge_status", "policy_version", "reward", "created_at")}
        seen: dict[str, tuple[int, float, float | None, str]] = {}
        for sid, kind, status, version, reward, at in zip(*cols.values()):
            if kind in ("rl", "combine") and status in ("judged", "feedback", "regenerated") \
                    and sid not in self.trained:
                seen.setdefault(sid.rsplit("/", 1)[0], (int(version), float(reward), at, status))
        if not seen:
            return {}
        events = ray.get(self.gate.observe.remote(list(seen.values())))
        return {"gate_observed": len(seen), "gate_events": [e["event"] for e in events]}

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any]:
        """Learner (model, optimizer, step) via DeepSpeed, plus the trainer's own state.

        The buffer's consumed position is the buffer's own durable checkpoint, advanced by the
        trainer's acknowledgements: after each update, or (with ``training.checkpoint_every``)
        here, once the checkpoint holds the updates. The ids of recently trained rows are
        saved with it: rows delivered again after a crash are dropped instead of trained
        twice. The position is recorded here so a restore can report it."""
        path = Path(checkpoint_dir)
        path.mkdir(parents=True, exist_ok=True)
        buffer = ray.get(self.pipeline.buffer.stats.remote())
        state = {"policy_version": self.version, "updates": self.updates,
                 "buffer_consumed": buffer.get("consumed"), "app": self.app}
        if self.envs is not None:
            # Resume it with curriculum.checkpoint_path (``clawray.train --restore`` does).
            state["curriculum"] = ray.get(self.envs.curriculum.save.remote(
                str(path / "curriculum.json")))
        if self.rla is not None:
            self.rla.save(str(path))
        state["trained_ids"] = self.trained.recent()
        self.learner.save(path / "learner", state)
        (path / "trainer.json").write_text(json.dumps(state))
        self._ack()  # the checkpoint holds every update so far: their rows are consumed
        return state

    def load_checkpoint(self, checkpoint: str | dict[str, Any]) -> None:
        path = Path(checkpoint if isinstance(checkpoint, str) else checkpoint["path"])
        state = json.loads((path / "trainer.json").read_text())
        self.learner.load(path / "learner")
        self.updates = int(state["updates"])
        self.trained = TrainedIds(TRAINED_IDS_KEPT, state.get("trained_ids", []))
        # Serving may hold weights newer than the checkpoint (trained after it was taken):
        # the publisher republishes the checkpoint's weights then, so versions never go back.
        self.publisher.resume(int(state["policy_version"]))
        self.restored_state = state

    def cleanup(self) -> None:
        if getattr(self, "tracker", None) is not None:
            self.tracker.close()
        if getattr(self, "rla", None) is not None:
            self.rla.shutdown()
        if getattr(self, "envs", None) is not None:
            self.envs.shutdown()
        self.learner.shutdown()

    # ---------------------------------------------------------------- Algorithm-style helpers

    def fit(self, iterations: int, progress: bool = True) -> list[dict[str, Any]]:
        """Run ``iterations`` training iterations with a progress bar; return their results."""
        results = []
        with tqdm(total=iterations, disable=not progress, desc="clawray train",
                  unit="it") as bar:
            for _ in range(iterations):
                r = self.train()
                results.append(r)
                bar.set_postfix(progress_fields(r), refresh=False)
                bar.update(1)
        self.save_checkpoint(str(self.checkpoint_dir))
        return results


def progress_fields(r: dict[str, Any]) -> dict[str, str]:
    """The progress line: step, samples, reward, loss and policy version."""
    def f(key: str, fmt: str) -> str:
        v = r.get(key)
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    return {"step": str(r.get("training_iteration", "-")), "samples": f("samples", "{:.0f}"),
            "reward": f("reward_mean", "{:+.2f}"), "loss": f("loss", "{:.3f}"),
            "version": str(r.get("policy_version", "-"))}


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    return obj
