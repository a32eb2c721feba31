"""``LearnerCore``: one DeepSpeed rank owning the policy model (no Ray here).

One ``update(table)`` is one training iteration over a batch of sample rows:

- The batch is cut into ``mini_batches`` optimizer steps; each step's rows are shared out
  among the ranks, and each rank's share into ``micro_batches`` gradient-accumulation pieces.
  Every rank receives the whole table (zero-copy from the object store) and picks its rows, so
  all ranks agree on the step's loss denominator (its masked token count) without talking.
- Each micro-batch is one packed forward (rows back to back, a block-causal mask, no padding).
  Its loss is ``sum / denominator_of_the_whole_step``, scaled by ``world × micro_batches``
  because DeepSpeed averages gradients over ranks and divides by the accumulation steps: the
  applied gradient is then exactly the whole step's token-mean (or seq-mean) gradient, so two
  ranks give the same update as one (tested).
- The PPO clip is centred on the proximal policy: the parameters at the start of the batch
  (AReaL's decoupled objective). With one mini-batch those log-probs are the current ones,
  detached; with more, one no-grad pass computes them first, so the clip acts from the second
  step on. The behaviour policy is the engine's rollout log-probs (truncated IS for stale rows).
- ``kl_coef > 0`` loads a reference (with LoRA: the same model with adapters disabled);
  ``kl_coef == 0`` loads nothing.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import Tensor

from clawray.config import TrainingConfig
from clawray.learner.batch import (PackedBatch, block_causal_mask, center_rewards, loss_seq_count,
                                   loss_token_count, make_batch, shard_rows)
from clawray.learner.losses import policy_loss
from clawray.models import lora
from clawray.samples import pack_column

logger = logging.getLogger(__name__)

# Metrics that are token-weighted means within a rank (combined across ranks by token count).
TOKEN_MEANS = ("clip_frac", "ratio_mean", "is_weight_mean", "is_truncated_frac", "kl", "entropy",
               "sft_nll")
MAXES = ("ratio_max", "is_weight_max")


def node_address() -> str:
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (``None`` if none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    return None


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int,
                     backend: str | None = None) -> None:
    """Join the DeepSpeed process group (gloo on CPU, nccl on GPU) once per process."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"this process is already rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not {rank} of {world_size}")
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo" and world_size > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        # Gloo advertises the address its host name resolves to, often 127.0.0.1 or
        # 127.0.1.1 (/etc/hosts): ranks on other hosts then connect to themselves. Use the
        # interface that holds this node's Ray address (found on two real hosts).
        iface = interface_of(node_address())
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False,
                               init_method=f"tcp://{master_addr}:{master_port}",
                               rank=rank, world_size=world_size)


def packed_logprobs(model: Any, pb: PackedBatch, *, entropy: bool = False,
                    max_tokens: int = 2048, flash: bool = False,
                    device: torch.device | str = "cpu") -> tuple[Tensor, Tensor | None]:
    """Log-prob (and entropy) of every response token of ``pb`` under ``model``.

    One forward per pack of at most ``max_tokens`` tokens: rows back to back, position ids
    restarting per row, a block-causal mask (flash-attention finds the rows from the position
    ids instead), and the LM head only at the positions that score a response token
    (``logits_to_keep``)."""
    lps, ents = [], []
    for pack in pb.packs(max_tokens):
        kwargs: dict[str, Any] = {
            "input_ids": pack.input_ids[None].to(device),
            "position_ids": pack.position_ids[None].to(device),
            "logits_to_keep": pack.score_positions.to(device),
            "use_cache": False,
        }
        if not flash:
            kwargs["attention_mask"] = block_causal_mask(pack.cu_seqlens).to(device)
        logits = model(**kwargs).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        lps.append(logp.gather(-1, pack.target_ids.to(device)[:, None])[:, 0])
        if entropy:
            ents.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(lps), (torch.cat(ents) if entropy else None)


def ds_config(cfg: TrainingConfig, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config; batch sizes count micro-batches (rows vary per micro-batch)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.micro_batches,
        "train_batch_size": cfg.micro_batches * world_size,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def with_lora(model: torch.nn.Module, cfg: TrainingConfig) -> torch.nn.Module:
    """``model`` wrapped by peft with the LoRA adapters ``training.lora_*`` asks for (the
    learner's; bench/learner.py's plain-torch baseline uses the same)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
        target_modules=cfg.lora_targets, bias="none", task_type="CAUSAL_LM"))


class LearnerCore:
    """The policy under DeepSpeed on one rank; call ``init_distributed`` first."""

    def __init__(self, model_path: str | Path, cfg: TrainingConfig, rank: int = 0,
                 world_size: int = 1) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.loss_cfg = cfg.loss
        torch.manual_seed(cfg.seed)
        use_gpu = cfg.learner_num_gpus > 0 and torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_gpu \
            else torch.device("cpu")
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        model.config.use_cache = False
        self.lora = cfg.lora_rank > 0
        self.reference = None
        if self.lora:
            model = with_lora(model, cfg)
        elif self.loss_cfg.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False).to(self.device)
        self.attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas),
                                      weight_decay=cfg.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model.to(self.device), optimizer=optimizer,
            config=ds_config(cfg, world_size), dist_init_required=False)
        self.policy_version = 0
        self.steps = 0

    # ---------------------------------------------------------------- forward

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def _forward(self, model: Any, pb: PackedBatch, entropy: bool) -> tuple[Tensor, Tensor | None]:
        return packed_logprobs(model, pb, entropy=entropy, max_tokens=self.cfg.max_pack_tokens,
                               flash=self.attn.startswith("flash"), device=self.device)

    def _reference_logprobs(self, pb: PackedBatch) -> Tensor | None:
        if self.loss_cfg.kl_coef <= 0:
            return None
        with torch.no_grad():
            if self.lora:
                with self.module.disable_adapter():
                    return self._forward(self.engine, pb, False)[0]
            return self._forward(self.reference, pb, False)[0]

    @torch.no_grad()
    def logprobs(self, data: pa.Table) -> list[list[float]]:
        """Per row, the current policy's log-prob of each response token (evaluation, tests)."""
        pb = make_batch(data, self.loss_cfg)
        lp = self._forward(self.engine, pb, False)[0].cpu().numpy()
        cu = pack_column(data, "response_ids").cu_seqlens.numpy()
        return [lp[cu[i]:cu[i + 1]].tolist() for i in range(data.num_rows)]

    def _proximal(self, data: pa.Table) -> np.ndarray | None:
        """Log-probs at the start of the batch (needed only with several mini-batches)."""
        if self.cfg.mini_batches == 1:
            return None
        with torch.no_grad():
            return self._forward(self.engine, make_batch(data, self.loss_cfg), False)[0] \
                .float().cpu().numpy()

    # ---------------------------------------------------------------- update

    def _zero_loss(self) -> Tensor:
        """A loss with zero gradient for every trainable parameter (a rank or micro-batch with
        nothing to train still takes part in the gradient collectives)."""
        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        return sum((p * 0.0).sum() for p in params)

    def _grad_norm(self) -> float:
        grads = [p.grad.detach().float().norm() for p in self.module.parameters()
                 if p.grad is not None]
        return float(torch.stack(grads).norm()) if grads else 0.0

    def update(self, data: pa.Table) -> dict[str, float]:
        """One training iteration over ``data`` (every rank gets the same table).

        Returns this rank's raw metrics; ``combine_rank_metrics`` turns one or several ranks'
        into the iteration's metrics."""
        if data.num_rows == 0:
            raise ValueError("update() got an empty batch")
        t0 = time.perf_counter()
        self.engine.train()
        if self.cfg.loss.reward_baseline == "batch_mean":
            data = center_rewards(data)
        token_cu = pack_column(data, "response_ids").cu_seqlens.numpy()
        prox_all = self._proximal(data)
        # Token-mean metrics are kept as sums (``<name>_sum``); ``combine_rank_metrics`` divides.
        acc: dict[str, float] = {"loss": 0.0, "pg_loss": 0.0, "tokens": 0.0}
        maxes: dict[str, float] = {}
        seen_tokens = 0
        my_rows = 0
        steps = 0
        grad_norms: list[float] = []
        gas = self.cfg.micro_batches
        for step in range(self.cfg.mini_batches):
            s0, s1 = shard_rows(data.num_rows, self.cfg.mini_batches, step)
            mini = data.slice(s0, s1 - s0)
            norm = (loss_token_count(mini) if self.loss_cfg.agg == "token_mean"
                    else loss_seq_count(mini))
            if norm == 0:
                continue  # the same decision on every rank: all see the same rows
            r0, r1 = shard_rows(mini.num_rows, self.world_size, self.rank)
            for k in range(gas):
                m0, m1 = shard_rows(r1 - r0, gas, k)
                lo, hi = s0 + r0 + m0, s0 + r0 + m1  # rows of ``data``
                micro = data.slice(lo, hi - lo)
                my_rows += micro.num_rows
                loss = None
                if micro.num_rows and loss_token_count(micro):
                    pb = make_batch(micro, self.loss_cfg)
                    seen_tokens += pb.num_tokens
                    lp, ent = self._forward(self.engine, pb, self.loss_cfg.entropy_coef > 0)
                    prox = None if prox_all is None else torch.from_numpy(
                        prox_all[token_cu[lo]:token_cu[hi]]).to(lp.device)
                    loss, metrics = policy_loss(
                        lp, pb.rollout_logprobs.to(lp.device), pb.advantages.to(lp.device),
                        pb.mask.to(lp.device), pb.seq_index.to(lp.device), pb.num_seqs,
                        self.loss_cfg, proximal_logprobs=prox if prox is not None else lp.detach(),
                        ref_logprobs=self._reference_logprobs(pb), entropy=ent, norm=float(norm),
                        sft_mask=None if pb.sft is None else pb.sft.to(lp.device))
                    n = metrics["tokens"]
                    acc["loss"] += metrics["loss"]
                    acc["pg_loss"] += metrics["pg_loss"]
                    acc["tokens"] += n
                    for key in TOKEN_MEANS:
                        if key in metrics:
                            acc[f"{key}_sum"] = acc.get(f"{key}_sum", 0.0) + metrics[key] * n
                    for key in MAXES:
                        maxes[key] = max(maxes.get(key, -np.inf), metrics[key])
                scaled = (loss if loss is not None else self._zero_loss()) * (self.world_size * gas)
                self.engine.backward(scaled)
                if k == gas - 1 and self.cfg.zero_stage == 0:
                    grad_norms.append(self._grad_norm())  # stage 0 does not report it
                self.engine.step()
            steps += 1
            gn = self.engine.get_global_grad_norm() if self.cfg.zero_stage else None
            if gn is not None:
                grad_norms.append(float(gn))
        self.steps += steps
        seconds = time.perf_counter() - t0
        out = {**acc, **maxes, "optimizer_steps": float(steps), "seconds": seconds,
               "packed_tokens": float(seen_tokens), "rows": float(my_rows)}
        if grad_norms:
            out["grad_norm"] = float(np.mean(grad_norms))
        return out

    # ---------------------------------------------------------------- weights, checkpoints

    def sync_payload(self, on_device: bool = False) -> tuple[str, dict[str, Any]]:
        """What serving needs: ``("full", state dict)`` or ``("lora", adapter payload)``.

        Collective under ZeRO-3 (every rank must call); the result matters on rank 0 only.
        The full state is a CPU copy, or with ``on_device`` the module's own tensors where they
        are (the NCCL sync broadcasts them from the GPU; not valid after the next update).
        """
        if self.lora:
            return "lora", lora.from_peft_model(self.module)
        ctx = nullcontext()
        if self.cfg.zero_stage == 3:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(list(self.module.parameters()))
        with ctx:
            if self.rank != 0:
                return "full", {}
            if on_device and self.cfg.zero_stage != 3:  # gathered ZeRO-3 tensors do not last
                return "full", {k: v.detach() for k, v in self.module.state_dict().items()}
            return "full", {k: v.detach().to("cpu", copy=True)
                            for k, v in self.module.state_dict().items()}

    def save(self, path: str | Path, client_state: dict[str, Any] | None = None) -> None:
        """DeepSpeed checkpoint (model, optimizer, step) plus our state; every rank calls."""
        state = {"policy_version": self.policy_version, "steps": self.steps,
                 **(client_state or {})}
        self.engine.save_checkpoint(str(path), tag="latest-state", client_state=state)

    def load(self, path: str | Path) -> dict[str, Any]:
        _, state = self.engine.load_checkpoint(str(path), tag="latest-state")
        if state is None:
            raise FileNotFoundError(f"no learner checkpoint in {path}")
        self.policy_version = int(state["policy_version"])
        self.steps = int(state["steps"])
        return state


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One metrics dict for the group: losses add up (each rank's share of one normalized
    loss), token means weigh by tokens, maxima take the max, times take the slowest rank."""
    out: dict[str, float] = {}
    tokens = sum(m.get("tokens", 0.0) for m in per_rank)
    for key in ("loss", "pg_loss", "tokens", "packed_tokens", "rows"):
        out[key] = sum(m.get(key, 0.0) for m in per_rank)
    for key in TOKEN_MEANS:
        if any(f"{key}_sum" in m for m in per_rank) and tokens:
            out[key] = sum(m.get(f"{key}_sum", 0.0) for m in per_rank) / tokens
    for key in MAXES:
        vals = [m[key] for m in per_rank if key in m]
        if vals:
            out[key] = max(vals)
    out["seconds"] = max(m.get("seconds", 0.0) for m in per_rank)
    out["optimizer_steps"] = per_rank[0].get("optimizer_steps", 0.0)
    if "grad_norm" in per_rank[0]:
        out["grad_norm"] = per_rank[0]["grad_norm"]
    if out["seconds"] > 0:
        out["tokens_per_s"] = out["packed_tokens"] / out["seconds"]
    return out
