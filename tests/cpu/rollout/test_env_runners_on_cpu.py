"""EnvRunners on real Ray + Serve: GRPO groups from the served policy into the env buffer,
the curriculum fed, a runner killed mid-run replaced with nothing half written."""

from __future__ import annotations

import time
from collections import Counter

import pyarrow.dataset as ds
import pytest
import ray

from clawray.config import ClawRayConfig

APP = "envs"
G = 2


@pytest.fixture(scope="module")
def env_app(served, tmp_path_factory):
    from ray import serve

    from clawray.serve.app import build_app

    cfg = (ClawRayConfig().inference(engine="hf")
           .serving(record_sink=["none"], replica_num_cpus=0.5)
           .buffer(path=str(tmp_path_factory.mktemp("env-samples") / "s"), seal_age_s=0.1)
           .environments(family="household", num_runners=2, runner_num_cpus=0.25,
                         concurrency=2, group_size=G, max_tokens=8, seed=3, history_window=0,
                         family_kwargs={})
           .curriculum(sampler="uniform"))
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    yield cfg
    serve.delete(APP)


def _wal_rows(cfg: ClawRayConfig):
    return ds.dataset(cfg.buffer_cfg.path + "-env", format="parquet").to_table().to_pylist()


def _assert_whole_groups(rows):
    """Every trajectory has steps 0..n-1, and every task's trajectories come in groups of G."""
    steps: dict[str, list[int]] = {}
    task_of: dict[str, str] = {}
    for r in rows:
        steps.setdefault(r["trajectory_id"], []).append(r["step"])
        task_of[r["trajectory_id"]] = r["task_id"]
    for traj, s in steps.items():
        assert sorted(s) == list(range(len(s))), traj
    per_task = Counter(task_of.values())
    assert all(n % G == 0 for n in per_task.values()), per_task


def test_runners_play_groups_into_the_env_buffer_and_report_to_the_curriculum(env_app):
    from clawray.rollout.runner import EnvRunnerGroup

    group = EnvRunnerGroup(env_app, APP)
    try:
        group.start(max_groups=2)
        deadline = time.time() + 120
        while group.runs and time.time() < deadline:
            group.poll()
            time.sleep(0.5)
        stats = group.stats()
        assert stats["groups"] == 4 and stats["episodes"] == 4 * G
        assert stats["curriculum"]["reported"] == 4
        ray.get(group.buffer.flush.remote())
        rows = _wal_rows(env_app)
        assert len(rows) == stats["rows"] == stats["steps"]
        _assert_whole_groups(rows)
        assert {r["source"] for r in rows} == {"env"}
        assert {r["outcome"] for r in rows} <= {1, -1}
        assert all(len(r["rollout_logprobs"]) == len(r["response_ids"]) for r in rows)
        # The untrained model fails: groups without signal are kept, masked.
        assert all(r["advantage"] == 0 and sum(r["loss_mask"]) == 0 for r in rows
                   if r["outcome"] == -1 and stats["successes"] == 0)
        results = group.evaluate([group_task(i) for i in range(3)])
        assert len(results) == 3 and all(set(r) >= {"success", "steps", "difficulty"}
                                         for r in results)
    finally:
        group.shutdown()


def group_task(i: int):
    from clawray.envs import make_family

    return make_family("household").generate([0.0] * 4, seed=100 + i)


def test_a_killed_runner_is_replaced_and_its_leases_are_played_again(env_app):
    from clawray.rollout.runner import EnvRunnerGroup

    group = EnvRunnerGroup(env_app, APP)
    try:
        group.start()
        victim = next(iter(group.runners))
        deadline = time.time() + 120
        while not ray.get(group.curriculum.open_leases.remote(victim)):
            # until the victim holds a lease mid-group (each of its two workers holds one from
            # lease to report and leases again at once: it still holds one a moment later)
            assert time.time() < deadline, "the runner never took a lease"
            time.sleep(0.1)
        ray.kill(group.runners[victim])
        deadline = time.time() + 120
        replaced = []
        while not replaced and time.time() < deadline:
            replaced = group.poll()["replaced"]
            time.sleep(0.2)
        assert replaced and replaced[0][0] == victim
        assert victim not in group.runners and len(group.runners) == 2
        metrics = ray.get(group.curriculum.metrics.remote())
        assert metrics["released"] >= 1
        deadline = time.time() + 120
        while ray.get(group.curriculum.metrics.remote())["retried"] < 1 \
                and time.time() < deadline:
            time.sleep(0.2)
        assert ray.get(group.curriculum.metrics.remote())["retried"] >= 1
        assert group.stats()["runner_restarts"] == 1
    finally:
        group.shutdown()
    ray.get(group.buffer.flush.remote())
    _assert_whole_groups(_wal_rows(env_app))
