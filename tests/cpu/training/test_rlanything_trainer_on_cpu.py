"""The Trainer in rlanything mode: one synchronous step per iteration (rollouts, m RM scores
from a JudgeServer, critiques, env adaptation, policy update and sync, RM update), every phase
timed, the env adapter checkpointed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawray.config import ClawRayConfig

APP = "rla-trainer"
REPO = str(Path(__file__).resolve().parents[3])  # tests.support.* importable by workers


@pytest.fixture(scope="module")
def rla_cfg(served, tmp_path_factory):
    from ray import serve

    from clawray.serve.app import build_app

    cfg = (ClawRayConfig().inference(engine="hf")
           .serving(record_sink=["none"], replica_num_cpus=0.25, default_max_tokens=8)
           .buffer(path=str(tmp_path_factory.mktemp("rla") / "s"), seal_age_s=0.1)
           .environments(family="tests.support.env_split:SplitFamily", num_runners=1,
                         runner_num_cpus=0.25, group_size=4, max_tokens=6,
                         runtime_env={"env_vars": {"PYTHONPATH": REPO}})
           # lam < 1: a success's step reward R = 1 + lam * mean(S) stays above every failure's
           # (-1 + lam * mean(S)) whatever the RM scores, so a group's rewards certainly differ.
           .rlanything(slots=2, m=3, max_tokens=8, rm_backend="server", co_train_rm=True,
                       lam=0.5)
           .training(app=APP, mode="rlanything", batch_size=8, min_batch=1, take_timeout_s=30,
                     lr=1e-3, learner_num_cpus=0.25, sync_timeout_s=60,
                     checkpoint_dir=str(tmp_path_factory.mktemp("rla-ckpt"))))
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    yield cfg
    serve.delete(APP)


def test_rlanything_mode_runs_every_phase_on_one_batch_and_trains_the_policy(rla_cfg, tmp_path):
    from clawray.training.trainer import Trainer

    trainer = Trainer(config=rla_cfg.to_dict())
    try:
        v0 = trainer.version
        results = [trainer.train() for _ in range(2)]  # the second: from the first's state
        last = results[-1]
        for r in results:
            assert r["rla_tasks"] >= 2 and r["rla_episodes"] == 4 * r["rla_tasks"]
            assert {"time_rollout_s", "time_rm_score_s", "time_critique_s",
                    "time_adapt_s"} <= set(r)
            # The untrained tiny RM rarely writes a verdict: unparseable scorings are
            # counted, never dropped silently; R falls back to the outcome for them.
            scored = r["rla_steps"] * 3
            assert 0 <= r["rm_unparseable"] <= scored
            # SplitFamily: every task's 4 one-step rollouts are 2 successes and 2 failures
            # (accuracy 0.5: in the policy band, no rewrite), so every step has a non-zero
            # advantage and is trained on, and each iteration is one optimizer step and sync.
            assert r["rla_success"] == 0.5 and r["rla_steps"] == r["rla_episodes"]
            assert r["rla_policy_rows"] == r["samples"] == r["rla_episodes"]
            assert r["optimizer_steps"] == 1
        assert [r["policy_version"] for r in results] == [v0 + 1, v0 + 2]
        status = trainer.publisher.status()
        assert status["version"] == last["policy_version"]
        # every live replica serving the policy runs that version (not just the published one)
        running = [r["version"] for r in status["replicas"].values() if r["live"] and r["weights"]]
        assert running and set(running) == {status["version"]}, status
        assert len(last["env_adapter"]["slot_depth"]) == 2 and last["env_adapter"]["step"] == 2
        line = json.loads(trainer.metrics_path.read_text().splitlines()[-1])
        assert "rla_success" in line and "rm_step_acc" in line
        trainer.save_checkpoint(str(tmp_path / "ckpt"))
        saved = json.loads((tmp_path / "ckpt" / "env_adapter.json").read_text())
        assert len(saved["slots"]) == 2
    finally:
        trainer.stop()
