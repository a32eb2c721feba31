"""SampleBufferCore: the durable sample store behind the SampleBuffer actor (no Ray here).

Rows go into an open batch; ``seal`` writes it as one Parquet segment of the write-ahead log
(temp file, fsync, rename, fsync of the folder) and only then queues it. The queue holds sealed
batches as objects made by ``put`` (``ray.put`` in the actor, identity in tests), bounded by
``max_queued_rows``: newer segments wait on disk and are loaded in order when room frees up.

``take(n)`` hands out slices covering exactly n rows, oldest first, under a lease: the rows
are consumed only when the taker acknowledges them (``ack``, after the update that used them);
a lease not acknowledged within ``lease_s`` expires and its rows go back to the front of the
queue, so a trainer that dies between take and update loses nothing (the learner side drops
rows it already trained by ``sample_id``: exactly-once in effect). The checkpoint persists the
consumed position ``{"seq": s, "offset": k}`` (every row before row k of segment s, in WAL
order, is consumed) plus the rows settled beyond it (acknowledged, or dropped as stale). A new
core on the same folder re-queues every unsettled row exactly once — leased ones included, as
a lease does not outlive the core — and rebuilds the duplicate filter from the last segments,
so a producer that retries an unacknowledged ``add`` creates no duplicates. With
``lease_s=None`` taken rows are consumed at once (the pre-lease behaviour).

Retention: segments wholly before the consumed position are deleted once older than
``retain_days`` or beyond ``retain_gb`` of consumed segments (oldest first); an unconsumed
segment is never deleted.

The folder is an ordinary Parquet dataset (``pyarrow.dataset``, ``pandas.read_parquet``):
the checkpoint is ``_consumed.json`` and temp files start with ``.``, both of which dataset
readers skip.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from clawray.files import fsync_dir
from clawray.files import write_atomic as _write_atomic
from clawray.samples import (SCHEMA, SampleValidationError, concat, policy_user_of, redact,
                             rows_to_batch, validate_batch)

logger = logging.getLogger(__name__)

CHECKPOINT = "_consumed.json"
_SEGMENT = re.compile(r"^seg-(\d{12})\.parquet$")


# A running app's buffer holds this file's shared lock (``hold_as_writer``) for its life; an
# offline edit of the log (``forget_offline``) needs the exclusive one, so it never races an app.
WRITERS_LOCK = ".writers.lock"


class BufferBusyError(RuntimeError):
    """The sample log is open by a running app; an offline edit would race it."""


def hold_as_writer(path: str | Path) -> Any:
    """Mark the log folder as open by a running buffer until the returned file is closed (or
    the process ends): offline edits (``forget_offline``) refuse while it is. A shared lock:
    several holders at once are allowed."""
    import fcntl

    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    f = open(folder / WRITERS_LOCK, "a+")
    fcntl.flock(f, fcntl.LOCK_SH)
    return f


def forget_offline(path: str | Path, policy_user: str) -> dict[str, int]:
    """``SampleBufferCore.forget`` on a log no app has open (the app stopped); raises
    BufferBusyError, changing nothing, while one does (``hold_as_writer``)."""
    import fcntl

    folder = Path(path).expanduser()
    with open(folder / WRITERS_LOCK, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BufferBusyError(
                f"the sample log at {str(folder)!r} is open by a running app: forget through "
                "the app (run this where its Ray cluster is reachable), or stop it first"
            ) from None
        try:
            return SampleBufferCore(folder).forget(policy_user)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _identity(x: Any) -> Any:
    return x


def pc_equal(column: Any, value: str) -> np.ndarray:
    """``column == value`` as booleans, null rows false."""
    return pc.fill_null(pc.equal(column, value), False).to_numpy(zero_copy_only=False)


def segment_name(seq: int) -> str:
    return f"seg-{seq:012d}.parquet"


@dataclass
class Slice:
    """Rows ``[offset, offset + length)`` of the batch object ``ref``, from WAL segment ``seq``.

    ``offset`` indexes the object, which is the whole segment unless a staleness filter made a
    smaller copy; ``rows`` then holds the segment row index of each of this slice's rows (for
    reading the same rows back from the WAL). ``lease``: the lease to ``ack`` once trained."""

    seq: int
    ref: Any
    offset: int
    length: int
    rows: list[int] | None = None
    lease: int | None = None


@dataclass
class _Lease:
    deadline: float
    parts: list[_Queued]  # what goes back to the queue on expiry, oldest first
    rows: list[tuple[int, np.ndarray]]  # (seq, segment rows) settled by the ack


@dataclass
class SealJob:
    """An open batch detached for sealing; ``write_segment`` touches nothing else."""

    seq: int
    gen: int
    batch: pa.RecordBatch
    path: Path
    ids: list[str]
    nbytes: int = 0
    write_s: float = 0.0


@dataclass
class _Queued:
    seq: int
    ref: Any
    num_rows: int  # rows of the object
    offset: int  # object rows already taken
    versions: np.ndarray  # policy_version per object row
    origin: np.ndarray | None = None  # segment row of each object row (None: the same)
    seg_rows: int = 0


@dataclass
class _OnDisk:
    seq: int
    seg_rows: int
    start: int  # rows before this were consumed before a restart
    versions: np.ndarray = field(repr=False)
    keep: np.ndarray | None = field(default=None, repr=False)  # rows to deliver (None: all)

    @property
    def pending(self) -> int:
        return self.seg_rows - self.start if self.keep is None else len(self.keep)

    def pending_versions(self) -> np.ndarray:
        return self.versions[self.start:] if self.keep is None else self.versions[self.keep]


def read_segment(path: str | Path, seq: int) -> pa.RecordBatch:
    """One WAL segment as a single record batch."""
    table = pq.read_table(Path(path) / segment_name(seq), schema=SCHEMA)
    table = table.replace_schema_metadata(SCHEMA.metadata)
    batches = table.combine_chunks().to_batches()
    return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=SCHEMA)


def fetch(slices: Sequence[Slice], get: Callable[[Any], Any] = _identity) -> pa.Table:
    """The rows of ``slices`` as one table, zero-copy (each slice is a view of its batch)."""
    cache: dict[Any, pa.RecordBatch] = {}
    parts = []
    for s in slices:
        key = s.ref.hex() if hasattr(s.ref, "hex") else id(s.ref)  # ObjectRefs by object id
        if key not in cache:
            cache[key] = get(s.ref)
        parts.append(cache[key].slice(s.offset, s.length))
    return concat(parts)


def fetch_from_wal(path: str | Path, slices: Sequence[Slice]) -> pa.Table:
    """The rows of ``slices`` read back from the WAL (when the objects are gone, e.g. their
    owner died): a copy from disk, same rows as ``fetch``."""
    parts = []
    for s in slices:
        batch = read_segment(path, s.seq)
        if s.rows is None:
            parts.append(batch.slice(s.offset, s.length))
        else:
            parts.append(batch.take(pa.array(s.rows, pa.int64())))
    return concat(parts)


class SampleBufferCore:
    """Open batch → sealed Parquet segment → bounded queue of batch objects → ``take``."""

    def __init__(self, path: str | Path, seal_rows: int = 256, seal_age_s: float = 1.0,
                 max_queued_rows: int = 65_536, max_staleness: int | None = None,
                 put: Callable[[pa.RecordBatch], Any] = _identity,
                 get: Callable[[Any], pa.RecordBatch] = _identity,
                 dedup_segments: int = 64, compression: str = "zstd",
                 clock: Callable[[], float] = time.monotonic, lease_s: float | None = None,
                 retain_days: float | None = None, retain_gb: float | None = None) -> None:
        self.path = Path(path).expanduser()
        self.path.mkdir(parents=True, exist_ok=True)
        self.seal_rows, self.seal_age_s = seal_rows, seal_age_s
        self.max_queued_rows, self.max_staleness = max_queued_rows, max_staleness
        self._put, self._get, self._clock = put, get, clock
        self.compression = compression
        self.policy_version: int | None = None

        self._open: list[pa.RecordBatch] = []
        self._open_rows = 0
        self._open_since: float | None = None
        self._gen = 0  # generation of the open batch; a SealJob carries it
        self._pending_ids: dict[str, int] = {}  # open or being sealed → generation
        self._recent: deque[list[str]] = deque(maxlen=dedup_segments)
        self._recent_ids: dict[str, int] = {}  # id → how many of the recent segments hold it

        self._queue: deque[_Queued] = deque()
        self._disk: deque[_OnDisk] = deque()
        self._segments: dict[int, int] = {}  # seq → rows, every segment in the folder
        self._next_seq = 0
        self._consumed = (0, 0)
        self.lease_s, self.retain_days, self.retain_gb = lease_s, retain_days, retain_gb
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = 0
        self._settled: dict[int, np.ndarray] = {}  # seq → settled rows (beyond the position)
        self._ckpt_lock = threading.Lock()
        self._ckpt_written: Any = None
        self.counters = dict.fromkeys(
            ("rows_added", "rows_sealed", "rows_taken", "duplicates", "stale_dropped",
             "wal_bytes", "rows_acked", "leases_expired", "rows_redelivered",
             "segments_deleted"), 0)
        self.wal_write_s = 0.0
        self._recover()

    # ---------------------------------------------------------------- recovery
    def _recover(self) -> None:
        for p in self.path.iterdir():
            if p.name.startswith(".") and p.name.endswith(".tmp"):
                logger.warning("removing %s: a write that never completed (not acknowledged)", p)
                p.unlink()
        seqs = sorted(int(m.group(1)) for p in self.path.iterdir()
                      if (m := _SEGMENT.match(p.name)))
        for seq in seqs:
            meta = pq.ParquetFile(self.path / segment_name(seq)).metadata
            self._segments[seq] = meta.num_rows
            self.counters["wal_bytes"] += (self.path / segment_name(seq)).stat().st_size
        self._next_seq = seqs[-1] + 1 if seqs else 0
        ckpt = self.path / CHECKPOINT
        if ckpt.exists():
            data = json.loads(ckpt.read_text())
            self._consumed = (int(data["seq"]), int(data["offset"]))
            for key, ranges in data.get("settled", {}).items():
                seq = int(key)
                if seq in self._segments:
                    mask = np.zeros(self._segments[seq], dtype=bool)
                    for a, b in ranges:
                        mask[a:b] = True
                    self._settled[seq] = mask
            self._ckpt_written = self._checkpoint_data()
        cseq, coff = self._consumed
        for seq in seqs:
            start = coff if seq == cseq else 0
            if seq < cseq or start >= self._segments[seq]:
                continue
            versions = pq.read_table(self.path / segment_name(seq),
                                     columns=["policy_version"]).column(0).to_numpy()
            keep = None
            if seq in self._settled:
                keep = np.flatnonzero(~self._settled[seq][start:]) + start
                if not len(keep):
                    continue
            self._disk.append(_OnDisk(seq, self._segments[seq], start, versions, keep))
        for seq in seqs[-(self._recent.maxlen or 0):] if self._recent.maxlen else []:
            ids = pq.read_table(self.path / segment_name(seq), columns=["sample_id"])
            self._remember(ids.column(0).to_pylist())
        self._refill()
        if seqs:
            logger.info("recovered %d segments from %s: %d rows to deliver after %s",
                        len(seqs), self.path, self.available(), self._consumed)
        self._advance()

    def _remember(self, ids: list[str]) -> None:
        if not self._recent.maxlen:
            return
        if len(self._recent) == self._recent.maxlen:
            for sid in self._recent[0]:
                if self._recent_ids[sid] == 1:
                    del self._recent_ids[sid]
                else:
                    self._recent_ids[sid] -= 1
        self._recent.append(ids)
        for sid in ids:
            self._recent_ids[sid] = self._recent_ids.get(sid, 0) + 1

    # ---------------------------------------------------------------- adding and sealing
    def add(self, rows: Sequence[dict[str, Any]] | pa.RecordBatch,
            now: float | None = None) -> list[str]:
        """Validate rows and put the new ones in the open batch; returns the accepted ids.
        Ids already open, being sealed or in the last segments are dropped (a retry)."""
        if isinstance(rows, pa.RecordBatch):
            validate_batch(rows)
            batch = rows
        else:
            batch = rows_to_batch(rows)
        ids = batch.column("sample_id").to_pylist()
        keep, accepted, seen = [], [], set()
        for i, sid in enumerate(ids):
            if sid in self._pending_ids or sid in self._recent_ids or sid in seen:
                self.counters["duplicates"] += 1
                continue
            seen.add(sid)
            keep.append(i)
            accepted.append(sid)
        if not accepted:
            return []
        if len(keep) < len(ids):
            batch = batch.take(pa.array(keep))
        self._open.append(batch)
        self._open_rows += batch.num_rows
        if self._open_since is None:
            self._open_since = self._clock() if now is None else now
        for sid in accepted:
            self._pending_ids[sid] = self._gen
        self.counters["rows_added"] += len(accepted)
        return accepted

    def pending_generations(self, ids: Sequence[str]) -> set[int]:
        """Generations (seal jobs) that still hold any of ``ids`` before they are durable."""
        return {g for sid in ids if (g := self._pending_ids.get(sid)) is not None}

    @property
    def open_rows(self) -> int:
        return self._open_rows

    def should_seal(self, now: float | None = None) -> bool:
        if not self._open_rows:
            return False
        if self._open_rows >= self.seal_rows:
            return True
        now = self._clock() if now is None else now
        return now - (self._open_since or now) >= self.seal_age_s

    def seal(self) -> int | None:
        """Write the open rows as one durable segment and queue them; returns its seq."""
        job = self.begin_seal()
        if job is None:
            return None
        try:
            self.write_segment(job)
        except BaseException:
            self.abort_seal(job)
            raise
        return self.finish_seal(job)

    def begin_seal(self) -> SealJob | None:
        """Detach the open batch (new adds start the next one); None when nothing is open."""
        if not self._open_rows:
            return None
        table = pa.Table.from_batches(self._open, schema=SCHEMA).combine_chunks()
        batch = table.to_batches()[0]
        ids = batch.column("sample_id").to_pylist()
        job = SealJob(self._next_seq, self._gen, batch, self.path / segment_name(self._next_seq),
                      ids)
        self._next_seq += 1
        self._gen += 1
        self._open, self._open_rows, self._open_since = [], 0, None
        return job

    def write_segment(self, job: SealJob) -> None:
        """The blocking part of a seal (safe in a worker thread: touches only ``job``)."""
        t0 = time.perf_counter()
        table = pa.Table.from_batches([job.batch])
        job.nbytes = _write_atomic(
            job.path, lambda f: pq.write_table(table, f, compression=self.compression))
        job.write_s = time.perf_counter() - t0

    def finish_seal(self, job: SealJob) -> int:
        """Count a written segment as durable and queue it (or leave it on disk if full)."""
        for sid in job.ids:
            self._pending_ids.pop(sid, None)
        self._remember(job.ids)
        n = job.batch.num_rows
        self._segments[job.seq] = n
        self.counters["rows_sealed"] += n
        self.counters["wal_bytes"] += job.nbytes
        self.wal_write_s += job.write_s
        versions = job.batch.column("policy_version").to_numpy()
        if not self._disk and (not self._queue or self._held_rows() + n <= self.max_queued_rows):
            self._queue.append(_Queued(job.seq, self._put(job.batch), n, 0, versions,
                                       seg_rows=n))
        else:
            self._disk.append(_OnDisk(job.seq, n, 0, versions))
        return job.seq

    def abort_seal(self, job: SealJob) -> None:
        """Forget a seal whose write failed: its rows were never acknowledged, retries welcome
        (``write_atomic`` has removed its temp file)."""
        for sid in job.ids:
            self._pending_ids.pop(sid, None)
        logger.error("sealing segment %d (%d rows) failed; its rows were not acknowledged",
                     job.seq, job.batch.num_rows)

    # ---------------------------------------------------------------- memory bound
    def _held_rows(self) -> int:
        return sum(q.num_rows for q in self._queue)

    def _load(self) -> None:
        d = self._disk.popleft()
        batch = read_segment(self.path, d.seq)
        if d.keep is None:
            self._queue.append(_Queued(d.seq, self._put(batch), d.seg_rows, d.start, d.versions,
                                       seg_rows=d.seg_rows))
        else:
            self._queue.append(_Queued(d.seq, self._put(batch.take(pa.array(d.keep))),
                                       len(d.keep), 0, d.versions[d.keep], origin=d.keep,
                                       seg_rows=d.seg_rows))

    def _refill(self) -> None:
        while self._disk and (not self._queue or
                              self._held_rows() + self._disk[0].pending <= self.max_queued_rows):
            self._load()

    # ---------------------------------------------------------------- staleness
    def set_policy_version(self, version: int) -> None:
        self.policy_version = version

    def _min_version(self) -> int | None:
        if self.max_staleness is None or self.policy_version is None:
            return None
        return self.policy_version - self.max_staleness

    def _fresh(self, versions: np.ndarray, vmin: int | None) -> int:
        return len(versions) if vmin is None else int(np.count_nonzero(versions >= vmin))

    def _drop_stale(self, q: _Queued, vmin: int) -> None:
        """Replace the untaken part of ``q`` by its fresh rows (a copy through ``put``)."""
        rest = q.versions[q.offset:q.num_rows]
        keep = np.flatnonzero(rest >= vmin)
        if len(keep) == len(rest):
            return
        self.counters["stale_dropped"] += len(rest) - len(keep)
        rows = (q.origin if q.origin is not None else np.arange(q.num_rows))[q.offset:q.num_rows]
        self._settle(q.seq, rows[np.flatnonzero(rest < vmin)])  # dropped: consumed, untrained
        origin = rows[keep]
        if len(keep):
            batch = self._get(q.ref).slice(q.offset).take(pa.array(keep))
            q.ref = self._put(batch)
        q.versions, q.origin = rest[keep], origin
        q.num_rows, q.offset = len(keep), 0

    # ---------------------------------------------------------------- taking
    def available(self) -> int:
        """Rows a ``take`` can hand out now (fresh rows in memory and waiting on disk)."""
        vmin = self._min_version()
        return (sum(self._fresh(q.versions[q.offset:q.num_rows], vmin) for q in self._queue)
                + sum(self._fresh(d.pending_versions(), vmin) for d in self._disk))

    def take(self, n: int, checkpoint: bool = True, now: float | None = None) -> list[Slice]:
        """Slices covering exactly ``n`` rows, oldest first; [] when fewer are available.

        A batch is split when needed and its surplus stays for the next call. Segments are
        loaded from disk beyond ``max_queued_rows`` if that is what ``n`` rows need. With
        leases (``lease_s``) every slice carries the lease to ``ack``; without, the rows are
        consumed now. With ``checkpoint=False`` the caller must call ``save_checkpoint`` (the
        actor does it off the event loop)."""
        now = self._clock() if now is None else now
        self.expire(now)
        if n <= 0 or self.available() < n:
            return []
        vmin = self._min_version()
        out: list[Slice] = []
        parts: list[_Queued] = []
        taken: list[tuple[int, np.ndarray]] = []
        lease = None
        if self.lease_s is not None:
            self._lease_ids += 1
            lease = self._lease_ids
        need = n
        while need:
            if not self._queue:
                self._load()
            q = self._queue[0]
            if vmin is not None:
                self._drop_stale(q, vmin)
            k = min(need, q.num_rows - q.offset)
            if k:
                rows = (np.arange(q.offset, q.offset + k) if q.origin is None
                        else q.origin[q.offset:q.offset + k])
                out.append(Slice(q.seq, q.ref, q.offset, k,
                                 None if q.origin is None else rows.tolist(), lease))
                parts.append(_Queued(q.seq, q.ref, q.offset + k, q.offset, q.versions,
                                     q.origin, q.seg_rows))
                taken.append((q.seq, rows))
                q.offset += k
                need -= k
            if q.offset >= q.num_rows:
                self._queue.popleft()
        self.counters["rows_taken"] += n
        if lease is None:
            for seq, rows in taken:
                self._settle(seq, rows)
        else:
            self._leases[lease] = _Lease(now + self.lease_s, parts, taken)
        self._refill()
        if checkpoint:
            self.save_checkpoint()
        return out

    def ack(self, leases: Sequence[int], checkpoint: bool = True) -> int:
        """The taker trained these leases' rows: they are consumed. Returns the rows settled;
        an unknown (expired, or handed out before a restart) lease settles nothing — its rows
        were or will be delivered again, and the learner drops repeats by ``sample_id``."""
        rows = 0
        for lease_id in leases:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                continue
            for seq, segment_rows in lease.rows:
                self._settle(seq, segment_rows)
                rows += len(segment_rows)
        self.counters["rows_acked"] += rows
        self._advance()
        if checkpoint:
            self.save_checkpoint()
        return rows

    def ack_rows(self, lease_id: int, trained: Sequence[bool], checkpoint: bool = True
                 ) -> tuple[int, int]:
        """The taker trained only some of a lease's rows (per-user training: users not trained
        this time): ``trained`` has one flag per row of the lease's slices, in their order.
        Trained rows are consumed; the others go back to the front of the queue (a copy of
        just those rows), delivered again to the next take. Returns (consumed, returned); an
        unknown lease does nothing (its rows were or will be delivered again)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return 0, 0
        total = sum(len(rows) for _, rows in lease.rows)
        flags = np.asarray(trained, dtype=bool)
        if len(flags) != total:
            raise ValueError(f"lease {lease_id} holds {total} rows; got {len(flags)} flags")
        del self._leases[lease_id]
        back: list[_Queued] = []
        pos = consumed = 0
        for part, (seq, rows) in zip(lease.parts, lease.rows):
            mask = flags[pos:pos + len(rows)]
            pos += len(rows)
            self._settle(seq, rows[mask])
            consumed += int(mask.sum())
            left = np.flatnonzero(~mask)
            if len(left):
                objects = np.arange(part.offset, part.num_rows)[left]
                batch = self._get(part.ref).take(pa.array(objects))
                back.append(_Queued(seq, self._put(batch), len(left), 0,
                                    part.versions[objects], rows[left], part.seg_rows))
        for q in reversed(back):  # oldest first at the front
            self._queue.appendleft(q)
        returned = total - consumed
        self.counters["rows_acked"] += consumed
        self.counters["rows_redelivered"] += returned
        self._advance()
        if checkpoint:
            self.save_checkpoint()
        return consumed, returned

    def forget(self, policy_user: str, checkpoint: bool = True) -> dict[str, int]:
        """The right to be forgotten: remove every row of ``policy_user`` from the log.

        Each sealed segment holding such rows is rewritten atomically with them redacted
        (``clawray.samples.redact``: the same number of rows, so positions and the checkpoint
        stay valid) and they are settled, never delivered; rows still open (not sealed) are
        dropped; queued rows not taken yet leave the queue; a lease holding some is revoked
        (its other rows go back to the front of the queue, and the taker's ack of it does
        nothing: rows it trains anyway are repeats the learner drops by ``sample_id``). The
        batch a taker already holds may still be trained once. Returns counts."""
        out = {"rows": 0, "segments": 0, "open_rows": 0, "leases_revoked": 0}
        forgotten: dict[int, np.ndarray] = {}
        for seq in sorted(self._segments):
            path = self.path / segment_name(seq)
            table = pq.read_table(path, schema=SCHEMA)
            mask = np.asarray(pc_equal(policy_user_of(table), policy_user), dtype=bool)
            if not mask.any():
                continue
            clean = redact(table, mask)
            _write_atomic(path, lambda f: pq.write_table(clean, f, compression=self.compression))
            forgotten[seq] = mask
            self._settle(seq, np.flatnonzero(mask))
            out["rows"] += int(mask.sum())
            out["segments"] += 1
        kept = []
        for batch in self._open:
            mine = np.asarray(pc_equal(policy_user_of(pa.Table.from_batches([batch])),
                                       policy_user), dtype=bool)
            out["open_rows"] += int(mine.sum())
            if not mine.all():
                kept.append(batch.filter(pa.array(~mine)))
        self._open, self._open_rows = kept, sum(b.num_rows for b in kept)
        if not self._open_rows:
            self._open_since = None
        if not forgotten:
            return out

        def keep_of(seq: int, rows: np.ndarray) -> np.ndarray:
            return ~forgotten[seq][rows] if seq in forgotten else np.ones(len(rows), bool)

        for lease_id, lease in list(self._leases.items()):
            if all(keep_of(seq, rows).all() for seq, rows in lease.rows):
                continue
            del self._leases[lease_id]
            out["leases_revoked"] += 1
            back = []
            for part, (seq, rows) in zip(lease.parts, lease.rows):
                left = np.flatnonzero(keep_of(seq, rows))
                if len(left):
                    objects = np.arange(part.offset, part.num_rows)[left]
                    batch = self._get(part.ref).take(pa.array(objects))
                    back.append(_Queued(seq, self._put(batch), len(left), 0,
                                        part.versions[objects], rows[left], part.seg_rows))
            for q in reversed(back):
                self._queue.appendleft(q)
        for q in list(self._queue):
            if q.seq not in forgotten:
                continue
            rows = (q.origin if q.origin is not None else np.arange(q.num_rows))[
                q.offset:q.num_rows]
            keep = np.flatnonzero(keep_of(q.seq, rows))
            if len(keep) == len(rows):
                continue
            if len(keep):
                q.ref = self._put(self._get(q.ref).slice(q.offset).take(pa.array(keep)))
            q.versions = q.versions[q.offset:q.num_rows][keep]
            q.origin, q.num_rows, q.offset = rows[keep], len(keep), 0
            if not len(keep):
                self._queue.remove(q)
        for d in list(self._disk):
            if d.seq in forgotten:
                base = d.keep if d.keep is not None else np.arange(d.start, d.seg_rows)
                d.keep = base[keep_of(d.seq, base)]
                if not len(d.keep):
                    self._disk.remove(d)
        self._advance()
        if checkpoint:
            self.save_checkpoint()
        return out

    def expire(self, now: float | None = None) -> int:
        """Put the rows of leases past their deadline back at the front of the queue (oldest
        first); returns how many rows came back."""
        now = self._clock() if now is None else now
        late = [i for i, lease in self._leases.items() if lease.deadline <= now]
        back = self._requeue(late)
        if late:
            self.counters["leases_expired"] += len(late)
            self.counters["rows_redelivered"] += back
            logger.warning("%d lease(s) expired unacknowledged: %d rows go back to the queue",
                           len(late), back)
        return back

    def release(self, leases: Sequence[int]) -> int:
        """The taker gives rows back untrained (e.g. too few for a batch): they go back to the
        front of the queue at once. Returns the rows."""
        return self._requeue([i for i in leases if i in self._leases])

    def _requeue(self, leases: list[int]) -> int:
        back = 0
        for lease_id in sorted(leases, reverse=True):  # the oldest lease ends up in front
            lease = self._leases.pop(lease_id)
            for part in reversed(lease.parts):
                self._queue.appendleft(part)
                back += part.num_rows - part.offset
        return back

    def _settle(self, seq: int, rows: np.ndarray) -> None:
        """Mark segment rows consumed (acknowledged, or dropped as stale)."""
        if not len(rows) or (seq, 0) < (self._consumed[0], 0) or seq not in self._segments:
            return
        mask = self._settled.get(seq)
        if mask is None:
            mask = self._settled[seq] = np.zeros(self._segments[seq], dtype=bool)
        mask[np.asarray(rows, dtype=np.int64)] = True

    def _advance(self) -> None:
        """Move the consumed position over every settled row right after it."""
        seq, offset = self._consumed
        while seq in self._segments:
            mask = self._settled.get(seq)
            n = self._segments[seq]
            if mask is not None:
                unsettled = np.flatnonzero(~mask[offset:])
                offset = n if not len(unsettled) else offset + int(unsettled[0])
            if offset < n:
                break
            self._settled.pop(seq, None)
            if seq + 1 not in self._segments:
                break
            seq, offset = seq + 1, 0
        self._consumed = (seq, offset)

    def _checkpoint_data(self) -> dict[str, Any]:
        seq, offset = self._consumed
        settled = {}
        for s, mask in sorted(self._settled.items()):
            if s < seq:
                continue
            if s == seq:  # the rows before the position are consumed anyway
                mask = mask.copy()
                mask[:offset] = False
            if not mask.any():
                continue
            edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
            settled[str(s)] = edges.reshape(-1, 2).tolist()
        data: dict[str, Any] = {"seq": seq, "offset": offset}
        if settled:
            data["settled"] = settled
        return data

    def save_checkpoint(self) -> None:
        """Persist the consumed position and the rows settled beyond it atomically."""
        with self._ckpt_lock:
            self._advance()
            data = self._checkpoint_data()
            if data == self._ckpt_written:
                return
            raw = json.dumps(data).encode()
            _write_atomic(self.path / CHECKPOINT, lambda f: f.write(raw))
            self._ckpt_written = data
        self.collect_garbage()

    def collect_garbage(self, now: float | None = None) -> list[int]:
        """Delete consumed segments past the retention (``retain_days``/``retain_gb``); never
        one holding an unconsumed row. Returns the deleted seqs."""
        if self.retain_days is None and self.retain_gb is None:
            return []
        now = time.time() if now is None else now
        done = sorted(s for s in self._segments if s < self._consumed[0])
        sizes = {s: (self.path / segment_name(s)).stat().st_size for s in done}
        total = sum(sizes.values())
        deleted = []
        for seq in done:  # oldest first
            path = self.path / segment_name(seq)
            too_old = (self.retain_days is not None
                       and now - path.stat().st_mtime > self.retain_days * 86400)
            too_big = self.retain_gb is not None and total > self.retain_gb * 2**30
            if not (too_old or too_big):
                continue
            path.unlink()
            total -= sizes[seq]
            self.counters["wal_bytes"] -= sizes[seq]
            self.counters["segments_deleted"] += 1
            del self._segments[seq]
            deleted.append(seq)
        if deleted:
            fsync_dir(self.path)
            logger.info("retention: deleted %d consumed segments (%d..%d)", len(deleted),
                        deleted[0], deleted[-1])
        return deleted

    # ---------------------------------------------------------------- introspection
    def leased_rows(self) -> int:
        """Rows taken and not yet acknowledged, released or expired."""
        return sum(len(r) for lease in self._leases.values() for _, r in lease.rows)

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "segments": len(self._segments),
            "queued_rows": sum(q.num_rows - q.offset for q in self._queue),
            "held_rows": self._held_rows(),
            "on_disk_rows": sum(d.pending for d in self._disk),
            "leased_rows": self.leased_rows(),
            "leases": len(self._leases),
            "open_rows": self._open_rows,
            "available": self.available(),
            "last_seq": max(self._segments) if self._segments else None,
            "consumed": {"seq": self._consumed[0], "offset": self._consumed[1]},
            "policy_version": self.policy_version,
            "wal_write_s": round(self.wal_write_s, 6),
        }


__all__ = ["CHECKPOINT", "SampleBufferCore", "SampleValidationError", "SealJob", "Slice",
           "fetch", "fetch_from_wal", "read_segment", "segment_name"]
