"""SessionHub: the Ray actor shell around ``SessionCore``.

The ingress sends every turn record here without waiting (``submit``); sessions are sharded
over ``sessions.num_hubs`` hubs by a hash of the session id, so one session always meets the
same hub. The hub runs judge jobs through the ``VoterPool`` concurrently, turns finished turns
into sample rows, and writes them to the ``SampleBuffer`` — keeping each row until the buffer
has acknowledged it as durable, retrying through buffer restarts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from typing import Any

import ray

from clawray.config import ClawRayConfig
from clawray.judging.voters import VoterPool
from clawray.records import TurnRecord
from clawray.sessions.core import JudgeJob, SessionCore, SessionRules
from clawray.sessions.rows import rows_of

logger = logging.getLogger(__name__)

NAMESPACE = "clawray"


def shard_of(session_id: str, num_hubs: int) -> int:
    return zlib.crc32(session_id.encode()) % num_hubs


@ray.remote(num_cpus=0)
class SessionHub:
    def __init__(self, config: dict[str, Any], shard: int, buffer_name: str,
                 voter_names: list[str]) -> None:
        cfg = ClawRayConfig.from_dict(config)
        self.shard = shard
        self.s = cfg.sessions_cfg
        self.rules = SessionRules.from_config(self.s)
        self.core = SessionCore(self.rules)
        self.buffer = ray.get_actor(buffer_name, namespace=NAMESPACE)
        voters = [ray.get_actor(n, namespace=NAMESPACE) for n in voter_names]
        self.pool = VoterPool(voters, cfg.judge_cfg, self.s.sample_kinds)
        self.outbox: list[dict[str, Any]] = []
        self.outbox_since = 0.0
        self.rows_written = 0
        self.write_failures = 0
        self.judging: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._flush_lock: asyncio.Lock | None = None
        self._metrics = _HubMetrics(shard)

    # ---- inputs (the ingress never waits on these) ----
    async def submit(self, record: dict[str, Any]) -> None:
        self._start()
        self.core.on_record(TurnRecord.from_dict(record), time.time())
        self._pump()

    async def feedback(self, rating: int, text: str | None = None, record_id: str | None = None,
                       session_key: str | None = None, tenant: str | None = None
                       ) -> dict[str, Any]:
        """Feedback for a turn (``record_id``) or a session (its key, ``TurnRecord.session_key``);
        with ``tenant``, only that tenant's turns and sessions match."""
        self._start()
        result = self.core.on_feedback(rating, text, time.time(), record_id=record_id,
                                       session_key=session_key, tenant=tenant)
        self._pump()
        return result

    # ---- admin / tests ----
    async def flush(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Finish in-flight judging, release what is due, and write everything out."""
        self._start()
        deadline = time.monotonic() + timeout_s
        while self.judging and time.monotonic() < deadline:
            await asyncio.wait(set(self.judging), timeout=max(0.0, deadline - time.monotonic()))
        self.core.tick(time.time())
        self._pump()
        await self._write(force=True)
        return self.stats()

    def stats(self) -> dict[str, Any]:
        return {"shard": self.shard, **self.core.stats(), "outbox_rows": len(self.outbox),
                "rows_written": self.rows_written, "write_failures": self.write_failures,
                "judging_tasks": len(self.judging), "voters": dict(self.pool.counters)}

    # ---- internals ----
    def _start(self) -> None:
        if self._loop_task is None:
            self._flush_lock = asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _pump(self) -> None:
        jobs, finished = self.core.drain()
        for job in jobs:
            task = asyncio.get_running_loop().create_task(self._judge(job))
            self.judging.add(task)
            task.add_done_callback(self.judging.discard)
        for fin in finished:
            if not self.outbox:
                self.outbox_since = time.monotonic()
            try:
                self.outbox.extend(rows_of(fin, self.s.sample_kinds, self.rules))
            except Exception:  # a malformed record must not stop the hub; it is logged loudly
                logger.exception("cannot build samples of %s (session %s)",
                                 fin.record.record_id, fin.record.session_id)

    async def _judge(self, job: JudgeJob) -> None:
        verdict = await self.pool.judge(job)
        self.core.on_verdict(job.job_id, verdict, time.time())
        self._pump()

    async def _run(self) -> None:
        period = min(1.0, self.s.flush_interval_s, self.s.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self.core.tick(time.time())
                self._pump()
                await self._write(force=False)
                self._metrics.update(self.core.counters, self.pool, len(self.outbox))
            except Exception:
                logger.exception("session hub %d tick failed", self.shard)

    async def _write(self, force: bool) -> None:
        assert self._flush_lock is not None
        async with self._flush_lock:
            while self.outbox:
                due = time.monotonic() - self.outbox_since >= self.s.flush_interval_s
                if not (force or due or len(self.outbox) >= self.s.flush_rows):
                    return
                rows = self.outbox[: self.s.flush_rows]
                try:
                    await self.buffer.add.remote(rows)
                except Exception as e:  # buffer restarting: keep the rows, retry next tick
                    self.write_failures += 1
                    logger.warning("sample buffer write of %d rows failed (kept, will retry): %s",
                                   len(rows), e)
                    return
                del self.outbox[: len(rows)]
                self.rows_written += len(rows)
                self.outbox_since = time.monotonic()


class _HubMetrics:
    """Ray metrics (Prometheus through the Ray dashboard's metrics export)."""

    def __init__(self, shard: int) -> None:
        from ray.util import metrics

        self.events = metrics.Counter("clawray_session_events_total",
                                      description="Session hub events (turns, judged, ...).",
                                      tag_keys=("shard", "event"))
        self.votes = metrics.Counter("clawray_judge_calls_total",
                                     description="Judge calls and their outcomes.",
                                     tag_keys=("shard", "event"))
        self.outbox = metrics.Gauge("clawray_session_outbox_rows",
                                    description="Sample rows waiting for the buffer.",
                                    tag_keys=("shard",))
        self.latency = metrics.Histogram("clawray_judge_latency_s",
                                         description="Seconds to judge one turn.",
                                         boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60],
                                         tag_keys=("shard",))
        self.shard = str(shard)
        self.seen: dict[str, int] = {}

    def update(self, counters: dict[str, int], pool: VoterPool, outbox: int) -> None:
        for source, metric in ((counters, self.events), (pool.counters, self.votes)):
            for name, value in source.items():
                key = f"{id(metric)}:{name}"
                delta = value - self.seen.get(key, 0)
                if delta > 0:
                    metric.inc(delta, tags={"shard": self.shard, "event": name})
                self.seen[key] = value
        self.outbox.set(outbox, tags={"shard": self.shard})
        for value in pool.latencies:
            self.latency.observe(value, tags={"shard": self.shard})
        pool.latencies.clear()
