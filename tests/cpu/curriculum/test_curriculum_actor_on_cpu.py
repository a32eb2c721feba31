"""The curriculum actor on a real Ray cluster: leases and reports, released leases served
again, metrics for plotting, and exact resumption from its checkpoint after a kill (both the
automatic restart and a new actor)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from clawray.curriculum.actor import get_or_create_curriculum
from clawray.envs import Task

pytestmark = pytest.mark.ray

REPO = str(Path(__file__).resolve().parents[3])  # tests.support.* importable by workers
FAMILY = "tests.support.curriculum_toy:ToyFamily"  # importable by the actor through its PYTHONPATH


def _actor(ray, name: str | None = None, **kw):
    actor = get_or_create_curriculum(
        name or f"curriculum-{uuid.uuid4().hex[:8]}", namespace="clawray-tests",
        runtime_env={"env_vars": {"PYTHONPATH": REPO}}, family_name=FAMILY,
        **{"sampler": "alp_gmm", "sampler_kwargs": {"fit_rate": 5, "seed": 7}, **kw})
    assert ray.get(actor.ping.remote(), timeout=60) == "pong"
    return actor


def _rewards(task: dict) -> list[float]:
    x, y = task["params"]
    return [float(x + y < 1.0), float(x < 0.5), 0.0, 1.0]


def _cycles(ray, actor, n: int, runner: str = "r0") -> list[str]:
    """``n`` lease → report rounds; the task ids served."""
    ids = []
    for _ in range(n):
        (lease,) = ray.get(actor.lease.remote(runner, 1))
        ids.append(Task.from_dict(lease["task"]).task_id)
        assert ray.get(actor.report.remote(lease["lease_id"], _rewards(lease["task"])))
    return ids


def _wait_reported(ray, actor, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while ray.get(actor.metrics.remote(), timeout=timeout_s)["reported"] != n:
        assert time.time() < deadline, "the actor did not restart from its checkpoint"
        time.sleep(0.05)


def test_lease_report_and_metrics_with_histogram_and_trajectory(ray_cluster):
    ray = ray_cluster
    actor = _actor(ray, trajectory_every=2)
    leases = ray.get(actor.lease.remote("runner-a", 3))
    assert len(leases) == 3 and len({x["lease_id"] for x in leases}) == 3
    tasks = [Task.from_dict(x["task"]) for x in leases]
    assert all(t.family == "toy" and 0 <= min(t.params) <= max(t.params) <= 1 for t in tasks)
    assert ray.get(actor.open_leases.remote("runner-a")) == [x["lease_id"] for x in leases]
    for x in leases:
        assert ray.get(actor.report.remote(x["lease_id"], _rewards(x["task"]),
                                           {"steps": 3, "note": "ignored"}))
    assert not ray.get(actor.report.remote(leases[0]["lease_id"], [1.0]))  # reported twice
    _cycles(ray, actor, 3)
    m = ray.get(actor.metrics.remote())
    assert (m["served"], m["reported"], m["episodes"], m["unknown_reports"]) == (6, 6, 24, 1)
    assert m["open_leases"] == 0 and m["info/steps"] == 3.0
    assert len(m["difficulty_histogram"]) == 10 and sum(m["difficulty_histogram"]) == 24
    assert [t[0] for t in m["trajectory"]] == [8, 16, 24]  # every 2 reports
    assert all(0 <= t[1] <= 1 and 0 <= t[2] <= 1 for t in m["trajectory"])
    assert 0 < m["success_rate"] < 1
    assert m["sampler/fits"] == 1 and m["sampler/components"] >= 2  # fit_rate 5
    assert "sampler/component/0/alp" in m
    with pytest.raises(ray.exceptions.RayTaskError, match="reward"):
        ray.get(actor.report.remote(ray.get(actor.lease.remote("r", 1))[0]["lease_id"], [2.0]))
    ray.kill(actor, no_restart=True)


def test_released_leases_are_served_again_first_with_the_same_tasks(ray_cluster):
    ray = ray_cluster
    actor = _actor(ray, sampler="uniform", sampler_kwargs={"seed": 1})
    dead = ray.get(actor.lease.remote("dead", 3))
    alive = ray.get(actor.lease.remote("alive", 1))
    assert ray.get(actor.release.remote("dead")) == 3
    assert ray.get(actor.release.remote("dead")) == 0
    again = ray.get(actor.lease.remote("alive", 4))
    assert [x["task"] for x in again[:3]] == [x["task"] for x in dead]
    assert again[3]["task"] not in [x["task"] for x in dead + alive]
    assert not {x["lease_id"] for x in again} & {x["lease_id"] for x in dead}
    assert not ray.get(actor.report.remote(dead[0]["lease_id"], [1.0]))  # its lease is gone
    m = ray.get(actor.metrics.remote())
    assert (m["served"], m["retried"], m["released"], m["retry_queue"], m["open_leases"]) == (
        8, 3, 3, 0, 5)
    ray.kill(actor, no_restart=True)


def test_checkpoint_then_kill_resumes_with_the_same_next_tasks(ray_cluster, tmp_path):
    ray = ray_cluster
    ckpt = tmp_path / "curriculum.json"
    a = _actor(ray, checkpoint_path=str(ckpt), checkpoint_every=10)
    _cycles(ray, a, 10)  # checkpointed at 10 reports (two GMM fits)
    assert ckpt.exists() and [p.name for p in tmp_path.iterdir()] == ["curriculum.json"]
    expected = _cycles(ray, a, 6)  # what A does next (no checkpoint until 20)

    ray.kill(a, no_restart=False)  # Ray restarts it; its constructor restores the checkpoint
    _wait_reported(ray, a, 10)  # (the kill is asynchronous: calls may still reach the old one)
    assert _cycles(ray, a, 6) == expected
    assert ray.get(a.metrics.remote())["reported"] == 16

    ray.kill(a, no_restart=True)
    b = _actor(ray, checkpoint_path=str(ckpt), checkpoint_every=10)
    assert ray.get(b.metrics.remote())["reported"] == 10
    (held,) = ray.get(b.lease.remote("r1", 1))
    assert Task.from_dict(held["task"]).task_id == expected[0]
    ray.get(b.save.remote())  # with the lease open
    ray.kill(b, no_restart=True)
    c = _actor(ray, checkpoint_path=str(ckpt))
    assert ray.get(c.open_leases.remote("r1")) == [held["lease_id"]]  # leases survive
    assert ray.get(c.report.remote(held["lease_id"], _rewards(held["task"])))
    assert _cycles(ray, c, 5) == expected[1:]
    ray.kill(c, no_restart=True)
