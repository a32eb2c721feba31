"""Token-level losses and advantages for the learner, in pure torch (no Ray). Their settings
are the config's ``LossSettings`` (``training.loss``), validated there.

Every per-token input is a flat tensor of shape ``[T]`` over the *response* tokens of a packed
batch (see ``clawray.samples.pack_sequences``), with ``seq_index[T]`` naming each token's
sequence (``0..num_seqs-1``). ``mask`` is the loss mask: tokens where it is 0 contribute nothing
to a loss, a gradient or a metric, even when their log-probs are NaN or inf (inputs are
sanitized with ``torch.where`` before any arithmetic, so NaN cannot leak through a product).

Formulas: Binary RL (the reward broadcast over response tokens), OPD and combine advantages,
and AReaL's decoupled PPO (clip centred on the proximal policy)
with truncated importance sampling for stale samples; docs/training.md, "Loss choices".
"""

from __future__ import annotations


import torch
from torch import Tensor

from clawray.config import LossSettings

# k3 KL bounds: the log-ratio ref - cur is clamped to +-K3_LOG_RATIO_MAX, the term to K3_MAX.
K3_LOG_RATIO_MAX = 20.0
K3_MAX = 10.0


# ---------------------------------------------------------------- helpers

def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over tokens where ``mask`` is set (0 when none are); NaN-safe off-mask."""
    m = mask.bool()
    return torch.where(m, x, torch.zeros_like(x)).sum() / m.sum().clamp(min=1)


def aggregate(per_token: Tensor, mask: Tensor, seq_index: Tensor, num_seqs: int,
              agg: str, norm: float | None = None) -> Tensor:
    """Reduce a per-token loss to a scalar.

    ``token_mean``: sum(loss * mask) / sum(mask) over the whole batch, so long sequences weigh
    more. ``seq_mean``: each sequence's token-mean, averaged over the sequences holding at least
    one masked-in token, so every sequence weighs the same whatever its length.

    ``norm`` replaces the denominator (the masked token count, or the count of sequences with
    tokens): a learner splitting one batch into micro-batches and ranks passes the whole
    batch's count, so the pieces' gradients add up to exactly the whole batch's.
    """
    m = mask.bool()
    x = torch.where(m, per_token, torch.zeros_like(per_token))
    if norm is not None and not norm > 0:
        raise ValueError(f"norm must be > 0, got {norm}")
    if agg == "token_mean":
        return x.sum() / (m.sum().clamp(min=1) if norm is None else norm)
    if agg != "seq_mean":
        raise ValueError(f"unknown aggregation {agg!r}")
    idx = seq_index.to(torch.long)
    sums = x.new_zeros(num_seqs).index_add(0, idx, x)
    counts = x.new_zeros(num_seqs).index_add(0, idx, m.to(x.dtype))
    has = counts > 0
    per_seq = sums[has] / counts[has]
    return per_seq.mean() if norm is None else per_seq.sum() / norm


def _check_tokens(mask: Tensor, seq_index: Tensor, num_seqs: int, **flat: Tensor | None) -> Tensor:
    """Shape checks shared by the losses; returns the boolean mask."""
    n = mask.shape[0] if mask.dim() == 1 else -1
    if n < 0:
        raise ValueError(f"mask must be 1-D [T], got shape {tuple(mask.shape)}")
    for name, t in {"seq_index": seq_index, **flat}.items():
        if t is not None and t.shape[:1] != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [{n}] (one per token)")
    m = mask.bool()
    if n == 0 or not bool(m.any()):
        raise ValueError(f"no tokens with loss_mask=1 in the batch ({n} tokens): nothing to train")
    if bool((seq_index < 0).any()) or bool((seq_index >= num_seqs).any()):
        raise ValueError(f"seq_index must lie in [0, {num_seqs})")
    return m


def _clean(x: Tensor, m: Tensor, fill: float = 0.0) -> Tensor:
    """``x`` with off-mask entries replaced (NaN/inf there must not reach any arithmetic)."""
    keep = m if x.dim() == 1 else m.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, x, torch.full_like(x, fill))


# ---------------------------------------------------------------- policy gradient

def policy_loss(logprobs: Tensor, rollout_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                seq_index: Tensor, num_seqs: int, cfg: LossSettings,
                proximal_logprobs: Tensor | None = None, ref_logprobs: Tensor | None = None,
                entropy: Tensor | None = None, norm: float | None = None,
                sft_mask: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO loss (AReaL) with asymmetric clip, truncated IS, optional k3 KL and entropy.

    ``rollout_logprobs`` are the engine's behaviour log-probs, never recomputed. The clip is
    centred on ``proximal_logprobs`` (the parameters before this update, detached); without
    them it is centred on the behaviour policy (standard PPO). Per token::

        u = exp(logprobs - prox)
        surrogate = min(u * A, clip(u, 1 - clip_low, 1 + clip_high) * A)
        w = min(exp(prox - rollout), tis_cap)      # detached; tis_cap None: not truncated
        loss = -w * surrogate + kl_coef * k3 - entropy_coef * entropy
        k3 = min(exp(d) - d - 1, 10),  d = clamp(ref - logprobs, -20, 20)

    ``w`` is 1 for fresh samples; tokens of stale samples, generated by an older policy version
    than the proximal one, get ``w != 1`` and far-off-policy tokens are capped at ``tis_cap``.
    The KL term needs ``ref_logprobs`` only when ``kl_coef > 0`` (otherwise they are ignored and
    no reference model need be loaded). Aggregation follows ``cfg.agg`` (see ``aggregate``).
    Metrics are token means over masked-in tokens; ``is_weight_*`` are the applied weights.
    ``norm`` is passed to ``aggregate`` (micro-batches of a larger batch). Tokens where
    ``sft_mask`` is true (expert demonstrations) take the negative log-likelihood ``-logprobs``
    instead of the policy-gradient term (no ratio, clip or importance weight).
    """
    m = _check_tokens(mask, seq_index, num_seqs, logprobs=logprobs,
                      rollout_logprobs=rollout_logprobs, advantages=advantages,
                      proximal_logprobs=proximal_logprobs, ref_logprobs=ref_logprobs,
                      entropy=entropy)
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs (log-probs of the reference model)")

    lp = _clean(logprobs, m)
    behav = _clean(rollout_logprobs.detach(), m)
    prox = behav if proximal_logprobs is None else _clean(proximal_logprobs.detach(), m)
    adv = _clean(advantages.detach(), m)

    ratio = torch.exp(lp - prox)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * adv
    use_clip = clipped < unclipped  # ties keep the unclipped branch (and its gradient)
    surrogate = torch.where(use_clip, clipped, unclipped)

    raw_w = torch.exp(prox - behav)
    weight = raw_w if cfg.tis_cap is None else raw_w.clamp(max=cfg.tis_cap)
    pg = -weight * surrogate
    metrics: dict[str, float] = {}
    if sft_mask is not None:
        sft = sft_mask.to(m.device) & m
        pg = torch.where(sft, -lp, pg)
        if bool(sft.any()):
            metrics["sft_nll"] = masked_mean(-lp, sft).item()
    per_token = pg

    if cfg.kl_coef > 0:
        # Clamped like verl's low_var_kl: k3 grows as exp(ref - cur), so one token the policy
        # has all but ruled out (ref far above cur) would otherwise swamp the batch's loss.
        diff = (_clean(ref_logprobs.detach(), m) - lp).clamp(-K3_LOG_RATIO_MAX, K3_LOG_RATIO_MAX)
        k3 = (torch.exp(diff) - diff - 1.0).clamp(max=K3_MAX)
        per_token = per_token + cfg.kl_coef * k3
        metrics["kl"] = masked_mean(k3, m).item()
    if entropy is not None:
        ent = _clean(entropy, m)
        per_token = per_token - cfg.entropy_coef * ent
        metrics["entropy"] = masked_mean(ent, m).item()

    loss = aggregate(per_token, m, seq_index, num_seqs, cfg.agg, norm)
    with torch.no_grad():
        n = m.sum()
        on = ratio[m]
        metrics.update(
            loss=loss.item(),
            pg_loss=aggregate(pg, m, seq_index, num_seqs, cfg.agg, norm).item(),
            clip_frac=((use_clip & m).sum() / n).item(),
            ratio_mean=on.mean().item(),
            ratio_max=on.max().item(),
            is_weight_mean=weight[m].mean().item(),
            is_weight_max=weight[m].max().item(),
            is_truncated_frac=(0.0 if cfg.tis_cap is None
                               else ((raw_w > cfg.tis_cap) & m).sum().item() / n.item()),
            tokens=float(n.item()),
        )
    return loss, metrics


# ---------------------------------------------------------------- advantages

def opd_advantages(teacher_logprobs: Tensor, rollout_logprobs: Tensor,
                   clip: float | None = None) -> Tensor:
    """OPD token advantage ``teacher - rollout``, clamped to [-clip, clip]."""
    if clip is not None and not clip > 0:
        raise ValueError(f"opd clip must be > 0 or None, got {clip}")
    adv = teacher_logprobs.detach() - rollout_logprobs.detach()
    return adv if clip is None else adv.clamp(-clip, clip)


def combine_advantages(rollout_logprobs: Tensor, reward_per_token: Tensor, cfg: LossSettings,
                       teacher_logprobs: Tensor | None = None,
                       has_teacher: Tensor | None = None) -> Tensor:
    """``A_t = w_opd * (teacher_t - old_t) + w_rl * r`` (the ``combine`` sample kind).

    Hint and score: both terms. Hint only: pass ``r = 0``. Score only (no teacher): pass
    ``teacher_logprobs=None``, or mark the rows with ``has_teacher`` False per token; those
    tokens get ``w_rl * r`` alone, whatever (even NaN) their teacher entries hold.
    """
    adv = cfg.w_rl * reward_per_token.detach().to(rollout_logprobs.dtype)
    if teacher_logprobs is None:
        return adv
    if teacher_logprobs.shape != rollout_logprobs.shape:
        raise ValueError(f"teacher_logprobs has shape {tuple(teacher_logprobs.shape)}, "
                         f"rollout_logprobs {tuple(rollout_logprobs.shape)}")
    opd = opd_advantages(teacher_logprobs, rollout_logprobs, cfg.opd_clip)
    if has_teacher is not None:
        opd = torch.where(has_teacher.bool(), opd, torch.zeros_like(opd))
    return adv + cfg.w_opd * opd
