"""HubJournal: pending turns and feedback survive a crash; done turns are not replayed; a
line cut by the crash is dropped; compaction keeps exactly the live entries."""

from __future__ import annotations

import json

from clawray.sessions import journal as journal_mod
from clawray.sessions.journal import HubJournal


def rec(rid: str) -> dict:
    return {"record_id": rid, "session_id": "s", "turn_type": "main"}


def test_replay_gives_back_the_live_turns_and_their_feedback_in_order(tmp_path):
    j = HubJournal(tmp_path / "hub.jsonl")
    j.record(rec("a"), 1.0)
    j.record(rec("b"), 2.0)
    j.feedback(2.5, rating=1, text=None, record_id="b", session_key=None, tenant="local")
    j.done(["a"])
    j.done(["zzz"])  # never journaled: nothing written
    j.sync()
    j.close()
    again = HubJournal(tmp_path / "hub.jsonl")
    entries = list(again.replay())
    assert [e.get("record", {}).get("record_id") or "fb" for e in entries] == ["b", "fb"]
    assert entries[0]["t"] == 2.0 and entries[1]["feedback"]["record_id"] == "b"
    assert list(again.live) == ["b"]


def test_a_line_cut_by_a_crash_is_dropped_before_appending(tmp_path):
    path = tmp_path / "hub.jsonl"
    j = HubJournal(path)
    j.record(rec("a"), 1.0)
    j.close()
    with open(path, "a") as f:
        f.write('{"t": 2.0, "record": {"record_id": "cu')  # the crash cut this write
    again = HubJournal(path)
    again.record(rec("c"), 3.0)
    again.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["record"]["record_id"] for line in lines] == ["a", "c"]
    assert [e["record"]["record_id"] for e in HubJournal(path).replay()] == ["a", "c"]


def test_compaction_keeps_only_live_entries(tmp_path, monkeypatch):
    path = tmp_path / "hub.jsonl"
    j = HubJournal(path)
    for i in range(50):
        j.record({**rec(f"r{i}"), "prompt_ids": list(range(200))}, float(i))
    j.done([f"r{i}" for i in range(48)])
    monkeypatch.setattr(journal_mod, "COMPACT_BYTES", 1000)
    big = path.stat().st_size
    j.sync()
    assert path.stat().st_size < big / 10
    j.record(rec("r50"), 50.0)
    j.close()
    assert [e["record"]["record_id"] for e in HubJournal(path).replay()] == ["r48", "r49", "r50"]
