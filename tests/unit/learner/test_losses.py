"""Losses and advantages against hand-computed values on tiny tensors (arithmetic in comments)."""

from __future__ import annotations

import math

import pytest
import torch

from clawray.config import LossSettings
from clawray.learner.losses import aggregate, combine_advantages, opd_advantages, policy_loss

D = torch.float64


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=D)


def ones_mask(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.int8)


def zeros_idx(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.long)


# ---------------------------------------------------------------- policy_loss

def test_on_policy_loss_is_minus_mean_advantage_and_gradient_matches():
    # logprobs == rollout: u = 1, w = 1, nothing clipped; token 3 is masked out.
    # loss = -(1 - 2 + 3) / 3 = -2/3; d loss / d logprobs = -A * mask / 3 = [-1/3, 2/3, -1, 0]
    rollout = t(-1.0, -2.0, -0.5, -3.0)
    lp = rollout.clone().requires_grad_()
    adv = t(1.0, -2.0, 3.0, 5.0)
    mask = torch.tensor([1, 1, 1, 0], dtype=torch.int8)
    loss, m = policy_loss(lp, rollout, adv, mask, torch.tensor([0, 0, 1, 1]), 2, LossSettings())
    loss.backward()
    assert loss.item() == pytest.approx(-2 / 3)
    assert m["loss"] == pytest.approx(-2 / 3) and m["pg_loss"] == pytest.approx(-2 / 3)
    assert m["clip_frac"] == 0.0 and m["tokens"] == 3.0
    assert m["ratio_mean"] == pytest.approx(1.0) and m["is_weight_mean"] == pytest.approx(1.0)
    assert torch.allclose(lp.grad, t(-1 / 3, 2 / 3, -1.0, 0.0))


def test_sft_tokens_take_the_nll_without_ratio_clip_or_importance_weight():
    # Tokens 0-1 are an expert demonstration (NLL), token 2 an rl token (advantage 2).
    # The rollout log-probs of sft tokens are placeholders (0) and must not matter.
    lp = t(-1.0, -2.0, -0.5).requires_grad_()
    rollout = t(0.0, 0.0, -0.5)
    adv = t(0.0, 0.0, 2.0)
    sft = torch.tensor([True, True, False])
    loss, m = policy_loss(lp, rollout, adv, ones_mask(3), torch.tensor([0, 0, 1]), 2,
                          LossSettings(), sft_mask=sft)
    loss.backward()
    assert loss.item() == pytest.approx((1.0 + 2.0 - 2.0) / 3)
    assert m["sft_nll"] == pytest.approx(1.5)
    assert torch.allclose(lp.grad, t(-1 / 3, -1 / 3, -2 / 3))


def test_asymmetric_clip_bounds_exactly():
    # rollout = -2, u = exp(lp - rollout) = [1.25, 1.3, 0.85, 0.75], A = [+1, +1, -1, -1].
    # A>0: clipped above 1 + 0.28 = 1.28 -> 1.25 kept (loss -1.25), 1.3 clipped (loss -1.28).
    # A<0: clipped below 1 - 0.2 = 0.8 -> 0.85 kept (loss +0.85), 0.75 clipped (loss +0.80).
    # loss = (-1.25 - 1.28 + 0.85 + 0.80) / 4 = -0.88 / 4 = -0.22; clip_frac = 2/4
    # grad of kept tokens = -u*A/4: [-0.3125, 0, 0.2125, 0]; clipped tokens get 0.
    u = t(1.25, 1.3, 0.85, 0.75)
    rollout = torch.full((4,), -2.0, dtype=D)
    lp = (rollout + u.log()).requires_grad_()
    loss, m = policy_loss(lp, rollout, t(1, 1, -1, -1), ones_mask(4), zeros_idx(4), 1,
                          LossSettings())
    loss.backward()
    assert loss.item() == pytest.approx(-0.22)
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["ratio_max"] == pytest.approx(1.3)
    assert m["ratio_mean"] == pytest.approx((1.25 + 1.3 + 0.85 + 0.75) / 4)
    assert torch.allclose(lp.grad, t(-0.3125, 0.0, 0.2125, 0.0))


def test_clip_acts_only_in_the_direction_of_the_advantage():
    # u = 1.3 with A = -1: min(-1.3, -1.28) = -1.3 (unclipped): loss 1.3, grad -u*A/2 = 0.65.
    # u = 0.75 with A = +1: min(0.75, 0.8) = 0.75 (unclipped): loss -0.75, grad -0.375.
    # loss = (1.3 - 0.75) / 2 = 0.275
    rollout = t(-1.0, -1.0)
    lp = (rollout + t(1.3, 0.75).log()).requires_grad_()
    loss, m = policy_loss(lp, rollout, t(-1, 1), ones_mask(2), zeros_idx(2), 1, LossSettings())
    loss.backward()
    assert loss.item() == pytest.approx(0.275)
    assert m["clip_frac"] == 0.0
    assert torch.allclose(lp.grad, t(0.65, -0.375))


def test_stale_sample_gets_truncated_behaviour_weight():
    # rollout (behaviour) = -1; proximal = [-0.5, -1, 0.5] -> raw w = [e^0.5, 1, e^1.5]
    # = [1.648721, 1, 4.481689]; tis_cap 2 -> [1.648721, 1, 2]. logprobs == proximal: u = 1.
    # A = 1: loss = -(1.648721 + 1 + 2) / 3 = -1.549574; truncated 1 of 3 tokens.
    rollout = t(-1.0, -1.0, -1.0)
    prox = t(-0.5, -1.0, 0.5)
    lp = prox.clone().requires_grad_()
    loss, m = policy_loss(lp, rollout, t(1, 1, 1), ones_mask(3), zeros_idx(3), 1, LossSettings(),
                          proximal_logprobs=prox)
    loss.backward()
    w = (math.exp(0.5), 1.0, 2.0)
    assert loss.item() == pytest.approx(-sum(w) / 3)
    assert m["is_truncated_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_weight_mean"] == pytest.approx(sum(w) / 3)
    assert torch.allclose(lp.grad, -t(*w) / 3)  # d(-w*u*A)/dlp = -w*u*A/3, w detached
    # No cap: the raw weights, nothing truncated: -(1.648721 + 1 + 4.481689) / 3
    loss, m = policy_loss(prox, rollout, t(1, 1, 1), ones_mask(3), zeros_idx(3), 1,
                          LossSettings(tis_cap=None), proximal_logprobs=prox)
    assert loss.item() == pytest.approx(-(math.exp(0.5) + 1 + math.exp(1.5)) / 3)
    assert m["is_truncated_frac"] == 0.0


def test_masked_nan_tokens_change_nothing():
    # The on-policy case above plus two masked tokens holding NaN/inf everywhere.
    nan, inf = float("nan"), float("inf")
    rollout = t(-1.0, -2.0, -0.5, nan, inf)
    lp = t(-1.0, -2.0, -0.5, nan, -inf).requires_grad_()
    adv = t(1.0, -2.0, 3.0, nan, inf)
    mask = torch.tensor([1, 1, 1, 0, 0])
    cfg = LossSettings(kl_coef=0.1, entropy_coef=0.01)
    ref = t(-1.0, -2.0, -0.5, nan, nan)  # equal to lp on masked-in tokens: k3 = 0
    ent = t(0.0, 0.0, 0.0, nan, inf)
    loss, m = policy_loss(lp, rollout, adv, mask, torch.tensor([0, 0, 0, 1, 1]), 2, cfg,
                          proximal_logprobs=rollout, ref_logprobs=ref, entropy=ent)
    loss.backward()
    assert loss.item() == pytest.approx(-2 / 3)
    assert all(math.isfinite(v) for v in m.values())
    assert torch.isfinite(lp.grad).all()
    assert torch.allclose(lp.grad, t(-1 / 3, 2 / 3, -1.0, 0.0, 0.0))


def test_token_mean_and_seq_mean_differ_on_unequal_lengths():
    # On-policy, per-token loss = -A. seq 0: A = [1, 1, 1]; seq 1: A = [4]; seq 2: one masked
    # token (A = 100); seq 3: no tokens at all.
    # token_mean = -(1 + 1 + 1 + 4) / 4 = -1.75
    # seq_mean = mean(-1, -4) = -2.5 (seq 2 and 3 hold no masked-in token and are skipped)
    rollout = t(-1.0, -1.0, -1.0, -1.0, -1.0)
    adv = t(1.0, 1.0, 1.0, 4.0, 100.0)
    mask = torch.tensor([1, 1, 1, 1, 0])
    idx = torch.tensor([0, 0, 0, 1, 2])
    tok, _ = policy_loss(rollout, rollout, adv, mask, idx, 4, LossSettings(agg="token_mean"))
    seq, m = policy_loss(rollout, rollout, adv, mask, idx, 4, LossSettings(agg="seq_mean"))
    assert tok.item() == pytest.approx(-1.75)
    assert seq.item() == pytest.approx(-2.5)
    assert m["pg_loss"] == pytest.approx(-2.5)


def test_k3_kl_value_and_missing_reference():
    # A = 0, so only the KL term. diff = ref - lp = [-0.5, 1]
    # k3 = exp(diff) - diff - 1 = [e^-0.5 - 0.5, e - 2] = [0.106531, 0.718282]; mean 0.412406
    # loss = 0.1 * 0.412406 = 0.0412406; d k3 / d lp = 1 - exp(diff) -> grad 0.1/2 * that.
    lp = t(-1.0, -2.0).requires_grad_()
    ref = t(-1.5, -1.0)
    cfg = LossSettings(kl_coef=0.1)
    loss, m = policy_loss(lp, lp.detach(), t(0, 0), ones_mask(2), zeros_idx(2), 1, cfg,
                          ref_logprobs=ref)
    loss.backward()
    k3 = (math.exp(-0.5) - 0.5, math.e - 2)
    assert m["kl"] == pytest.approx(sum(k3) / 2)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2)
    assert torch.allclose(lp.grad, 0.05 * (1 - t(math.exp(-0.5), math.e)))
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprobs"):
        policy_loss(lp, lp.detach(), t(0, 0), ones_mask(2), zeros_idx(2), 1, cfg)
    # kl_coef == 0: the reference is ignored entirely (no term, no metric).
    loss, m = policy_loss(lp, lp.detach(), t(0, 0), ones_mask(2), zeros_idx(2), 1, LossSettings(),
                          ref_logprobs=ref)
    assert loss.item() == 0.0 and "kl" not in m


def test_entropy_bonus_lowers_the_loss():
    # A = 0; entropy [2, 4], coef 0.01: loss = -0.01 * (2 + 4) / 2 = -0.03; d/d entropy = -0.005
    ent = t(2.0, 4.0).requires_grad_()
    lp = t(-1.0, -1.0)
    loss, m = policy_loss(lp, lp, t(0, 0), ones_mask(2), zeros_idx(2), 1,
                          LossSettings(entropy_coef=0.01), entropy=ent)
    loss.backward()
    assert loss.item() == pytest.approx(-0.03)
    assert m["entropy"] == pytest.approx(3.0)
    assert torch.allclose(ent.grad, t(-0.005, -0.005))


def test_empty_and_all_masked_batches_are_rejected():
    e = torch.zeros(0, dtype=D)
    with pytest.raises(ValueError, match="no tokens with loss_mask=1"):
        policy_loss(e, e, e, torch.zeros(0, dtype=torch.int8), zeros_idx(0), 0, LossSettings())
    lp = t(-1.0, -1.0)
    with pytest.raises(ValueError, match="no tokens with loss_mask=1"):
        policy_loss(lp, lp, t(1, 1), torch.zeros(2), zeros_idx(2), 1, LossSettings())


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_loss(t(-1, -1), t(-1, -1), t(1), ones_mask(2), zeros_idx(2), 1, LossSettings())


# ---------------------------------------------------------------- advantages and helpers

def test_opd_advantages_with_and_without_clip():
    # teacher - rollout = [-1 + 2, -0.2 + 1, -5 + 1] = [1, 0.8, -4]; clip 2 -> [1, 0.8, -2]
    teacher, rollout = t(-1.0, -0.2, -5.0), t(-2.0, -1.0, -1.0)
    assert torch.allclose(opd_advantages(teacher, rollout), t(1.0, 0.8, -4.0))
    assert torch.allclose(opd_advantages(teacher, rollout, clip=2.0), t(1.0, 0.8, -2.0))


def test_combine_advantages_follows_the_reference_table():
    teacher, rollout = t(-1.0, -0.2, -5.0), t(-2.0, -1.0, -1.0)  # OPD term [1, 0.8, -4]
    cfg = LossSettings(w_opd=0.5, w_rl=2.0)
    # hint + score r = 1: 0.5 * [1, 0.8, -4] + 2 * 1 = [2.5, 2.4, 0]
    assert torch.allclose(combine_advantages(rollout, t(1, 1, 1), cfg, teacher), t(2.5, 2.4, 0))
    # hint only (r = 0): [0.5, 0.4, -2]
    assert torch.allclose(combine_advantages(rollout, t(0, 0, 0), cfg, teacher),
                          t(0.5, 0.4, -2.0))
    # score only (no teacher), r = -1: 2 * -1 = -2 everywhere
    assert torch.allclose(combine_advantages(rollout, t(-1, -1, -1), cfg), t(-2, -2, -2))
    # Mixed batch: the last token's row has no teacher (its entry is NaN) -> only w_rl * r.
    mixed = t(-1.0, -0.2, float("nan"))
    got = combine_advantages(rollout, t(1, 1, 1), cfg, mixed, torch.tensor([True, True, False]))
    assert torch.allclose(got, t(2.5, 2.4, 2.0))
    # opd_clip from the config: [1, 0.8, -4] -> [1, 0.8, -1]; 0.5 * that + 0
    clipped = LossSettings(w_opd=0.5, w_rl=2.0, opd_clip=1.0)
    assert torch.allclose(combine_advantages(rollout, t(0, 0, 0), clipped, teacher),
                          t(0.5, 0.4, -0.5))


def test_aggregate_seq_mean_ignores_sequences_without_tokens():
    # seq 0: [1, 3] -> 2; seq 1: [10] -> 10; seq_mean = 6, token_mean = 14 / 3
    x, mask, idx = t(1.0, 3.0, 10.0), ones_mask(3), torch.tensor([0, 0, 2])
    assert aggregate(x, mask, idx, 3, "seq_mean").item() == pytest.approx(6.0)
    assert aggregate(x, mask, idx, 3, "token_mean").item() == pytest.approx(14 / 3)


# ---------------------------------------------------------------- config

@pytest.mark.parametrize("kwargs, message", [
    ({"clip_low": 0.0}, "clip_low"),
    ({"clip_low": 1.0}, "clip_low"),
    ({"clip_high": 0.0}, "clip_high"),
    ({"clip_high": float("inf")}, "clip_high"),
    ({"tis_cap": 0.5}, "tis_cap"),
    ({"agg": "sum"}, "agg"),
    ({"kl_coef": -0.1}, "kl_coef"),
    ({"entropy_coef": -1.0}, "entropy_coef"),
    ({"w_opd": float("nan")}, "w_opd"),
    ({"w_rl": -1.0}, "w_rl"),
    ({"opd_clip": 0.0}, "opd_clip"),
    ({"tis_cap": float("nan")}, "tis_cap"),
])
def test_loss_settings_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LossSettings(**kwargs)


def test_loss_settings_defaults():
    cfg = LossSettings()
    assert (cfg.clip_low, cfg.clip_high, cfg.tis_cap, cfg.agg) == (0.2, 0.28, 2.0, "token_mean")
    assert LossSettings(tis_cap=None).tis_cap is None


def test_k3_kl_is_bounded_when_the_policy_rules_out_a_reference_token():
    from clawray.learner.losses import K3_MAX

    lp = torch.tensor([-30.0, -1.0], requires_grad=True)  # token 0: near impossible now
    ref = torch.tensor([-0.1, -1.0])
    cfg = LossSettings(kl_coef=1.0)
    loss, metrics = policy_loss(lp, lp.detach(), torch.zeros(2), torch.ones(2),
                                torch.zeros(2, dtype=torch.long), 1, cfg, ref_logprobs=ref)
    assert metrics["kl"] == pytest.approx(K3_MAX / 2)  # (10 + 0) / 2 tokens
    assert torch.isfinite(loss) and loss.item() == pytest.approx(K3_MAX / 2)
