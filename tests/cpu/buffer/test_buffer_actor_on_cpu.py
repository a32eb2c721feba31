"""The SampleBuffer actor on a real Ray cluster: durable acks, waiting takes, and no loss or
duplicate when the actor is killed mid-stream and producers retry their unacknowledged adds."""

from __future__ import annotations

import asyncio
import time
import uuid

import pyarrow.dataset as ds
import pytest

from clawray.buffer.core import fetch, fetch_from_wal
from clawray.config import BufferConfig
from clawray.samples import make_row

pytestmark = pytest.mark.ray

RETRYABLE = ("RayActorError", "ActorUnavailableError", "ActorDiedError")


def _row(sid: str) -> dict:
    return make_row(sample_id=sid, kind="rl", source="live", prompt_ids=[1, 2, 3],
                    response_ids=[4, 5], rollout_logprobs=[-0.5, -0.5], policy_version=0,
                    reward=1.0)


def _start(ray, tmp_path, **cfg):
    from clawray.buffer.actor import start_sample_buffer

    name = f"buf-{uuid.uuid4().hex[:8]}"
    config = BufferConfig(path=str(tmp_path / "wal"), **cfg)
    actor = start_sample_buffer(config, name=name, namespace="clawray-tests")
    assert ray.get(actor.ping.remote(), timeout=120) == "pong"
    return actor, config


def _kill(ray, actor):
    ray.kill(actor, no_restart=True)


@pytest.fixture()
def producer_cls(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Producer:
        """Adds rows in small batches; retries an add that failed with the buffer's crash."""

        def __init__(self, buffer, prefix: str) -> None:
            self.buffer, self.prefix = buffer, prefix

        async def run(self, batches: int, size: int) -> dict:
            from clawray.samples import make_row  # (workers cannot import this test module)

            acked, retries = [], 0
            for b in range(batches):
                rows = [make_row(sample_id=f"{self.prefix}-{b:03d}-{k}", kind="rl",
                                 source="live", prompt_ids=[1, 2, 3], response_ids=[4, 5],
                                 rollout_logprobs=[-0.5, -0.5], policy_version=0, reward=1.0)
                        for k in range(size)]
                delay = 0.05
                while True:
                    try:
                        await self.buffer.add.remote(rows)
                        break
                    except Exception as exc:  # only the crash errors are retried
                        if type(exc).__name__ not in RETRYABLE:
                            raise
                        retries += 1
                        await asyncio.sleep(delay)
                        delay = min(1.0, delay * 2)
                acked += [r["sample_id"] for r in rows]
            return {"acked": acked, "retries": retries}

    return Producer


def _take_retrying(ray, actor, n: int, timeout_s: float, ack: bool = True):
    """A take (acknowledged at once, as a trainer does after its update) that waits out a
    restart (up to 120 s: a restart on a loaded machine can take tens of seconds); the test
    kills only between takes."""
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            slices = ray.get(actor.take.remote(n, timeout_s))
            if ack and slices:
                ray.get(actor.ack.remote(sorted({s.lease for s in slices})))
            return slices
        except Exception as exc:
            if type(exc).__name__ not in RETRYABLE:
                raise
            time.sleep(0.1)
    raise AssertionError("buffer did not come back")


def _wait_restarted(ray, actor) -> None:
    """Until a fresh process answers (its counters start at zero); 120 s at most."""
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if ray.get(actor.stats.remote(), timeout=5)["rows_taken"] == 0:
                return
        except Exception as exc:
            if type(exc).__name__ not in RETRYABLE + ("GetTimeoutError",):
                raise
        time.sleep(0.1)
    raise AssertionError("buffer did not restart")


def test_add_acknowledges_only_durable_rows(ray_cluster, tmp_path):
    ray = ray_cluster
    actor, cfg = _start(ray, tmp_path, seal_rows=1000, seal_age_s=0.2)
    try:
        t0 = time.time()
        accepted = ray.get(actor.add.remote([_row(f"d-{i}") for i in range(5)]))
        waited = time.time() - t0
        assert accepted == [f"d-{i}" for i in range(5)]
        assert waited >= 0.15  # sealed by age, not before
        on_disk = ds.dataset(cfg.path, format="parquet").to_table()
        assert sorted(on_disk.column("sample_id").to_pylist()) == accepted
        assert ray.get(actor.add.remote([_row("d-1")])) == []  # a retry: dropped, still acked
        stats = ray.get(actor.stats.remote())
        assert stats["rows_sealed"] == 5 and stats["duplicates"] == 1
    finally:
        _kill(ray, actor)


def test_take_waits_for_rows_and_hands_out_refs(ray_cluster, tmp_path):
    ray = ray_cluster
    actor, _ = _start(ray, tmp_path, seal_rows=4, seal_age_s=0.05)
    try:
        assert ray.get(actor.take.remote(3, 0.0)) == []
        waiting = actor.take.remote(6, 120.0)  # returns once 6 rows are there
        ray.get(actor.add.remote([_row(f"w-{i}") for i in range(4)]))
        ray.get(actor.add.remote([_row(f"w-{i}") for i in range(4, 8)]))
        slices = ray.get(waiting, timeout=180)
        table = fetch(slices, get=ray.get)
        assert table.column("sample_id").to_pylist() == [f"w-{i}" for i in range(6)]
        assert ray.get(actor.stats.remote())["available"] == 2
    finally:
        _kill(ray, actor)


def test_kill_mid_stream_loses_nothing_and_duplicates_nothing(ray_cluster, tmp_path,
                                                              producer_cls):
    ray = ray_cluster
    actor, cfg = _start(ray, tmp_path, seal_rows=16, seal_age_s=0.02, max_queued_rows=64)
    try:
        producers = [producer_cls.remote(actor, f"p{i}") for i in range(2)]
        runs = [p.run.remote(20, 5) for p in producers]  # 200 rows in all
        taken: list[str] = []
        kills = 0
        deadline = time.time() + 300  # ends a hang; the loop ends when the producers are done
        while time.time() < deadline:
            slices = _take_retrying(ray, actor, 7, 0.2)
            if slices:
                taken += fetch(slices, get=ray.get).column("sample_id").to_pylist()
            if kills < 2 and len(taken) >= 40 + 60 * kills:
                ray.kill(actor, no_restart=False)  # crash; the actor restarts from its WAL
                kills += 1
                _wait_restarted(ray, actor)
            done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
            if len(done) == len(runs) and not slices:
                break
        results = ray.get(runs)
        rest = ray.get(actor.stats.remote())["available"]
        if rest:
            taken += fetch(_take_retrying(ray, actor, rest, 1.0),
                           get=ray.get).column("sample_id").to_pylist()

        acked = [sid for r in results for sid in r["acked"]]
        assert kills == 2
        assert sum(r["retries"] for r in results) >= 1  # the crash did hit an add
        assert len(acked) == len(set(acked)) == 200
        assert len(taken) == len(set(taken)), "a row was delivered twice"
        assert set(acked) <= set(taken), f"lost: {sorted(set(acked) - set(taken))[:5]}"
        assert set(taken) <= set(acked)
        wal = ds.dataset(cfg.path, format="parquet").to_table().column("sample_id").to_pylist()
        assert len(wal) == len(set(wal)) == 200  # retried rows were not written twice
    finally:
        _kill(ray, actor)


def test_slices_of_a_dead_owner_are_read_back_from_the_wal(ray_cluster, tmp_path):
    ray = ray_cluster
    actor, cfg = _start(ray, tmp_path, seal_rows=4, seal_age_s=0.05)
    try:
        ray.get(actor.add.remote([_row(f"o-{i}") for i in range(4)]))
        ray.get(actor.stats.remote())  # a first call done, so rows_taken is 1 after take
        slices = ray.get(actor.take.remote(3))
        ray.kill(actor, no_restart=False)
        _wait_restarted(ray, actor)
        with pytest.raises(ray.exceptions.OwnerDiedError):
            ray.get(slices[0].ref, timeout=20)
        table = fetch_from_wal(cfg.path, slices)
        assert table.column("sample_id").to_pylist() == ["o-0", "o-1", "o-2"]
        # the restarted buffer delivers the three unacknowledged rows again, then the fourth
        assert fetch(_take_retrying(ray, actor, 4, 1.0), get=ray.get).column(
            "sample_id").to_pylist() == ["o-0", "o-1", "o-2", "o-3"]
    finally:
        _kill(ray, actor)


def test_a_lease_never_acknowledged_is_delivered_again(ray_cluster, tmp_path):
    """A trainer that dies between take and update: its lease expires and the rows go to the
    next taker; acknowledged rows are consumed for good, across a restart of the buffer."""
    ray = ray_cluster
    # lease_s 5: the lease must still be open at the stats call after the take, on a loaded
    # machine too
    actor, _ = _start(ray, tmp_path, seal_rows=100, seal_age_s=0.05, lease_s=5.0)
    try:
        ray.get(actor.add.remote([_row(f"l-{i}") for i in range(6)]))
        lost = ray.get(actor.take.remote(4))  # the taker dies: never acknowledged
        assert ray.get(actor.stats.remote())["leased_rows"] == 4
        again = ray.get(actor.take.remote(6, 120.0), timeout=180)  # waits for the expiry
        assert fetch(again, get=ray.get).column("sample_id").to_pylist() == [
            f"l-{i}" for i in range(6)]
        assert ray.get(actor.ack.remote([s.lease for s in lost])) == 0  # expired: nothing
        assert ray.get(actor.ack.remote(sorted({s.lease for s in again}))) == 6
        stats = ray.get(actor.stats.remote())
        assert (stats["leases_expired"], stats["rows_redelivered"], stats["rows_acked"]) == (
            1, 4, 6)
        ray.kill(actor, no_restart=False)
        _wait_restarted(ray, actor)
        assert ray.get(actor.stats.remote())["available"] == 0  # consumed for good
    finally:
        _kill(ray, actor)


def test_stale_rows_are_skipped_through_the_actor(ray_cluster, tmp_path):
    ray = ray_cluster
    actor, _ = _start(ray, tmp_path, seal_rows=100, seal_age_s=0.05, max_staleness=1)
    try:
        rows = [make_row(sample_id=f"v-{i}", kind="rl", source="live", prompt_ids=[1],
                         response_ids=[2], rollout_logprobs=[-0.1], policy_version=i % 4,
                         reward=0.0) for i in range(8)]
        ray.get(actor.add.remote(rows))
        ray.get(actor.set_policy_version.remote(4))  # keep versions 3 and up
        slices = ray.get(actor.take.remote(2, 1.0))
        table = fetch(slices, get=ray.get)
        assert table.column("sample_id").to_pylist() == ["v-3", "v-7"]
        stats = ray.get(actor.stats.remote())
        assert stats["stale_dropped"] == 6 and stats["available"] == 0
    finally:
        _kill(ray, actor)
