"""The JSONL record sink: with ``system_prompt="hash"`` a system prompt is stored once (by its
SHA-256) instead of in every record, and reading the file puts it back."""

from __future__ import annotations

import json

import pytest

from clawray.records import JsonlSink, TurnRecord, prompt_store_of, read_jsonl_records

SYSTEM = "You are an agent. " + "## Tooling\n" * 2000  # an OpenClaw-sized system prompt


def rec(i: int, system: str = SYSTEM) -> TurnRecord:
    return TurnRecord(f"chatcmpl-{i}", "s", "header", "main", False, "m", [1, 2], [3], [-0.1],
                      "stop", 0, None, [{"role": "system", "content": system},
                                        {"role": "user", "content": f"q{i}"}], None, {}, "a", [])


@pytest.mark.parametrize("mode", ["inline", "hash"])
def test_records_read_back_the_same_either_way(tmp_path, mode):
    path = tmp_path / "turns.jsonl"
    sink = JsonlSink(path, system_prompt=mode)
    records = [rec(i) for i in range(5)] + [rec(5, system="Another prompt.")]
    for r in records:
        sink.put(r)
    sink.close()
    assert read_jsonl_records(path) == records
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    if mode == "inline":
        assert all("content" in line["messages"][0] for line in lines)
        assert not prompt_store_of(path).exists()
        return
    # each distinct prompt once on disk; the records hold its hash only
    assert len(list(prompt_store_of(path).glob("*.txt"))) == 2
    assert all("content" not in line["messages"][0] for line in lines)
    assert path.stat().st_size < len(SYSTEM)  # six records, smaller than one prompt


def test_an_unknown_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="inline"):
        JsonlSink(tmp_path / "x.jsonl", system_prompt="gzip")
