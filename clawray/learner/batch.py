"""Arrow sample rows → the tensors of one packed (unpadded) forward pass and its loss.

Rows are packed back to back (``samples.pack_sequences``: prompt then response ids per row, no
padding). The logits at position ``p`` predict the token at ``p + 1``, so a response token at
``p`` is scored by the logits at ``p - 1``; ``score_positions`` holds those ``p - 1``. Every
per-token tensor below (``target_ids``, ``rollout_logprobs``, ``advantages``, ``mask``,
``seq_index``) has one entry per response token, in row order.

Advantages per row: a per-token ``advantages`` column wins, then a scalar
``advantage`` (environment rows after integration), then by ``kind``: ``rl`` broadcasts
``reward``; ``opd`` uses ``teacher − rollout``; ``combine`` uses ``w_opd·(teacher − rollout) +
w_rl·reward`` (teacher term 0 where a row has no teacher log-probs). ``sft`` rows (expert
demonstrations) are trained by negative log-likelihood instead (``PackedBatch.sft``); their
advantage is 0 and unused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from clawray.config import LossSettings
from clawray.learner.losses import combine_advantages, opd_advantages
from clawray.samples import SampleValidationError, pack_column, pack_sequences


@dataclass
class PackedBatch:
    """One micro-batch: ``T`` packed tokens, ``N`` response tokens, ``B`` rows."""

    input_ids: Tensor  # [T] int64
    position_ids: Tensor  # [T] int64, restarting at 0 for every row
    cu_seqlens: Tensor  # [B + 1] int64
    score_positions: Tensor  # [N] int64: logits index that scores each response token
    target_ids: Tensor  # [N] int64
    seq_index: Tensor  # [N] int64: the row of each response token
    mask: Tensor  # [N] bool: loss_mask
    rollout_logprobs: Tensor  # [N] float32: the engine's (behaviour) log-probs
    advantages: Tensor  # [N] float32
    num_seqs: int
    sft: Tensor | None = None  # [N] bool: tokens of ``sft`` rows (NLL), None when there are none

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def block_causal_mask(self) -> Tensor:
        """[1, 1, T, T] bool: causal within a row, nothing across rows (for SDPA/eager)."""
        return block_causal_mask(self.cu_seqlens)

    def packs(self, max_tokens: int) -> list[Pack]:
        """The rows cut into forward passes of at most ``max_tokens`` tokens each (a longer
        row goes alone), in row order: their response tokens, concatenated, are this batch's
        per-token tensors."""
        cu = self.cu_seqlens.tolist()
        out: list[Pack] = []
        a = 0
        while a < self.num_seqs:
            b = a + 1
            while b < self.num_seqs and cu[b + 1] - cu[a] <= max_tokens:
                b += 1
            t0, t1 = cu[a], cu[b]
            lo = int(torch.searchsorted(self.score_positions, t0 - 1, right=False))
            hi = int(torch.searchsorted(self.score_positions, t1 - 1, right=False))
            out.append(Pack(self.input_ids[t0:t1], self.position_ids[t0:t1],
                            self.cu_seqlens[a:b + 1] - t0, self.score_positions[lo:hi] - t0,
                            self.target_ids[lo:hi]))
            a = b
        return out


@dataclass
class Pack:
    """One forward pass over whole rows of a ``PackedBatch``."""

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    score_positions: Tensor
    target_ids: Tensor


def block_causal_mask(cu_seqlens: Tensor) -> Tensor:
    """[1, 1, T, T] bool: causal within each row of ``cu_seqlens``, nothing across rows."""
    lengths = torch.diff(cu_seqlens)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    t = int(cu_seqlens[-1] - cu_seqlens[0])
    causal = torch.ones(t, t, dtype=torch.bool).tril_()
    return (causal & (seg[:, None] == seg[None, :]))[None, None]


def _per_token_or_none(data: pa.Table, column: str) -> list[np.ndarray | None]:
    """Per row: the list column's values as float32, or None where the row holds null."""
    if column not in data.schema.names:
        return [None] * data.num_rows
    col = data.column(column).combine_chunks()
    return [None if v is None else np.asarray(v, dtype=np.float32)
            for v in col.to_pylist()]


def advantages_of(data: pa.Table, cfg: LossSettings) -> Tensor:
    """Per response token advantages of every row, concatenated (see the module docstring)."""
    rollout = pack_column(data, "rollout_logprobs")
    cu = rollout.cu_seqlens.numpy()
    old = rollout.values.to(torch.float32)
    out = torch.zeros_like(old)
    kinds = data.column("kind").to_pylist()
    rewards = data.column("reward").to_pylist()
    scalar = (data.column("advantage").to_pylist() if "advantage" in data.schema.names
              else [None] * data.num_rows)
    per_token = _per_token_or_none(data, "advantages")
    teacher = _per_token_or_none(data, "teacher_logprobs")
    for i, kind in enumerate(kinds):
        a, b = int(cu[i]), int(cu[i + 1])
        if a == b:
            continue
        if per_token[i] is not None:
            out[a:b] = torch.from_numpy(per_token[i])
        elif scalar[i] is not None:
            out[a:b] = float(scalar[i])
        elif kind == "rl":
            out[a:b] = float(rewards[i])
        elif kind == "sft":
            continue  # trained by NLL (PackedBatch.sft), not by an advantage
        elif kind in ("opd", "combine"):
            t = None if teacher[i] is None else torch.from_numpy(teacher[i])
            if kind == "opd":
                if t is None:
                    raise SampleValidationError(
                        f"row {i} ({data.column('sample_id')[i]}): kind 'opd' without "
                        "teacher_logprobs")
                out[a:b] = opd_advantages(t, old[a:b], cfg.opd_clip)
            else:
                r = torch.full((b - a,), float(rewards[i]))
                out[a:b] = combine_advantages(old[a:b], r, cfg, t)
        else:
            raise SampleValidationError(
                f"row {i}: the learner cannot train on kind {kind!r} (rl, opd, combine, sft)")
    return out


def center_rewards(data: pa.Table) -> pa.Table:
    """``data`` with the mean reward of its trainable ``rl``/``combine`` rows subtracted from
    those rows' rewards (a batch-mean baseline; live turns have no group to compare with)."""
    kinds = np.asarray(data.column("kind").to_pylist(), dtype=object)
    rewards = np.asarray(data.column("reward").to_numpy(), dtype=np.float32)
    use = ((kinds == "rl") | (kinds == "combine")) & trainable_rows(data)
    if not use.any():
        return data
    centered = np.where(use, rewards - rewards[use].mean(), rewards).astype(np.float32)
    i = data.schema.get_field_index("reward")
    return data.set_column(i, data.schema.field(i), pa.array(centered, pa.float32()))


def make_batch(data: pa.Table | pa.RecordBatch, cfg: LossSettings) -> PackedBatch:
    """Pack ``data``'s rows for one forward pass (copies the ids once, nothing else)."""
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if data.num_rows == 0:
        raise SampleValidationError("an empty batch has nothing to train on")
    seqs = pack_sequences(data)
    cu = seqs.cu_seqlens.to(torch.int64)
    lengths = torch.diff(cu)
    starts = torch.repeat_interleave(cu[:-1], lengths)
    position_ids = torch.arange(int(cu[-1]), dtype=torch.int64) - starts
    response_pos = torch.nonzero(seqs.response_mask, as_tuple=True)[0]
    if response_pos.numel() and int(position_ids[response_pos].min()) == 0:
        raise SampleValidationError("a row has an empty prompt: its first response token "
                                    "has no context to be scored from")
    resp_cu = pack_column(data, "response_ids").cu_seqlens.to(torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(data.num_rows), torch.diff(resp_cu))
    input_ids = seqs.input_ids.to(torch.int64)
    rollout = pack_column(data, "rollout_logprobs").values.to(torch.float32)
    loss_mask = seqs.loss_mask[response_pos].bool() if seqs.loss_mask is not None else \
        torch.ones(response_pos.numel(), dtype=torch.bool)
    is_sft = torch.tensor([k == "sft" for k in data.column("kind").to_pylist()], dtype=torch.bool)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        cu_seqlens=cu,
        score_positions=response_pos - 1,
        target_ids=input_ids[response_pos],
        seq_index=seq_index,
        mask=loss_mask,
        rollout_logprobs=rollout,
        advantages=advantages_of(data, cfg),
        num_seqs=data.num_rows,
        sft=is_sft[seq_index] if bool(is_sft.any()) else None,
    )


def loss_token_count(data: pa.Table) -> int:
    """Masked-in response tokens of ``data`` (the token-mean denominator)."""
    return int(pack_column(data, "loss_mask").values.sum())


def trainable_rows(data: pa.Table) -> np.ndarray:
    """Per row: whether it has at least one masked-in token."""
    packed = pack_column(data, "loss_mask")
    cu = packed.cu_seqlens.numpy().astype(np.int64)
    csum = np.concatenate([[0], np.cumsum(packed.values.numpy(), dtype=np.int64)])
    return csum[cu[1:]] - csum[cu[:-1]] > 0


def loss_seq_count(data: pa.Table) -> int:
    """Rows with at least one masked-in token (the seq-mean denominator)."""
    return int(trainable_rows(data).sum())


def shard_rows(num_rows: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous ``[start, end)`` of part ``index`` when ``num_rows`` rows split ``parts`` ways
    as evenly as possible (the first ``num_rows % parts`` parts get one more)."""
    if not 0 <= index < parts:
        raise ValueError(f"part index {index} outside [0, {parts})")
    base, extra = divmod(num_rows, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
