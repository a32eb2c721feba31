"""The Trainer in env and mixed modes: runners' GRPO groups are trained on, new weights reach
serving, env metrics and the curriculum are logged and checkpointed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawray.config import ClawRayConfig

APP = "env-trainer"
REPO = str(Path(__file__).resolve().parents[3])  # tests.support.* importable by workers


@pytest.fixture(scope="module")
def env_cfg(served, tmp_path_factory):
    from ray import serve

    from clawray.serve.app import build_app

    cfg = (ClawRayConfig().inference(engine="hf")
           .serving(record_sink=["hub"], replica_num_cpus=0.5, default_max_tokens=8)
           .sessions(idle_timeout_s=2, feedback_window_s=0, flush_interval_s=0.1)
           .judge(num_voters=1, timeout_s=20)
           .buffer(path=str(tmp_path_factory.mktemp("env-trainer") / "s"), seal_age_s=0.1)
           .environments(family="tests.support.env_split:SplitFamily", num_runners=1,
                         runner_num_cpus=0.25, concurrency=2, group_size=4, max_tokens=6,
                         runtime_env={"env_vars": {"PYTHONPATH": REPO}})
           .curriculum(sampler="uniform")
           .training(app=APP, mode="env", batch_size=8, min_batch=4, take_timeout_s=60,
                     lr=1e-3, learner_num_cpus=0.5, sync_timeout_s=60,
                     checkpoint_dir=str(tmp_path_factory.mktemp("env-ckpt"))))
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    yield cfg
    serve.delete(APP)


def test_env_mode_trains_on_grpo_groups_and_serving_gets_the_weights(env_cfg, tmp_path):
    from clawray.training.trainer import Trainer

    trainer = Trainer(config=env_cfg.to_dict())
    try:
        v0 = trainer.version
        results = [trainer.train() for _ in range(2)]
        # SplitFamily: every GRPO group is 2 successes and 2 failures (advantages +1 and -1,
        # every row trainable), so each iteration is one optimizer step and one weight sync.
        assert [r["optimizer_steps"] for r in results] == [1, 1], results
        assert all(r["samples"] >= 4 for r in results)
        assert [r["policy_version"] for r in results] == [v0 + 1, v0 + 2]
        assert {"env_episodes_per_s", "env_success", "env_curriculum"} <= set(results[-1])
        assert results[-1]["env_curriculum"]["reported"] >= 2
        status = trainer.publisher.status()
        assert status["version"] == results[-1]["policy_version"]
        # every live replica serving the policy runs that version (not just the published one)
        running = [r["version"] for r in status["replicas"].values() if r["live"] and r["weights"]]
        assert running and set(running) == {status["version"]}, status
        line = json.loads(trainer.metrics_path.read_text().splitlines()[-1])
        assert "env_success" in line
        state = trainer.save_checkpoint(str(tmp_path / "ckpt"))
        saved = json.loads((tmp_path / "ckpt" / "curriculum.json").read_text())
        assert saved["counts"]["reported"] >= 2 and state["curriculum"]
    finally:
        trainer.stop()


def test_mixed_mode_takes_the_configured_share_from_each_buffer(env_cfg):
    from clawray.training.trainer import Trainer

    cfg = env_cfg.copy_with(training={"mode": "mixed", "env_fraction": 0.5,
                                      "take_timeout_s": 5})
    trainer = Trainer(config=cfg.to_dict())
    try:
        # No live users here: the live half is topped up from the env buffer.
        r = trainer.train()
        assert r["samples"] == cfg.training_cfg.batch_size
    finally:
        trainer.stop()
