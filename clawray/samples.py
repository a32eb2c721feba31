"""THE Arrow schema of training samples: one row per trainable step, from live turns and envs.

Every producer (SessionHub, EnvRunners, the RM co-trainer) builds rows with ``make_row`` or
``rows_to_batch``; the SampleBuffer stores them as Arrow record batches (Parquet on disk) and
the learner turns list columns into packed torch tensors without copying (``pack_column``) or
with one copy into prompt+response sequences (``pack_sequences``).

Token ids are the engine's own ids, never re-tokenized text. ``rollout_logprobs``,
``loss_mask`` and the optional per-token columns (``advantages``, ``teacher_logprobs``) hold
exactly one value per response token; validation enforces it with messages that name the row,
its sample id and the column.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:  # torch is imported where tensors are made: producers and the buffer
    import torch  # actor never pack, and importing torch costs seconds per worker start

SCHEMA_VERSION = "2"  # 2: policy_user; version-1 logs read it as null
_VERSION_KEY = b"clawray.schema_version"

KINDS = frozenset({"rl", "opd", "combine", "rm", "sft"})
SOURCES = frozenset({"live", "env"})

SCHEMA = pa.schema(
    [
        # identity
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("session_id", pa.string()),
        # whose session (live rows): the API key's tenant id and the end user the client named;
        # older logs without these columns read them as null
        pa.field("tenant", pa.string()),
        pa.field("user", pa.string()),
        # whose policy the row trains (per-user policies): the end user a trusted app named
        # ("<tenant>/<user>"), else the key's tenant; null for rows of the shared policy (env,
        # SFT) and in version-1 logs (``policy_user_of`` reads those as their tenant)
        pa.field("policy_user", pa.string()),
        pa.field("turn", pa.int32()),
        pa.field("trajectory_id", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("step", pa.int32()),
        # tokens (engine ids)
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("response_ids", pa.list_(pa.int32()), nullable=False),
        # behaviour policy
        pa.field("rollout_logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("policy_version_end", pa.int64()),
        pa.field("token_versions", pa.list_(pa.int64())),  # the version of each response token
        # masks
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        # rewards
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("votes", pa.list_(pa.int8())),
        pa.field("vote_parse_failures", pa.int8()),
        pa.field("judge_status", pa.string()),
        pa.field("outcome", pa.int8()),
        pa.field("feedback_text", pa.string()),
        pa.field("advantage", pa.float32()),
        pa.field("advantages", pa.list_(pa.float32())),
        # on-policy distillation
        pa.field("teacher_logprobs", pa.list_(pa.float32())),
        pa.field("hint", pa.string()),
        # bookkeeping
        pa.field("next_state", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("at_least_one", pa.bool_()),
        pa.field("created_at", pa.float64()),
        pa.field("judged_at", pa.float64()),
    ],
    metadata={_VERSION_KEY: SCHEMA_VERSION.encode()},
)

COLUMNS: tuple[str, ...] = tuple(SCHEMA.names)
REQUIRED: frozenset[str] = frozenset(f.name for f in SCHEMA if not f.nullable)
# List columns that must hold one value per response token when present.
PER_TOKEN = ("rollout_logprobs", "loss_mask", "advantages", "teacher_logprobs", "token_versions")
_FLOAT_LISTS = ("rollout_logprobs", "teacher_logprobs", "advantages")
_TERNARY = ("votes", "outcome")  # values in {-1, 0, 1}

_PACKABLE = (pa.int8(), pa.int32(), pa.int64(), pa.float32(), pa.float64())


class SampleValidationError(ValueError):
    """A row or batch that breaks the sample contract; the message names row, sample and column."""


def _where(index: int, sample_id: Any) -> str:
    return f"row {index} (sample {sample_id})"


# ---------------------------------------------------------------- rows (Python dicts)

def make_row(**fields: Any) -> dict[str, Any]:
    """A validated row with every column: optional ones default to None, ``loss_mask`` to all
    ones (every response token trains) and ``created_at`` to now."""
    unknown = sorted(set(fields) - set(COLUMNS))
    if unknown:
        raise SampleValidationError(
            f"row 0 (sample {fields.get('sample_id')}): unknown column(s) {unknown}; "
            f"known columns: {list(COLUMNS)}")
    row = dict.fromkeys(COLUMNS)
    row.update(fields)
    if row["loss_mask"] is None and row["response_ids"] is not None:
        row["loss_mask"] = [1] * len(row["response_ids"])
    if row["created_at"] is None:
        row["created_at"] = time.time()
    validate_row(row)
    return row


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(value)
    except TypeError:  # not a number at all
        return False


def validate_row(row: dict[str, Any], index: int = 0) -> None:
    """Check one row against the contract (keys, required values, per-token lengths, finite
    floats, mask values, enums); raise ``SampleValidationError`` on the first problem."""
    where = _where(index, row.get("sample_id"))
    unknown = sorted(set(row) - set(COLUMNS))
    if unknown:
        raise SampleValidationError(f"{where}: unknown column(s) {unknown}")
    for name in sorted(REQUIRED):
        if row.get(name) is None:
            raise SampleValidationError(f"{where}: {name} is required")
    if row["kind"] not in KINDS:
        raise SampleValidationError(f"{where}: kind {row['kind']!r} not in {sorted(KINDS)}")
    if row["source"] not in SOURCES:
        raise SampleValidationError(f"{where}: source {row['source']!r} not in {sorted(SOURCES)}")
    if len(row["prompt_ids"]) == 0:
        raise SampleValidationError(f"{where}: prompt_ids is empty")
    n = len(row["response_ids"])
    for name in PER_TOKEN:
        values = row.get(name)
        if values is not None and len(values) != n:
            raise SampleValidationError(
                f"{where}: {name} has {len(values)} values but response_ids has {n}")
    for name in ("reward", "advantage"):
        if row.get(name) is not None and not _finite(row[name]):
            raise SampleValidationError(f"{where}: {name} is {row[name]!r}")
    for name in _FLOAT_LISTS:
        values = row.get(name)
        if values is not None:
            for i, v in enumerate(values):
                if not _finite(v):
                    raise SampleValidationError(f"{where}: {name}[{i}] is {v!r}")
    for i, v in enumerate(row["loss_mask"]):
        if v not in (0, 1):
            raise SampleValidationError(f"{where}: loss_mask[{i}] is {v}, expected 0 or 1")
    votes = row.get("votes")
    if votes is not None and any(v not in (-1, 0, 1) for v in votes):
        raise SampleValidationError(f"{where}: votes {list(votes)} must be -1, 0 or 1")
    if row.get("outcome") not in (None, -1, 0, 1):
        raise SampleValidationError(f"{where}: outcome {row['outcome']} must be -1, 0 or 1")


def rows_to_batch(rows: Sequence[dict[str, Any]], validate: bool = True) -> pa.RecordBatch:
    """One record batch with ``SCHEMA`` from row dicts (missing optional keys become null)."""
    if validate:
        for i, row in enumerate(rows):
            validate_row(row, i)
    try:
        return pa.RecordBatch.from_pylist(list(rows), schema=SCHEMA)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
        for i, row in enumerate(rows):  # find the offending row for the message
            try:
                pa.RecordBatch.from_pylist([row], schema=SCHEMA)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as row_exc:
                raise SampleValidationError(
                    f"{_where(i, row.get('sample_id'))}: {row_exc}") from exc
        raise SampleValidationError(str(exc)) from exc


def batch_to_rows(batch: pa.RecordBatch | pa.Table) -> list[dict[str, Any]]:
    return batch.to_pylist()


def concat(batches: Iterable[pa.RecordBatch | pa.Table]) -> pa.Table:
    """One table from batches or tables of ``SCHEMA`` (no copy: the chunks are kept)."""
    tables = []
    for b in batches:
        _check_schema(b.schema)
        tables.append(b if isinstance(b, pa.Table) else pa.Table.from_batches([b], schema=SCHEMA))
    if not tables:
        return SCHEMA.empty_table()
    return pa.concat_tables(tables)


# ---------------------------------------------------------------- batches (vectorized)

def _check_schema(schema: pa.Schema) -> None:
    meta = schema.metadata or {}
    version = meta.get(_VERSION_KEY)
    if version is None:
        raise SampleValidationError(
            f"batch has no {_VERSION_KEY.decode()} metadata; expected schema version "
            f"{SCHEMA_VERSION}")
    if version.decode() != SCHEMA_VERSION:
        raise SampleValidationError(
            f"batch has schema version {version.decode()}, this clawray reads version "
            f"{SCHEMA_VERSION}")
    if not schema.equals(SCHEMA, check_metadata=False):
        have = {f.name: f.type for f in schema}
        want = {f.name: f.type for f in SCHEMA}
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        retyped = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        raise SampleValidationError(
            f"batch schema differs from SCHEMA v{SCHEMA_VERSION}: missing {missing}, "
            f"unexpected {extra}, other types {retyped}"
            + ("" if missing or extra or retyped else ", column order or nullability"))


def _first(mask: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first true value of a boolean array (nulls count as false)."""
    hits = pc.indices_nonzero(pc.fill_null(mask, False))
    return None if len(hits) == 0 else hits[0].as_py()


def _lengths(arr: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)


def _row_of_flat(arr: pa.Array, flat_index: int) -> int:
    """Row holding element ``flat_index`` of ``arr.flatten()``."""
    return int(np.searchsorted(np.cumsum(_lengths(arr)), flat_index, side="right"))


def validate_batch(batch: pa.RecordBatch | pa.Table) -> None:
    """Check a batch's schema (version included) and every row's contract, vectorized."""
    _check_schema(batch.schema)
    base = 0
    for part in batch.to_batches() if isinstance(batch, pa.Table) else [batch]:
        _validate_rows(part, base)
        base += part.num_rows


def _validate_rows(batch: pa.RecordBatch, base: int) -> None:
    ids = batch.column("sample_id")

    def fail(index: int, message: str) -> None:
        raise SampleValidationError(f"{_where(base + index, ids[index].as_py())}: {message}")

    for name in sorted(REQUIRED):
        if (i := _first(pc.is_null(batch.column(name)))) is not None:
            fail(i, f"{name} is required")
    for name, allowed in (("kind", KINDS), ("source", SOURCES)):
        col = batch.column(name)
        if (i := _first(pc.invert(pc.is_in(col, pa.array(sorted(allowed)))))) is not None:
            fail(i, f"{name} {col[i].as_py()!r} not in {sorted(allowed)}")
    if (i := _first(pc.equal(pc.list_value_length(batch.column("prompt_ids")), 0))) is not None:
        fail(i, "prompt_ids is empty")
    n = pc.list_value_length(batch.column("response_ids"))
    for name in PER_TOKEN:
        lengths = pc.list_value_length(batch.column(name))
        if (i := _first(pc.not_equal(lengths, n))) is not None:
            fail(i, f"{name} has {lengths[i].as_py()} values but response_ids has {n[i].as_py()}")
    for name in ("reward", "advantage"):
        if (i := _first(pc.invert(pc.is_finite(batch.column(name))))) is not None:
            fail(i, f"{name} is {batch.column(name)[i].as_py()}")
    for name in _FLOAT_LISTS:
        col = batch.column(name)
        if (j := _first(pc.invert(pc.is_finite(col.flatten())))) is not None:
            fail(_row_of_flat(col, j), f"{name} has a non-finite value {col.flatten()[j].as_py()}")
    mask = batch.column("loss_mask")
    if (j := _first(pc.invert(pc.is_in(mask.flatten(), pa.array([0, 1], pa.int8()))))) is not None:
        fail(_row_of_flat(mask, j), f"loss_mask has value {mask.flatten()[j].as_py()}, "
                                    "expected 0 or 1")
    ternary = pa.array([-1, 0, 1], pa.int8())
    votes = batch.column("votes")
    if (j := _first(pc.invert(pc.is_in(votes.flatten(), ternary)))) is not None:
        fail(_row_of_flat(votes, j), f"votes has value {votes.flatten()[j].as_py()}")
    outcome = batch.column("outcome")
    if (i := _first(pc.invert(pc.is_in(outcome, ternary, skip_nulls=True)))) is not None:
        if outcome[i].is_valid:
            fail(i, f"outcome {outcome[i].as_py()} must be -1, 0 or 1")


# ---------------------------------------------------------------- packing for the learner

@dataclass
class Packed:
    """A list column as one flat tensor plus row boundaries: row i is
    ``values[cu_seqlens[i]:cu_seqlens[i+1]]`` (the varlen layout of flash-attention)."""

    values: torch.Tensor
    cu_seqlens: torch.Tensor  # int32, len rows + 1, starts at 0


@dataclass
class PackedSequences:
    """Prompt+response token ids of every row back to back, for a packed forward pass."""

    input_ids: torch.Tensor  # int32, all rows' tokens concatenated
    cu_seqlens: torch.Tensor  # int32, len rows + 1
    response_mask: torch.Tensor  # bool per token: True where the token is a response token
    loss_mask: torch.Tensor | None  # int8 per token: the row's loss_mask on response tokens


def _list_array(data: pa.Table | pa.RecordBatch, column: str) -> pa.Array:
    col = data.column(column)
    if isinstance(col, pa.ChunkedArray):
        # Several chunks cannot be one flat buffer: combining them copies (once).
        col = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
    return col


def _to_tensor(values: pa.Array) -> torch.Tensor:
    """A tensor over the Arrow buffer (no copy for fixed-width types without nulls)."""
    import torch

    if values.type not in _PACKABLE:
        raise TypeError(f"cannot pack list<{values.type}> into a tensor")
    array = values.to_numpy(zero_copy_only=values.null_count == 0)
    # Arrow memory is immutable and torch warns about that on every call; the tensor shares
    # it, so treat it as read-only (the learner only reads ids, logprobs and masks).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def pack_column(data: pa.Table | pa.RecordBatch, column: str) -> Packed:
    """A list column as a flat tensor + ``cu_seqlens``, sharing the Arrow buffer when it can.

    No copy for a fixed-width column of a batch or one-chunk table without null rows: the
    tensor views the Arrow values buffer (read-only memory: do not write into it). Sliced
    arrays work: offsets are rebased to 0 and the values sliced to the rows in view. The dtype
    stays the Arrow one: ``loss_mask`` packs to int8, ids to int32, logprobs to float32. A
    column with null rows, or a table of several chunks, is copied once.
    """
    import torch

    arr = _list_array(data, column)
    if arr.null_count:
        lengths = _lengths(arr)
        cu = np.zeros(len(arr) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        return Packed(_to_tensor(arr.flatten()), torch.from_numpy(cu))
    offsets = arr.offsets.to_numpy()  # len rows + 1, in the coordinates of arr.values
    start, end = int(offsets[0]), int(offsets[-1])
    values = arr.values.slice(start, end - start)
    cu = (offsets - start).astype(np.int32, copy=False)  # a small new array (rows + 1)
    return Packed(_to_tensor(values), torch.from_numpy(cu))


def pack_sequences(data: pa.Table | pa.RecordBatch,
                   columns: Sequence[str] = ("prompt_ids", "response_ids")) -> PackedSequences:
    """Per row, the ids of ``columns`` concatenated (prompt then response), all rows packed.

    The last column is the response: ``response_mask`` marks its tokens, and ``loss_mask``
    (when the data has that column) carries the row's per-response-token mask at those
    positions and 0 on the prompt. This interleaves rows, so it copies the ids once.
    """
    import torch

    parts = [pack_column(data, c) for c in columns]
    lengths = [np.diff(p.cu_seqlens.numpy()).astype(np.int64) for p in parts]
    total = np.sum(lengths, axis=0) if lengths else np.zeros(0, np.int64)
    cu = np.zeros(len(total) + 1, dtype=np.int64)
    np.cumsum(total, out=cu[1:])
    out = np.empty(int(cu[-1]), dtype=np.int32)
    # Destination of element j of part k, row i: cu[i] + (tokens of earlier parts of row i)
    # + (j - part_cu[i]); built with one repeat per part, no Python loop over rows.
    before = np.zeros(len(total), dtype=np.int64)
    dest = []
    for part, n in zip(parts, lengths):
        src_cu = part.cu_seqlens.numpy().astype(np.int64)
        shift = np.repeat(cu[:-1] + before - src_cu[:-1], n)
        idx = shift + np.arange(int(src_cu[-1]), dtype=np.int64)
        out[idx] = part.values.numpy()
        dest.append(idx)
        before += n
    response = np.zeros(len(out), dtype=bool)
    response[dest[-1]] = True
    loss = None
    if "loss_mask" in data.schema.names:
        mask = pack_column(data, "loss_mask").values.numpy()
        if len(mask) != len(dest[-1]):
            raise SampleValidationError(
                f"loss_mask has {len(mask)} values in all but {columns[-1]} has {len(dest[-1])}")
        loss_np = np.zeros(len(out), dtype=np.int8)
        loss_np[dest[-1]] = mask
        loss = torch.from_numpy(loss_np)
    return PackedSequences(torch.from_numpy(out), torch.from_numpy(cu.astype(np.int32)),
                           torch.from_numpy(response), loss)


def policy_user_of(table: pa.Table) -> pa.ChunkedArray:
    """Each row's policy user: ``policy_user``, or for rows written before that column (schema
    version 1) the key's ``tenant``; null for rows of no user (the shared policy's)."""
    return pc.coalesce(table.column("policy_user"), table.column("tenant"))


# Kept on a forgotten row: the log's positions, deduplication and version accounting stay valid.
REDACT_KEEP = frozenset({"sample_id", "kind", "policy_version", "policy_version_end"})


def redact(table: pa.Table | pa.RecordBatch, mask: Sequence[bool] | np.ndarray) -> pa.Table:
    """``table`` with the rows where ``mask`` is true emptied (the right to be forgotten):
    token ids, log-probs and loss masks empty, every text, id of a person and judgement null,
    reward 0 and ``source`` "forgotten"; ``REDACT_KEEP`` columns stay. Same rows, same order,
    the same schema."""
    table = pa.Table.from_batches([table]) if isinstance(table, pa.RecordBatch) else table
    table = table.combine_chunks()
    m = pa.array(np.asarray(mask, dtype=bool))
    if len(m) != table.num_rows:
        raise ValueError(f"redact: {len(m)} flags for {table.num_rows} rows")
    columns = []
    for f in table.schema:
        col = table.column(f.name)
        if f.name in REDACT_KEEP:
            columns.append(col)
            continue
        if f.name == "source":
            blank = pa.scalar("forgotten", f.type)
        elif f.name == "reward":
            blank = pa.scalar(0.0, f.type)
        elif f.nullable:
            blank = pa.scalar(None, f.type)
        elif pa.types.is_list(f.type):
            blank = pa.scalar([], f.type)
        else:
            raise ValueError(f"redact: no blank value for the required column {f.name!r}")
        columns.append(pc.if_else(m, blank, col))
    return pa.Table.from_arrays(columns, schema=table.schema)
