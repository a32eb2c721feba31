"""The Arrow sample schema: row building, validation, batches and zero-copy packing."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from clawray import samples
from clawray.samples import (SCHEMA, SCHEMA_VERSION, SampleValidationError, batch_to_rows,
                             concat, make_row, pack_column, pack_sequences, rows_to_batch,
                             validate_batch, validate_row)


def row(i: int = 0, n_prompt: int = 3, n_resp: int = 2, **over) -> dict:
    fields = dict(sample_id=f"s-{i}", kind="rl", source="live",
                  prompt_ids=[100 + i + k for k in range(n_prompt)],
                  response_ids=[200 + i + k for k in range(n_resp)],
                  rollout_logprobs=[-0.1 * (k + 1) for k in range(n_resp)],
                  policy_version=i, reward=float(i % 3 - 1))
    fields.update(over)
    return make_row(**fields)


def test_schema_carries_its_version_in_metadata():
    assert SCHEMA.metadata[b"clawray.schema_version"] == SCHEMA_VERSION.encode() == b"2"
    required = {f.name for f in SCHEMA if not f.nullable}
    assert required == {"sample_id", "kind", "source", "prompt_ids", "response_ids",
                        "rollout_logprobs", "policy_version", "loss_mask", "reward"}
    assert SCHEMA.field("loss_mask").type == pa.list_(pa.int8())


def test_make_row_fills_every_column_with_defaults():
    r = row(n_resp=4)
    assert set(r) == set(SCHEMA.names)
    assert r["loss_mask"] == [1, 1, 1, 1]
    assert r["teacher_logprobs"] is None and r["votes"] is None and r["hint"] is None
    assert r["created_at"] > 1.6e9


def test_make_row_rejects_unknown_columns_by_name():
    with pytest.raises(SampleValidationError, match=r"unknown column\(s\) \['rewrd'\]"):
        row(rewrd=1.0)


@pytest.mark.parametrize("column", ["rollout_logprobs", "loss_mask", "advantages",
                                    "teacher_logprobs"])
def test_each_per_token_column_must_match_response_length(column):
    values = [0, 1, 1, 0] if column == "loss_mask" else [-0.5] * 4
    with pytest.raises(SampleValidationError,
                       match=rf"row 0 \(sample s-3\): {column} has 4 values but "
                             r"response_ids has 5"):
        row(3, n_resp=5, **{column: values})


@pytest.mark.parametrize("column,value", [("reward", math.nan), ("reward", math.inf),
                                          ("advantage", math.nan), ("reward", "high")])
def test_non_finite_scalars_are_rejected(column, value):
    with pytest.raises(SampleValidationError, match=rf"{column} is"):
        row(**{column: value})


@pytest.mark.parametrize("column", ["rollout_logprobs", "teacher_logprobs", "advantages"])
def test_nan_in_float_lists_is_rejected(column):
    with pytest.raises(SampleValidationError, match=rf"{column}\[1\] is nan"):
        row(**{column: [-0.1, math.nan]})


def test_bad_mask_value_is_rejected():
    with pytest.raises(SampleValidationError, match=r"loss_mask\[0\] is 2"):
        row(loss_mask=[2, 1])


@pytest.mark.parametrize("field,value,message", [
    ("kind", "ppo", "kind 'ppo' not in"), ("source", "web", "source 'web' not in"),
    ("prompt_ids", [], "prompt_ids is empty"), ("votes", [1, 2], "votes"),
    ("outcome", 3, "outcome 3")])
def test_enums_and_empty_prompt_are_rejected(field, value, message):
    with pytest.raises(SampleValidationError, match=message):
        row(**{field: value})


def test_missing_required_value_is_rejected():
    r = row()
    r["policy_version"] = None
    with pytest.raises(SampleValidationError, match="policy_version is required"):
        validate_row(r, 7)


def test_rows_to_batch_names_the_bad_row():
    rows = [row(i) for i in range(4)]
    rows[2]["loss_mask"] = [1]
    with pytest.raises(SampleValidationError, match=r"row 2 \(sample s-2\): loss_mask has 1"):
        rows_to_batch(rows)


def test_rows_to_batch_wraps_arrow_type_errors_with_the_row():
    rows = [row(0), row(1)]
    rows[1]["turn"] = "three"
    with pytest.raises(SampleValidationError, match=r"row 1 \(sample s-1\)"):
        rows_to_batch(rows)


def test_batch_round_trip_keeps_every_value():
    rows = [row(i, teacher_logprobs=[-1.5, -2.5], votes=[1, -1, 1], hint="h", outcome=1)
            for i in range(5)]
    batch = rows_to_batch(rows)
    assert batch.schema.equals(SCHEMA, check_metadata=True)
    back = batch_to_rows(batch)
    assert [r["sample_id"] for r in back] == [f"s-{i}" for i in range(5)]
    for a, b in zip(rows, back):
        assert b["prompt_ids"] == a["prompt_ids"] and b["votes"] == a["votes"]
        assert np.allclose(b["rollout_logprobs"], a["rollout_logprobs"])
        assert b["hint"] == "h" and b["outcome"] == 1 and b["session_id"] is None


def test_empty_rows_make_an_empty_batch_with_the_schema():
    batch = rows_to_batch([])
    assert batch.num_rows == 0 and batch.schema.equals(SCHEMA, check_metadata=True)
    validate_batch(batch)


def test_validate_batch_rejects_another_schema_version():
    batch = rows_to_batch([row()])
    other = batch.replace_schema_metadata({b"clawray.schema_version": b"3"})
    with pytest.raises(SampleValidationError, match="schema version 3"):
        validate_batch(other)
    with pytest.raises(SampleValidationError, match="no clawray.schema_version"):
        validate_batch(batch.replace_schema_metadata({}))


def test_validate_batch_rejects_missing_columns():
    batch = rows_to_batch([row()])
    smaller = pa.RecordBatch.from_arrays(batch.columns[:-1], schema=pa.schema(
        list(SCHEMA)[:-1], metadata=SCHEMA.metadata))
    with pytest.raises(SampleValidationError, match=r"missing \['judged_at'\]"):
        validate_batch(smaller)


def _unchecked(rows):
    return rows_to_batch(rows, validate=False)


@pytest.mark.parametrize("column", ["rollout_logprobs", "loss_mask", "advantages",
                                    "teacher_logprobs"])
def test_validate_batch_finds_length_mismatch_row(column):
    rows = [row(i, n_resp=3) for i in range(5)]
    rows[3][column] = [0, 1] if column == "loss_mask" else [-0.1, -0.2]
    with pytest.raises(SampleValidationError,
                       match=rf"row 3 \(sample s-3\): {column} has 2 values but "
                             r"response_ids has 3"):
        validate_batch(_unchecked(rows))


def test_validate_batch_finds_nan_and_bad_mask_rows():
    rows = [row(i, n_resp=3) for i in range(4)]
    rows[2]["rollout_logprobs"] = [-0.1, math.nan, -0.3]
    with pytest.raises(SampleValidationError, match=r"row 2 \(sample s-2\): rollout_logprobs"):
        validate_batch(_unchecked(rows))
    rows = [row(i, n_resp=3) for i in range(4)]
    rows[1]["reward"] = math.nan
    with pytest.raises(SampleValidationError, match=r"row 1 \(sample s-1\): reward is nan"):
        validate_batch(_unchecked(rows))
    rows = [row(i, n_resp=3) for i in range(4)]
    rows[3]["loss_mask"] = [1, 5, 1]
    with pytest.raises(SampleValidationError, match=r"row 3 \(sample s-3\): loss_mask has value 5"):
        validate_batch(_unchecked(rows))
    rows = [row(i) for i in range(3)]
    rows[1]["kind"] = "dpo"
    with pytest.raises(SampleValidationError, match=r"row 1 \(sample s-1\): kind 'dpo'"):
        validate_batch(_unchecked(rows))


def test_validate_batch_counts_rows_across_table_chunks():
    good = rows_to_batch([row(i) for i in range(3)])
    bad_rows = [row(i) for i in range(3, 6)]
    bad_rows[1]["reward"] = math.inf
    table = pa.Table.from_batches([good, _unchecked(bad_rows)])
    with pytest.raises(SampleValidationError, match=r"row 4 \(sample s-4\): reward is inf"):
        validate_batch(table)


def test_concat_keeps_rows_in_order():
    a, b = rows_to_batch([row(0), row(1)]), rows_to_batch([row(2)])
    t = concat([a, b])
    assert t.column("sample_id").to_pylist() == ["s-0", "s-1", "s-2"]
    assert concat([]).num_rows == 0


# ---------------------------------------------------------------- packing

def _varied_batch() -> pa.RecordBatch:
    return rows_to_batch([row(i, n_prompt=2 + i, n_resp=1 + (i * 3) % 5) for i in range(6)])


def test_pack_column_values_and_cu_seqlens():
    batch = _varied_batch()
    p = pack_column(batch, "response_ids")
    expected = [r["response_ids"] for r in batch.to_pylist()]
    assert p.cu_seqlens.dtype == torch.int32
    assert p.cu_seqlens.tolist() == [0, *np.cumsum([len(e) for e in expected]).tolist()]
    assert p.values.dtype == torch.int32
    assert p.values.tolist() == [t for e in expected for t in e]
    assert pack_column(batch, "loss_mask").values.dtype == torch.int8
    assert pack_column(batch, "rollout_logprobs").values.dtype == torch.float32


def test_pack_column_on_a_slice_rebases_offsets():
    batch = _varied_batch()
    part = batch.slice(2, 3)
    p = pack_column(part, "prompt_ids")
    expected = [r["prompt_ids"] for r in batch.to_pylist()[2:5]]
    assert p.cu_seqlens[0].item() == 0
    assert p.cu_seqlens.tolist() == [0, *np.cumsum([len(e) for e in expected]).tolist()]
    assert p.values.tolist() == [t for e in expected for t in e]


def test_pack_column_shares_memory_with_the_arrow_buffer():
    batch = _varied_batch()
    arr = batch.column("response_ids")
    p = pack_column(batch, "response_ids")
    data = arr.values.buffers()[1]  # [validity, data] of the int32 child array
    assert p.values.data_ptr() == data.address + arr.values.offset * 4
    # and a slice is a view into the same buffer, further along
    part = batch.slice(2, 3)
    q = pack_column(part, "response_ids")
    assert q.values.data_ptr() == data.address + arr.offsets[2].as_py() * 4


def test_pack_column_of_a_table_with_nullable_rows_copies_correctly():
    rows = [row(0, n_resp=2, teacher_logprobs=[-1.0, -2.0]), row(1, n_resp=3),
            row(2, n_resp=1, teacher_logprobs=[-3.0])]
    t = pa.Table.from_batches([rows_to_batch(rows[:2]), rows_to_batch(rows[2:])])
    p = pack_column(t, "teacher_logprobs")
    assert p.cu_seqlens.tolist() == [0, 2, 2, 3]
    assert p.values.tolist() == [-1.0, -2.0, -3.0]


def test_pack_sequences_concatenates_prompt_and_response_per_row():
    batch = _varied_batch()
    rows = batch.to_pylist()
    rows_mask = [[k % 2 for k in range(len(r["response_ids"]))] for r in rows]
    batch = rows_to_batch([{**r, "loss_mask": m} for r, m in zip(rows, rows_mask)])
    for data, sel in ((batch, slice(0, 6)), (batch.slice(1, 4), slice(1, 5))):
        ps = pack_sequences(data)
        want_ids, want_resp, want_loss, cu = [], [], [], [0]
        for r, m in zip(rows[sel], rows_mask[sel]):
            want_ids += r["prompt_ids"] + r["response_ids"]
            want_resp += [False] * len(r["prompt_ids"]) + [True] * len(r["response_ids"])
            want_loss += [0] * len(r["prompt_ids"]) + m
            cu.append(len(want_ids))
        assert ps.input_ids.tolist() == want_ids
        assert ps.cu_seqlens.tolist() == cu
        assert ps.response_mask.tolist() == want_resp
        assert ps.loss_mask.tolist() == want_loss


def test_module_has_no_ray_import():
    assert "ray" not in samples.__dict__


def test_a_version_1_log_reads_with_its_tenant_as_policy_user(tmp_path):
    """Version 2 added ``policy_user``; a version-1 file (no such column) still reads, the
    column null, and ``policy_user_of`` falls back to the key's tenant."""
    import pyarrow.parquet as pq

    from clawray.samples import policy_user_of

    rows = [row(0, tenant="key-aaaaaaaaaaaa", user="ann", policy_user="key-aaaaaaaaaaaa/ann"),
            row(1, tenant="key-bbbbbbbbbbbb"), row(2)]
    new = pa.Table.from_batches([rows_to_batch(rows)])
    old = new.drop_columns(["policy_user"]).replace_schema_metadata(
        {b"clawray.schema_version": b"1"})
    pq.write_table(old, tmp_path / "v1.parquet")
    back = pq.read_table(tmp_path / "v1.parquet", schema=SCHEMA)  # as the buffer reads segments
    validate_batch(back)
    assert back.column("policy_user").to_pylist() == [None, None, None]
    assert policy_user_of(back).to_pylist() == ["key-aaaaaaaaaaaa", "key-bbbbbbbbbbbb", None]
    assert policy_user_of(new).to_pylist() == ["key-aaaaaaaaaaaa/ann", "key-bbbbbbbbbbbb", None]
