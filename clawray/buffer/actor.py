"""SampleBuffer: the Ray actor around ``SampleBufferCore`` (the logic lives in buffer.py).

Durability contract: ``add`` returns only after the segment holding its rows was written and
fsync'd, so an acknowledged row survives a crash of the actor, and a retried ``add`` of an
unacknowledged one is safe (duplicates by ``sample_id`` are dropped). A background task seals
the open batch by size or age; disk writes run in a worker thread so ``take`` stays
responsive. The actor restarts forever (``max_restarts=-1``) and recovers from its WAL folder.

Batches are ``ray.put`` by this actor, which owns them: if it dies, slices handed out before
are gone from the object store; ``buffer.fetch_from_wal`` reads the same rows from disk.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import pyarrow as pa
import ray

from clawray.buffer.core import SampleBufferCore, SealJob, Slice, hold_as_writer
from clawray.config import BufferConfig, PartPlacement
from clawray.names import NAMESPACE
from clawray.placement import actor_options

logger = logging.getLogger(__name__)


class _NoMetric:
    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        pass

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        pass


def _metric(kind: str, name: str, description: str, buffer: str) -> Any:
    """A Ray metric tagged with the buffer's name; a no-op if metrics cannot be created."""
    try:
        from ray.util import metrics

        m = getattr(metrics, kind)(name, description=description, tag_keys=("buffer",))
        m.set_default_tags({"buffer": buffer})
        return m
    except Exception:  # noqa: BLE001 - metrics must never take the buffer down
        logger.warning("metric %s unavailable; continuing without it", name, exc_info=True)
        return _NoMetric()


@ray.remote
class SampleBuffer:
    def __init__(self, cfg: dict[str, Any], name: str = "sample-buffer") -> None:
        c = BufferConfig(**cfg)
        self._writer = hold_as_writer(c.path)  # offline edits refuse while this app runs
        self._core = SampleBufferCore(c.path, seal_rows=c.seal_rows, seal_age_s=c.seal_age_s,
                                      max_queued_rows=c.max_queued_rows,
                                      max_staleness=c.max_staleness, put=ray.put, get=ray.get,
                                      lease_s=c.lease_s, retain_days=c.retain_days,
                                      retain_gb=c.retain_gb)
        self._tick_s = min(c.seal_age_s / 4, 0.05)
        self._seal_lock: asyncio.Lock | None = None
        self._sealed: dict[int, asyncio.Future] = {}  # generation → seq once durable
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Condition | None = None
        self._sealer: asyncio.Task | None = None
        self._m_sealed = _metric("Counter", "clawray_samples_sealed", "Rows sealed to the WAL",
                                 name)
        self._m_consumed = _metric("Counter", "clawray_samples_consumed", "Rows taken", name)
        self._m_queue = _metric("Gauge", "clawray_buffer_queue_rows",
                                "Rows waiting to be taken (memory and disk)", name)
        self._m_leased = _metric("Gauge", "clawray_buffer_leased_rows",
                                 "Rows taken by a trainer and not yet acknowledged", name)
        self._m_dups = _metric("Counter", "clawray_buffer_duplicates",
                               "Rows dropped as duplicates of a sample_id", name)

    def _gauge_rows(self) -> None:
        """The row gauges: waiting to be taken, and taken but not yet acknowledged."""
        self._m_queue.set(self._core.available())
        self._m_leased.set(self._core.leased_rows())

    def _start(self) -> None:
        """Create the loop-bound parts on first use (the event loop runs the methods)."""
        if self._sealer is None:
            self._seal_lock = asyncio.Lock()
            self._wake = asyncio.Event()
            self._changed = asyncio.Condition()
            self._sealer = asyncio.get_running_loop().create_task(self._seal_loop())

    def _future(self, gen: int) -> asyncio.Future:
        if gen not in self._sealed:
            self._sealed[gen] = asyncio.get_running_loop().create_future()
        return self._sealed[gen]

    async def _seal_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if self._core.should_seal():
                await self._seal_now()
            if self._core.expire():  # a taker died with its lease: the rows are back
                self._gauge_rows()
                async with self._changed:
                    self._changed.notify_all()

    async def _seal_now(self) -> int | None:
        async with self._seal_lock:
            job: SealJob | None = self._core.begin_seal()
            if job is None:
                return None
            fut = self._future(job.gen)
            try:
                await asyncio.to_thread(self._core.write_segment, job)
            except Exception as exc:  # noqa: BLE001 - handed to every waiting add
                self._core.abort_seal(job)
                self._sealed.pop(job.gen, None)
                if not fut.done():
                    fut.set_exception(exc)
                return None
            self._core.finish_seal(job)
            self._sealed.pop(job.gen, None)
            if not fut.done():
                fut.set_result(job.seq)
            self._m_sealed.inc(job.batch.num_rows)
            self._gauge_rows()
            async with self._changed:
                self._changed.notify_all()
            return job.seq

    async def add(self, rows: Sequence[dict[str, Any]] | pa.RecordBatch) -> list[str]:
        """Add rows; returns the accepted sample_ids once they are durable on disk."""
        self._start()
        dups = self._core.counters["duplicates"]
        accepted = self._core.add(rows)
        if self._core.counters["duplicates"] > dups:
            self._m_dups.inc(self._core.counters["duplicates"] - dups)
        ids = (rows.column("sample_id").to_pylist() if isinstance(rows, pa.RecordBatch)
               else [r["sample_id"] for r in rows])
        gens = self._core.pending_generations(ids)  # ours, or the same ids added by another call
        if self._core.open_rows >= self._core.seal_rows:
            self._wake.set()
        if gens:
            await asyncio.gather(*(asyncio.shield(self._future(g)) for g in gens))
        return accepted

    async def take(self, n: int, timeout_s: float = 0.0, min_n: int | None = None) -> list[Slice]:
        """Exactly ``n`` rows as slices of batch refs, waiting up to ``timeout_s`` for them;
        [] if there are not enough. With ``min_n``, at the deadline take what is there if that
        is at least ``min_n`` rows. The slices carry their lease (``buffer.lease_s``): ``ack``
        it once the rows are trained, or they are delivered again when it expires."""
        self._start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            slices = self._core.take(n, checkpoint=False)
            left = deadline - loop.time()
            if not slices and left <= 0 and min_n is not None:
                have = self._core.available()  # fewer than n, or take() would have succeeded
                if have >= max(min_n, 1):
                    n = have
                    slices = self._core.take(n, checkpoint=False)
            if slices:
                await asyncio.to_thread(self._core.save_checkpoint)
                self._m_consumed.inc(n)
                self._gauge_rows()
                return slices
            if left <= 0:
                return []
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass

    async def ack(self, leases: Sequence[int]) -> int:
        """The rows of ``leases`` were trained: consumed (checkpointed before return)."""
        self._start()
        rows = self._core.ack(list(leases), checkpoint=False)
        await asyncio.to_thread(self._core.save_checkpoint)
        self._gauge_rows()
        return rows

    async def ack_rows(self, lease: int, trained: Sequence[bool]) -> tuple[int, int]:
        """Some rows of ``lease`` were trained (per-user training): those are consumed, the
        others delivered again at once; (consumed, returned)."""
        self._start()
        out = self._core.ack_rows(lease, list(trained), checkpoint=False)
        await asyncio.to_thread(self._core.save_checkpoint)
        self._gauge_rows()
        if out[1]:
            async with self._changed:
                self._changed.notify_all()
        return out

    async def release(self, leases: Sequence[int]) -> int:
        """Rows of ``leases`` given back untrained: delivered again at once."""
        self._start()
        rows = self._core.release(list(leases))
        self._gauge_rows()
        if rows:
            async with self._changed:
                self._changed.notify_all()
        return rows

    async def set_policy_version(self, version: int) -> None:
        self._core.set_policy_version(version)

    async def flush(self) -> int | None:
        """Seal the open rows now; returns the segment's seq (None if nothing was open)."""
        self._start()
        return await self._seal_now()

    async def stats(self) -> dict[str, Any]:
        return self._core.stats()

    async def forget(self, policy_user: str) -> dict[str, int]:
        """``SampleBufferCore.forget``: every row of ``policy_user`` leaves the log (an
        operator's call, ``clawray users delete``). Runs with no seal in flight, on the event
        loop (the core is not shared with a thread)."""
        self._start()
        async with self._seal_lock:
            out = self._core.forget(policy_user)
        self._gauge_rows()
        return out

    async def ping(self) -> str:
        return "pong"


def start_sample_buffer(cfg: BufferConfig, name: str, namespace: str = NAMESPACE,
                        placement: PartPlacement | None = None) -> Any:
    """The named, detached SampleBuffer (created if missing); it restarts after a crash and
    recovers from ``cfg.path``. In-flight calls fail on a crash (no retries): callers retry.
    ``placement`` (``placement.buffer``): the node it must run on, whose disk holds the path."""
    return SampleBuffer.options(
        name=name, namespace=namespace, get_if_exists=True, lifetime="detached",
        max_restarts=-1, max_task_retries=0, num_cpus=0,
        **(actor_options(placement) if placement is not None else {}),
    ).remote(cfg.model_dump(), name)
