"""LearnerCore (one DeepSpeed rank, in this process): a step on a fixed batch lowers that
batch's loss and changes the weights; packing; metrics; bad batches."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from clawray.config import TrainingConfig
from clawray.learner.batch import loss_seq_count, loss_token_count, make_batch, shard_rows
from clawray.learner.learner import LearnerCore, combine_rank_metrics, init_distributed
from clawray.config import LossSettings
from clawray.samples import SampleValidationError, make_row, rows_to_batch
from tests.support.common import free_port
from tests.support.learner_data import sampled_rows


@pytest.fixture(scope="module")
def batch(tiny_model_path) -> pa.Table:
    return sampled_rows(tiny_model_path, 12, seed=3, max_new=10)


@pytest.fixture(scope="module")
def learner(tiny_model_path):
    init_distributed(0, 1, "127.0.0.1", free_port())

    def make(**kw) -> LearnerCore:
        return LearnerCore(tiny_model_path, TrainingConfig(**{"lr": 1e-3, **kw}))

    return make


@pytest.mark.parametrize("max_pack_tokens", [4096, 64, 16])
def test_packed_forward_matches_the_rollout_logprobs(learner, batch, max_pack_tokens):
    core = learner(zero_stage=0, max_pack_tokens=max_pack_tokens)
    if max_pack_tokens == 16:  # every row is longer: one row per pack
        assert len(make_batch(batch, LossSettings()).packs(16)) == batch.num_rows
    got = core.logprobs(batch)
    want = batch.column("rollout_logprobs").to_pylist()
    assert [len(g) for g in got] == [len(w) for w in want]
    worst = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
    assert worst < 1e-4  # rows packed back to back see nothing of each other


@pytest.mark.parametrize("stage,mini,micro", [(0, 1, 1), (1, 2, 2), (2, 1, 3)])
def test_a_step_lowers_the_batch_loss_and_changes_the_weights(learner, batch, stage, mini, micro):
    core = learner(zero_stage=stage, mini_batches=mini, micro_batches=micro)
    before = {k: v.clone() for k, v in core.module.state_dict().items()}
    first = combine_rank_metrics([core.update(batch)])
    second = combine_rank_metrics([core.update(batch)])
    assert second["loss"] < first["loss"] - 1e-3
    changed = [k for k, v in core.module.state_dict().items() if not torch.equal(v, before[k])]
    assert len(changed) == len(before)
    assert first["optimizer_steps"] == mini and first["rows"] == batch.num_rows
    assert first["tokens"] == loss_token_count(batch)
    assert first["grad_norm"] > 0 and first["tokens_per_s"] > 0
    if mini > 1:  # the second step's ratios moved away from the proximal policy
        assert abs(first["ratio_mean"] - 1.0) > 1e-4


def test_masked_tokens_do_not_train(learner, batch):
    core = learner(zero_stage=0)
    masked = batch.set_column(batch.schema.get_field_index("loss_mask"), "loss_mask",
                              pa.array([[0] * len(r) for r in
                                        batch.column("response_ids").to_pylist()],
                                       pa.list_(pa.int8())))
    before = {k: v.clone() for k, v in core.module.state_dict().items()}
    out = combine_rank_metrics([core.update(masked)])
    assert out["optimizer_steps"] == 0 and out["tokens"] == 0
    assert all(torch.equal(v, before[k]) for k, v in core.module.state_dict().items())


def test_lora_trains_only_the_adapters(learner, batch):
    core = learner(lora_rank=4, lora_alpha=8, zero_stage=0)
    trainable = {n for n, p in core.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen = {n: p.detach().clone() for n, p in core.module.named_parameters()
              if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in core.module.named_parameters()
                if p.requires_grad}
    before = core.logprobs(batch)
    # Not a comparison of the two updates' losses: the value of a clipped policy-gradient
    # objective after one Adam step of lr 1e-3 is not a monotone measure of learning (here the
    # second update's loss is the higher). What must hold is what LoRA training means: each
    # update is an optimizer step over the whole batch, the adapters move, the frozen base
    # weights stay byte-identical, and the policy the learner computes changed.
    for _ in range(2):
        out = combine_rank_metrics([core.update(batch)])
        assert out["optimizer_steps"] == 1 and out["tokens"] == loss_token_count(batch)
        assert out["grad_norm"] > 0
    # LoRA's B starts at zero (so A's first gradient is zero): after two steps every adapter
    # tensor, A and B, has moved.
    assert all(not torch.equal(p, adapters[n]) for n, p in core.module.named_parameters()
               if n in adapters)
    assert all(torch.equal(p, frozen[n]) for n, p in core.module.named_parameters()
               if n in frozen)
    after = core.logprobs(batch)
    assert max(abs(x - y) for b, a in zip(before, after) for x, y in zip(b, a)) > 1e-3
    kind, payload = core.sync_payload()
    assert kind == "lora" and payload


def test_kl_needs_no_reference_at_coefficient_zero(learner):
    core = learner(zero_stage=0)
    assert core.reference is None
    with_kl = learner(zero_stage=0, loss={"kl_coef": 0.1})
    assert with_kl.reference is not None


def test_empty_and_untrainable_batches_are_clear_errors(learner, batch):
    core = learner(zero_stage=0)
    with pytest.raises(ValueError, match="empty batch"):
        core.update(batch.slice(0, 0))
    row = make_row(sample_id="x", kind="opd", source="live", prompt_ids=[1, 2],
                   response_ids=[3], rollout_logprobs=[-1.0], policy_version=0,
                   loss_mask=[1], reward=0.0)
    with pytest.raises(SampleValidationError, match="teacher_logprobs"):
        make_batch(pa.Table.from_batches([rows_to_batch([row])]), LossSettings())


def test_counts_and_shards():
    rows = [make_row(sample_id=str(i), kind="rl", source="live", prompt_ids=[1],
                     response_ids=[2] * n, rollout_logprobs=[-1.0] * n, policy_version=0,
                     loss_mask=m, reward=1.0)
            for i, (n, m) in enumerate([(2, [1, 0]), (1, [0]), (3, [1, 1, 1]), (0, [])])]
    t = pa.Table.from_batches([rows_to_batch(rows)])
    assert loss_token_count(t) == 4 and loss_seq_count(t) == 2
    assert [shard_rows(7, 3, i) for i in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert shard_rows(1, 2, 1) == (1, 1)


def test_batch_mean_baseline_centres_only_trainable_reward_rows():
    from clawray.learner.batch import center_rewards

    def row(i, kind, reward, mask):
        return make_row(sample_id=str(i), kind=kind, source="live", prompt_ids=[1],
                        response_ids=[2, 3], rollout_logprobs=[-1.0, -1.0], policy_version=0,
                        loss_mask=mask, reward=reward,
                        teacher_logprobs=[-0.5, -0.5] if kind == "opd" else None)

    t = pa.Table.from_batches([rows_to_batch([
        row(0, "rl", 1.0, [1, 1]), row(1, "rl", -1.0, [1, 0]), row(2, "rl", -1.0, [1, 1]),
        row(3, "rl", 0.0, [0, 0]), row(4, "opd", 0.0, [1, 1])])])
    got = center_rewards(t).column("reward").to_pylist()
    mean = -1.0 / 3
    assert got == pytest.approx([1 - mean, -1 - mean, -1 - mean, 0.0, 0.0])


def test_zero3_trains_and_gathers_full_weights_for_serving(learner, batch, tiny_model_path):
    from transformers import AutoModelForCausalLM

    core = learner(zero_stage=3)
    a = combine_rank_metrics([core.update(batch)])
    b = combine_rank_metrics([core.update(batch)])
    assert b["loss"] < a["loss"]
    kind, state = core.sync_payload()  # partitioned parameters are gathered for the payload
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).state_dict()
    assert kind == "full" and set(state) == set(base)
    assert all(state[k].shape == base[k].shape for k in base)
    assert any(not torch.equal(state[k], base[k]) for k in base)
