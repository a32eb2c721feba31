"""SampleBufferCore without Ray: sealing, exact takes, the memory bound, staleness, duplicates,
crash recovery from the Parquet WAL, and the WAL as an ordinary Parquet dataset."""

from __future__ import annotations

import json
import time
import os

import pandas as pd
import pyarrow.dataset as ds
import pytest

from clawray.buffer import core as buffer_mod
from clawray.buffer.core import CHECKPOINT, SampleBufferCore, fetch, fetch_from_wal, segment_name
from clawray.samples import SampleValidationError, make_row, rows_to_batch


def row(i: int, version: int = 0) -> dict:
    return make_row(sample_id=f"s-{i:04d}", kind="rl", source="live", prompt_ids=[1, 2, i],
                    response_ids=[i, i + 1], rollout_logprobs=[-0.5, -0.25],
                    policy_version=version, reward=1.0)


def rows(a: int, b: int, version: int = 0) -> list[dict]:
    return [row(i, version) for i in range(a, b)]


def ids(core: SampleBufferCore, slices) -> list[str]:
    return fetch(slices).column("sample_id").to_pylist()


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_should_seal_by_size_and_by_age(tmp_path):
    clock = FakeClock()
    core = SampleBufferCore(tmp_path, seal_rows=4, seal_age_s=1.0, clock=clock)
    assert not core.should_seal()
    core.add(rows(0, 2))
    assert not core.should_seal()
    clock.t += 0.9
    assert not core.should_seal()
    clock.t += 0.2
    assert core.should_seal()
    assert core.seal() == 0
    assert not core.should_seal() and core.seal() is None
    core.add(rows(2, 6))
    assert core.should_seal()  # 4 rows, no time passed
    assert core.seal() == 1
    assert sorted(p.name for p in tmp_path.glob("seg-*")) == [segment_name(0), segment_name(1)]
    assert core.stats()["rows_sealed"] == 6


def test_take_exactly_n_keeps_surplus_for_next_call(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=4)
    for a in range(0, 10, 4):
        core.add(rows(a, min(a + 4, 10)))
        core.seal()
    taken = []
    for _ in range(3):
        slices = core.take(3)
        assert sum(s.length for s in slices) == 3
        taken += ids(core, slices)
    assert taken == [f"s-{i:04d}" for i in range(9)]
    assert core.take(3) == [] and core.available() == 1
    assert ids(core, core.take(1)) == ["s-0009"]
    assert core.stats()["rows_taken"] == 10


def test_take_splits_a_batch_into_views(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=100)
    core.add(rows(0, 10))
    core.seal()
    first = core.take(4)
    second = core.take(4)
    assert [(s.seq, s.offset, s.length) for s in first + second] == [(0, 0, 4), (0, 4, 4)]
    assert first[0].ref is second[0].ref  # one object, handed out as slices
    assert json.loads((tmp_path / CHECKPOINT).read_text()) == {"seq": 0, "offset": 8}


def test_memory_stays_bounded_and_rows_come_out_in_order(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=5, max_queued_rows=12)
    peak = 0
    for a in range(0, 100, 5):
        core.add(rows(a, a + 5))
        core.seal()
        peak = max(peak, core.stats()["held_rows"])
    assert core.stats()["on_disk_rows"] > 0  # the rest waits on disk
    out = []
    while core.available():
        out += ids(core, core.take(3 if core.available() >= 3 else core.available()))
        peak = max(peak, core.stats()["held_rows"])
    assert peak <= 12
    assert out == [f"s-{i:04d}" for i in range(100)]


def test_take_larger_than_the_bound_still_succeeds(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=4, max_queued_rows=4)
    for a in range(0, 12, 4):
        core.add(rows(a, a + 4))
        core.seal()
    assert ids(core, core.take(10)) == [f"s-{i:04d}" for i in range(10)]


def test_stale_rows_are_skipped_and_counted(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=100, max_staleness=2)
    core.add([row(i, version=i % 5) for i in range(10)])  # versions 0..4, twice
    core.seal()
    core.set_policy_version(5)  # keep versions >= 3
    assert core.available() == 4
    slices = core.take(3)
    table = fetch(slices)
    assert table.column("policy_version").to_pylist() == [3, 4, 3]
    assert table.column("sample_id").to_pylist() == ["s-0003", "s-0004", "s-0008"]
    assert core.stats()["stale_dropped"] == 6
    # the filtered copy maps back to the segment's rows
    assert fetch_from_wal(tmp_path, slices).column("sample_id").to_pylist() == \
        table.column("sample_id").to_pylist()
    assert ids(core, core.take(1)) == ["s-0009"]
    # stale rows stay in the WAL
    assert ds.dataset(tmp_path, format="parquet").count_rows() == 10


def test_without_a_policy_version_nothing_is_stale(tmp_path):
    core = SampleBufferCore(tmp_path, max_staleness=0)
    core.add([row(i, version=i) for i in range(3)])
    core.seal()
    assert core.available() == 3


def test_duplicates_are_dropped_and_counted(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=100)
    assert core.add(rows(0, 3)) == ["s-0000", "s-0001", "s-0002"]
    assert core.add(rows(2, 5)) == ["s-0003", "s-0004"]  # s-0002 is still open
    core.seal()
    assert core.add(rows(0, 2)) == []  # already sealed
    assert core.add([row(7), row(7)]) == ["s-0007"]  # twice in one call
    assert core.stats()["duplicates"] == 4
    core.seal()
    assert sorted(ids(core, core.take(6))) == [f"s-{i:04d}" for i in (0, 1, 2, 3, 4, 7)]


def test_add_rejects_bad_rows_and_accepts_arrow_batches(tmp_path):
    core = SampleBufferCore(tmp_path)
    bad = row(1)
    bad["loss_mask"] = [1]
    with pytest.raises(SampleValidationError, match="loss_mask has 1"):
        core.add([row(0), bad])
    assert core.open_rows == 0
    assert core.add(rows_to_batch(rows(0, 3))) == ["s-0000", "s-0001", "s-0002"]
    core.seal()
    assert ids(core, core.take(3)) == ["s-0000", "s-0001", "s-0002"]


def test_recovery_requeues_untaken_rows_exactly_once(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=4, max_queued_rows=8)
    for a in range(0, 30, 4):
        core.add(rows(a, min(a + 4, 30)))
        core.seal()
    core.add(rows(30, 33))  # open, never sealed: not acknowledged, so it may be lost
    taken = set(ids(core, core.take(7)) + ids(core, core.take(6)))
    del core  # a crash: nothing is closed or flushed

    again = SampleBufferCore(tmp_path, seal_rows=4, max_queued_rows=8)
    assert again.available() == 30 - 13
    rest = ids(again, again.take(again.available()))
    assert len(rest) == len(set(rest)) == 17
    assert not taken & set(rest)
    assert taken | set(rest) == {f"s-{i:04d}" for i in range(30)}
    # the duplicate filter was rebuilt: a producer retrying sealed rows adds nothing
    assert again.add(rows(25, 33)) == ["s-0030", "s-0031", "s-0032"]
    assert again.stats()["duplicates"] == 5
    # and a third start after everything was taken delivers nothing more
    again.seal()
    assert ids(again, again.take(3)) == ["s-0030", "s-0031", "s-0032"]
    assert SampleBufferCore(tmp_path).available() == 0


def test_stray_temp_file_from_a_crash_is_ignored_and_removed(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=4)
    core.add(rows(0, 4))
    core.seal()
    stray = tmp_path / f".{segment_name(1)}.1234.tmp"
    stray.write_bytes(b"PAR1 half a file")
    again = SampleBufferCore(tmp_path)
    assert not stray.exists()
    assert again.available() == 4 and again.stats()["segments"] == 1
    assert again.seal() is None
    again.add(rows(4, 5))
    assert again.seal() == 1


def test_seal_is_atomic_a_failed_write_leaves_no_segment(tmp_path, monkeypatch):
    core = SampleBufferCore(tmp_path)
    core.add(rows(0, 3))

    def broken(final, write):
        raise OSError("disk full")

    monkeypatch.setattr(buffer_mod, "_write_atomic", broken)
    with pytest.raises(OSError, match="disk full"):
        core.seal()
    assert not list(tmp_path.glob("seg-*")) and core.available() == 0
    monkeypatch.undo()
    assert core.add(rows(0, 3)) == ["s-0000", "s-0001", "s-0002"]  # a retry is welcome


def test_segment_is_fsynced_before_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace",
                        lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    core = SampleBufferCore(tmp_path)
    core.add(rows(0, 2))
    core.seal()
    assert calls == ["fsync", "replace", "fsync"]  # file, rename, folder


def test_wal_is_an_ordinary_parquet_dataset(tmp_path):
    core = SampleBufferCore(tmp_path, seal_rows=4)
    for a in range(0, 10, 4):
        core.add(rows(a, min(a + 4, 10)))
        core.seal()
    core.take(5)
    assert (tmp_path / CHECKPOINT).exists()
    table = ds.dataset(tmp_path, format="parquet").to_table()
    assert sorted(table.column("sample_id").to_pylist()) == [f"s-{i:04d}" for i in range(10)]
    frame = pd.read_parquet(tmp_path)
    assert len(frame) == 10 and list(frame["prompt_ids"].iloc[3]) == [1, 2, 3]


def test_stats_count_wal_bytes_and_write_time(tmp_path):
    core = SampleBufferCore(tmp_path)
    core.add(rows(0, 5))
    core.seal()
    s = core.stats()
    assert s["wal_bytes"] == (tmp_path / segment_name(0)).stat().st_size
    assert s["wal_write_s"] > 0 and s["last_seq"] == 0 and s["segments"] == 1
    assert s["consumed"] == {"seq": 0, "offset": 0} and s["queued_rows"] == 5


def test_samples_cli_reports_stats_and_head_of_a_wal(tmp_path):
    import io

    from clawray.apps.samples import main

    core = SampleBufferCore(tmp_path, seal_rows=4)
    core.add([make_row(sample_id=f"c-{i}", kind="opd" if i < 2 else "rl", source="live",
                       prompt_ids=list(range(20)), response_ids=[1, 2],
                       rollout_logprobs=[-1.0, -2.0],
                       policy_version=0, reward=float(i % 2), judge_status="judged")
              for i in range(5)])
    core.seal()
    core.take(2)
    out = io.StringIO()
    assert main(["stats", str(tmp_path)], out=out) == 0
    text = out.getvalue()
    assert "rows: 5" in text and "rl=3" in text and "opd=2" in text and "judged=5" in text
    assert "mean=0.4" in text and "consumed: up to segment 0 row 2" in text
    out = io.StringIO()
    assert main(["head", str(tmp_path), "-n", "2", "--columns", "sample_id,prompt_ids"],
                out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines == ["sample_id='c-0'  prompt_ids=[20 ids]", "sample_id='c-1'  prompt_ids=[20 ids]"]
    assert main(["stats", str(tmp_path / "missing")]) == 2


# ---------------------------------------------------------------------------- leases
def leased(tmp_path, **kw) -> tuple[SampleBufferCore, FakeClock]:
    clock = FakeClock()
    kw.setdefault("seal_rows", 100)
    return SampleBufferCore(tmp_path, lease_s=30.0, clock=clock, **kw), clock


def test_rows_taken_but_never_acknowledged_survive_a_crash_of_everyone(tmp_path):
    """The trainer dies between take and update, then the buffer restarts too: every row is
    delivered again; once acknowledged, never again."""
    core, _ = leased(tmp_path)
    core.add(rows(0, 10))
    core.seal()
    taken = core.take(6)
    assert {s.lease for s in taken} == {1} and ids(core, taken) == [f"s-{i:04d}" for i in range(6)]
    assert core.stats()["leased_rows"] == 6 and core.available() == 4
    again, _ = leased(tmp_path)  # a new core on the folder: leases do not survive it
    slices = again.take(10)
    assert ids(again, slices) == [f"s-{i:04d}" for i in range(10)]
    assert again.ack([slices[0].lease]) == 10
    third, _ = leased(tmp_path)
    assert third.available() == 0 and third.stats()["consumed"] == {"seq": 0, "offset": 10}


def test_an_expired_lease_goes_back_to_the_front_in_order(tmp_path):
    core, clock = leased(tmp_path, seal_rows=4)
    core.add(rows(0, 12))
    core.seal()
    a = core.take(3)
    b = core.take(3)
    clock.t += 31  # both expire: the trainer is gone
    c = core.take(8)
    assert ids(core, c) == [f"s-{i:04d}" for i in range(8)]
    assert core.stats()["leases_expired"] == 2 and core.stats()["rows_redelivered"] == 6
    assert core.ack([a[0].lease, b[0].lease]) == 0  # too late: settles nothing
    assert core.ack([c[0].lease]) == 8
    assert core.stats()["consumed"] == {"seq": 0, "offset": 8}
    assert ids(core, core.take(4)) == [f"s-{i:04d}" for i in range(8, 12)]


def test_acknowledgements_out_of_order_keep_the_unacknowledged_rows(tmp_path):
    core, _ = leased(tmp_path)
    core.add(rows(0, 10))
    core.seal()
    first, second = core.take(4), core.take(4)
    core.ack([second[0].lease])
    core.save_checkpoint()
    saved = json.loads((tmp_path / CHECKPOINT).read_text())
    assert saved == {"seq": 0, "offset": 0, "settled": {"0": [[4, 8]]}}
    again, _ = leased(tmp_path)  # crash: rows 0-3 (unacknowledged) and 8-9 (untaken) only
    assert ids(again, again.take(6)) == [f"s-{i:04d}" for i in (0, 1, 2, 3, 8, 9)]
    core.ack([first[0].lease])
    assert core.stats()["consumed"] == {"seq": 0, "offset": 8}


def test_a_partly_trained_lease_consumes_the_trained_rows_and_returns_the_rest(tmp_path):
    """Per-user training trains some users' rows of a take: those are consumed, the others
    come back first, in order, and survive a crash as untrained."""
    core, _ = leased(tmp_path, seal_rows=4)
    core.add(rows(0, 10))
    core.seal()
    taken = core.take(6)  # spans several slices
    trained = [i % 2 == 0 for i in range(6)]  # rows 0, 2, 4 trained
    assert core.ack_rows(taken[0].lease, trained) == (3, 3)
    assert core.ack_rows(taken[0].lease, trained) == (0, 0)  # once only
    again = core.take(5)
    assert ids(core, again) == [f"s-{i:04d}" for i in (1, 3, 5, 6, 7)]
    core.save_checkpoint()
    crashed, _ = leased(tmp_path)  # the trained rows stay consumed
    assert ids(crashed, crashed.take(7)) == [f"s-{i:04d}" for i in (1, 3, 5, 6, 7, 8, 9)]
    assert core.ack_rows(again[0].lease, [True] * 5) == (5, 0)
    with pytest.raises(ValueError, match="flags"):
        core.ack_rows(core.take(2)[0].lease, [True])
    assert core.stats()["consumed"] == {"seq": 0, "offset": 8}


def test_stale_rows_dropped_under_leases_are_settled(tmp_path):
    core, _ = leased(tmp_path, max_staleness=1)
    core.add(rows(0, 4, version=0) + rows(4, 8, version=5))
    core.seal()
    core.set_policy_version(5)
    taken = core.take(4)
    assert ids(core, taken) == [f"s-{i:04d}" for i in range(4, 8)]
    core.ack([taken[0].lease])
    assert core.stats()["consumed"] == {"seq": 0, "offset": 8}


def test_retention_deletes_consumed_segments_only(tmp_path):
    core, _ = leased(tmp_path, seal_rows=4, retain_gb=1e-9)  # ~1 byte: every consumed one
    core.add(rows(0, 12))
    core.seal()  # one segment per seal call: 0..11 in seg 0
    core.add(rows(12, 16))
    core.seal()
    core.add(rows(16, 20))
    core.seal()
    taken = core.take(14)  # all of segment 0 and half of segment 1
    core.ack([taken[0].lease])
    core.save_checkpoint()
    left = sorted(p.name for p in tmp_path.glob("seg-*"))
    assert left == [segment_name(1), segment_name(2)]  # 1 still holds unconsumed rows
    assert core.stats()["segments_deleted"] == 1
    again, _ = leased(tmp_path)
    assert ids(again, again.take(6)) == [f"s-{i:04d}" for i in range(14, 20)]
    old, _ = leased(tmp_path / "old", retain_days=1.0)
    old.add(rows(0, 4))
    old.seal()
    old.ack([old.take(4)[0].lease])
    old.add(rows(4, 8))
    old.seal()
    old.save_checkpoint()
    assert old.collect_garbage(now=time.time() + 0.5 * 86400) == []  # not old enough yet
    assert old.collect_garbage(now=time.time() + 2 * 86400) == [0]


def user_row(i: int, user: str | None) -> dict:
    r = row(i)
    r.update(policy_user=user, tenant="t", user=user, session_id=f"sess-{user}-{i}",
             feedback_text=f"{user} says thanks")
    return r


def test_forgetting_a_user_removes_their_rows_everywhere_and_keeps_the_rest(tmp_path):
    """The right to be forgotten: sealed, queued, on-disk, leased and open rows of one user
    are gone from the log and never delivered; everyone else's rows arrive exactly once, in
    order, also after a restart."""
    core, _ = leased(tmp_path, seal_rows=100, max_queued_rows=6)
    who = ["ann" if i % 3 == 0 else "bob" for i in range(20)]
    for a, b in ((0, 6), (6, 12), (12, 18)):  # seg 0 queued; segs 1 and 2 wait on disk
        core.add([user_row(i, who[i]) for i in range(a, b)])
        core.seal()
    held = core.take(4)  # a lease holding ann's rows 0 and 3
    core.add([user_row(i, who[i]) for i in (18, 19)])  # open, not sealed
    out = core.forget("ann")
    assert out == {"rows": 6, "segments": 3, "open_rows": 1, "leases_revoked": 1}
    assert core.ack([held[0].lease]) == 0  # the revoked lease settles nothing
    core.seal()
    bob = [f"s-{i:04d}" for i in range(20) if who[i] == "bob"]
    got = core.take(len(bob))
    assert ids(core, got) == bob and core.take(1) == []
    # on disk: ann's rows are blank rows that keep the log's positions; bob's are untouched
    table = ds.dataset(tmp_path, format="parquet").to_table().sort_by("sample_id")
    gone = table.filter(ds.field("source") == "forgotten").to_pylist()
    assert len(gone) == 6 and table.num_rows == 19  # ann's open row 18 was never written
    assert all(r["policy_user"] is None and r["user"] is None and r["prompt_ids"] == []
               and r["response_ids"] == [] and r["feedback_text"] is None for r in gone)
    assert "ann" not in json.dumps(table.to_pylist(), default=str)
    # a restart delivers nothing of ann's and, once bob's rows are acknowledged, nothing at all
    core.ack([got[0].lease])
    again, _ = leased(tmp_path)
    assert again.take(1) == [] and again.stats()["consumed"] == {"seq": 3, "offset": 1}
    assert core.forget("nobody") == {"rows": 0, "segments": 0, "open_rows": 0,
                                     "leases_revoked": 0}


def test_forgetting_before_a_restart_settles_the_rows_in_the_checkpoint(tmp_path):
    core, _ = leased(tmp_path)
    core.add([user_row(i, "ann" if i < 2 else "bob") for i in range(4)])
    core.seal()
    core.forget("ann")
    again, _ = leased(tmp_path)
    assert ids(again, again.take(2)) == ["s-0002", "s-0003"] and again.take(1) == []


def test_an_offline_forget_refuses_while_an_app_has_the_log_open(tmp_path):
    """``clawray forget --samples`` on a folder a running app's buffer writes would race it
    (two writers of one log): it refuses, changing nothing, until the app lets go."""
    from clawray.buffer.core import BufferBusyError, forget_offline, hold_as_writer

    core = SampleBufferCore(tmp_path)
    core.add([user_row(i, "ann" if i < 2 else "bob") for i in range(4)])
    core.seal()
    app = hold_as_writer(tmp_path)  # what the app's SampleBuffer actor holds for its life
    other = hold_as_writer(tmp_path)  # two apps on one folder do not exclude each other
    with pytest.raises(BufferBusyError, match="open by a running app"):
        forget_offline(tmp_path, "ann")
    app.close()
    with pytest.raises(BufferBusyError):
        forget_offline(tmp_path, "ann")
    other.close()
    assert forget_offline(tmp_path, "ann")["rows"] == 2
    table = ds.dataset(tmp_path, format="parquet").to_table()
    assert table.filter(ds.field("source") == "forgotten").num_rows == 2
