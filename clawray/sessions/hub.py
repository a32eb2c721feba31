"""SessionHub: the Ray actor shell around ``SessionCore``.

The ingress sends every turn record here without waiting (``submit``); sessions are sharded
over ``sessions.num_hubs`` hubs by a hash of the session id, so one session always meets the
same hub. The hub runs judge jobs through the ``VoterPool`` concurrently, turns finished turns
into sample rows, and writes them to the ``SampleBuffer`` — keeping each row until the buffer
has acknowledged it as durable, retrying through buffer restarts. Its pending turns are
journaled (``journal.py``): a hub that crashed resumes them on its first call after the
restart, so every served main turn still becomes its row.
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
from clawray.names import NAMESPACE
from clawray.records import TurnRecord
from clawray.sessions.core import JudgeJob, SessionCore, SessionRules
from clawray.sessions.journal import HubJournal
from clawray.sessions.rows import rows_of

logger = logging.getLogger(__name__)


def shard_of(session_id: str, num_hubs: int) -> int:
    return zlib.crc32(session_id.encode()) % num_hubs


@ray.remote(num_cpus=0)
class SessionHub:
    def __init__(self, config: dict[str, Any], shard: int, buffer_name: str,
                 voter_names: list[str], journal_path: str | None = None) -> None:
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
        self.journal = HubJournal(journal_path) if journal_path else None
        self.rows_left: dict[str, int] = {}  # record id → its rows not yet durable
        self.replayed = 0

    # ---- inputs (the ingress never waits on these) ----
    async def submit(self, record: dict[str, Any]) -> None:
        self._start()
        now = time.time()
        rec = TurnRecord.from_dict(record)
        journaled = self.journal is not None and (rec.turn_type == "main" or rec.session_done)
        if journaled:
            self.journal.record(record, now)  # before acting on it
        self.core.on_record(rec, now)
        if journaled and rec.turn_type != "main":  # a side turn that ended its session
            self.journal.done([rec.record_id])
        self._pump()

    async def feedback(self, rating: int, text: str | None = None, record_id: str | None = None,
                       session_key: str | None = None, tenant: str | None = None
                       ) -> dict[str, Any]:
        """Feedback for a turn (``record_id``) or a session (its key, ``TurnRecord.session_key``);
        with ``tenant``, only that tenant's turns and sessions match."""
        self._start()
        now = time.time()
        if self.journal is not None:
            self.journal.feedback(now, rating=rating, text=text, record_id=record_id,
                                  session_key=session_key, tenant=tenant)
        result = self.core.on_feedback(rating, text, now, record_id=record_id,
                                       session_key=session_key, tenant=tenant)
        self._pump()
        return result

    def _replay(self) -> None:
        """Resume the pending turns of a previous life of this hub from its journal."""
        if self.journal is None:
            return
        for entry in self.journal.replay():
            if "record" in entry:
                rec = TurnRecord.from_dict(entry["record"])
                self.core.on_record(rec, entry["t"])
                self.replayed += 1
                if rec.turn_type != "main":
                    self.journal.done([rec.record_id])
            else:
                call = dict(entry["feedback"])
                self.core.on_feedback(call.pop("rating"), call.pop("text"), entry["t"], **call)
        if self.replayed:
            logger.warning("session hub %d resumed %d pending turns from its journal %s",
                           self.shard, self.replayed, self.journal.path)
        # no tick here: the call that woke the hub (often the very next message of a replayed
        # turn) is handled first, and the downtime does not count toward the idle timeout
        self.core.resumed(time.time())

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
        if self.journal is not None:
            self.journal.sync()
        return self._stats()

    async def stats(self) -> dict[str, Any]:
        """Counters; the first call after a restart also resumes the journal."""
        self._start()
        return self._stats()

    def _stats(self) -> dict[str, Any]:
        return {"shard": self.shard, **self.core.stats(), "outbox_rows": len(self.outbox),
                "rows_written": self.rows_written, "write_failures": self.write_failures,
                "replayed": self.replayed,
                "journaled": len(self.journal.live) if self.journal is not None else None,
                "judging_tasks": len(self.judging), "judge_load": self.pool.load(),
                "voters": dict(self.pool.counters), "judge_control": self.pool.cfg.control}

    # ---- internals ----
    def _start(self) -> None:
        if self._loop_task is None:
            self._flush_lock = asyncio.Lock()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
            self._replay()
            self._pump()

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
                rows = rows_of(fin, self.s.sample_kinds, self.rules)
            except Exception:  # a malformed record must not stop the hub; it is logged loudly
                logger.exception("cannot build samples of %s (session %s)",
                                 fin.record.record_id, fin.record.session_id)
                rows = []
            if rows:
                self.outbox.extend(rows)
                self.rows_left[fin.record.record_id] = len(rows)
            elif self.journal is not None:
                self.journal.done([fin.record.record_id])

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
                if self.journal is not None:
                    self.journal.sync()
                self._metrics.update(self.core.counters, self.pool, len(self.outbox),
                                    len(self.core.sessions))
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
                self._durable(rows)

    def _durable(self, rows: list[dict[str, Any]]) -> None:
        """The buffer acknowledged ``rows``: turns whose rows are all durable are done."""
        done = []
        for row in rows:
            rid = row["sample_id"].rsplit("/", 1)[0]
            left = self.rows_left.get(rid, 1) - 1
            if left > 0:
                self.rows_left[rid] = left
            else:
                self.rows_left.pop(rid, None)
                done.append(rid)
        if self.journal is not None:
            self.journal.done(done)


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
        self.open = metrics.Gauge("clawray_sessions_open",
                                  description="Sessions open (a turn awaits its next state or "
                                  "the session its end).", tag_keys=("shard",))
        self.outbox = metrics.Gauge("clawray_session_outbox_rows",
                                    description="Sample rows waiting for the buffer.",
                                    tag_keys=("shard",))
        self.backlog = metrics.Gauge("clawray_judge_backlog_turns",
                                     description="Turns being judged (running) or waiting for "
                                     "a judge slot (waiting).", tag_keys=("shard", "state"))
        self.latency = metrics.Histogram("clawray_judge_latency_s",
                                         description="Seconds to judge one turn.",
                                         boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60],
                                         tag_keys=("shard",))
        self.shard = str(shard)
        self.seen: dict[str, int] = {}

    def update(self, counters: dict[str, int], pool: VoterPool, outbox: int,
               sessions_open: int) -> None:
        for source, metric in ((counters, self.events), (pool.counters, self.votes)):
            for name, value in source.items():
                key = f"{id(metric)}:{name}"
                delta = value - self.seen.get(key, 0)
                if delta > 0:
                    metric.inc(delta, tags={"shard": self.shard, "event": name})
                self.seen[key] = value
        self.outbox.set(outbox, tags={"shard": self.shard})
        self.open.set(sessions_open, tags={"shard": self.shard})
        for state, value in pool.load().items():
            self.backlog.set(value, tags={"shard": self.shard, "state": state})
        for value in pool.latencies:
            self.latency.observe(value, tags={"shard": self.shard})
        pool.latencies.clear()
