r"""``clawray rm-sft``: a supervised warm start for RLAnything's step-wise reward model.

Co-training the RM (``clawray/rlanything/rm_cotrainer.py``) rewards its verdicts for agreeing with outcomes, so it
needs an RM that already writes a verdict: the untrained embedded model never ends with a
``\boxed{}``, every scoring is unparseable and co-training gets no signal. This warm start
teaches the verdict format and a first notion of progress from the environment's step oracle:

1. ``n_tasks`` seeded tasks (params up to ``max_difficulty`` of the box, seed ``sft.seed +
   TASK_SEED_OFFSET``: none of them is among the policy's SFT tasks or the held-out ones) are
   played by the POLICY model (``policy_path``, e.g. ``clawray sft``'s result) at the runners'
   sampling settings; every step becomes a ``StepContext`` (``steps.py``) with its oracle
   label. An imperfect policy makes both progress and no-progress steps; where it makes fewer
   than ``MIN_PROGRESS`` progress steps, the expert's action at states the policy visited is
   added (``steps.expert_alternatives``, ``collect_steps``).
2. Each step becomes an ``sft`` row (``rm_sft_rows``): the prompt is the step-RM request
   templated exactly as the JudgeServer templates it, the response ``\boxed{1}`` (progress) or
   ``\boxed{-1}`` then ``<|im_end|>``; classes are balanced, labels optionally flipped
   (``label_noise``, to study a noisy warm start).
3. ``sft.steps`` NLL steps of ``sft.batch_size`` rows at ``sft.lr`` through the same learner as
   ``clawray sft``, stopped early on the validation pool (``select_every``, recipe 5): every
   ``select_every`` steps the RM is rated on the steps of ``select_tasks`` validation-pool
   tasks the policy played (``verdict_probabilities``: the chance that one vote at
   ``rlanything.temperature`` is the oracle's verdict, balanced over the two classes), and the
   best-rated weights are kept. The same recipe trained to its last step scored 0.753 on one
   build and 0.518 (chance) on another that differed only in torch's thread count
   (docs/rlanything.md); a fixed step count overtrains some builds. The model is saved as
   ``<sft.cache_dir>/rm-sft-<key>``, keyed by the base model's files, the policy folder and
   every setting that changes the result, so a second run returns it at once.
4. ``sft.eval_tasks`` tasks of the TEST pool (no setting is chosen on them) are played by the
   policy and their steps scored ``rlanything.m`` times by the base and by the warm-started
   RM (``rm_step_accuracy``); both results go to the info file (``rm_before`` /
   ``rm_after``), with the last step's weights (``rm_last``) where early stopping kept
   another step's, so each build shows what the stopping did.

Point ``rlanything.rm_model_path`` at the printed folder to co-train from it. The base model
is ``model.path`` (or ``base=``); ``rlanything.rm_model_path`` is never read here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from clawray.config import ClawRayConfig
from clawray.envs import make_family
from clawray.envs.rollout import render_prompt
from clawray.models.chat_template import IM_END
from clawray.models.loader import load_tokenizer, policy_model_info, resolve_model_path
from clawray.rlanything.steps import (StepContext, expert_alternatives, step_contexts,
                                      step_rm_request)
from clawray.samples import make_row
from clawray.training.evaluate import play_tasks, rm_step_accuracy
from clawray.training.sft import (EVAL_SEED_OFFSET, Selection, SFTResult, cached_result,
                                  demo_tasks, files_digest, learner_settings, pools, save_result,
                                  train_sft, write_model)

logger = logging.getLogger(__name__)
RECIPE = "5"  # 5: stopped early on validation-pool steps, reported on the test pool. Bump when the rows, the step collection or the training recipe change
# The RM learns from tasks of a stream of their own: with the policy's seed they were the first
# n of the policy's own SFT tasks, where it plays like the expert it imitated (recipe 1).
TASK_SEED_OFFSET = 2_000_003
# The test-pool steps that report the RM: a seed stream of their own, so they differ from the
# validation steps even where task pools are off.
TEST_SEED_OFFSET = 3_000_017
MAX_IMBALANCE = 2  # the majority class keeps at most this many rows per minority row
# Progress steps are added only while the policy's own are fewer than this: added ones made the
# warm start less stable across SFT seeds than the policy's own steps alone
# (docs/rlanything.md, docs/results/rm_probe_sources.json).
MIN_PROGRESS = 50


def verdict(progress: bool) -> str:
    r"""The RM's target answer for a step: ``\boxed{1}`` for progress, else ``\boxed{-1}``."""
    return "\\boxed{1}" if progress else "\\boxed{-1}"


def collect_steps(policy_path: str | Path, cfg: ClawRayConfig, n_tasks: int,
                  max_difficulty: float, seed: int,
                  pool: str | None = None) -> list[StepContext]:
    """The steps of ``n_tasks`` seeded tasks (of ``pool`` when given) played by the policy at ``policy_path`` (sampling
    at ``environments.temperature``, episode ``i`` seeded ``seed + i``), in task order.

    If fewer than ``MIN_PROGRESS`` steps made progress (a weak policy), progress steps are
    added: the expert's action at the states the policy visited (``expert_alternatives``), one
    episode at a time, until there are enough or the episodes run out; ``rm_sft_rows`` then
    keeps at most ``MAX_IMBALANCE`` no-progress rows per progress row. Recipe 1 added whole
    expert episodes until progress steps were a third, so most progress steps came from expert
    trajectories; with clean labels it gave 0.97 / 0.55 / 0.97 balanced accuracy on held-out
    steps by SFT seed, the policy's own steps alone 0.97 in all three (``scripts/rm_probe.py``,
    docs/rlanything.md)."""
    e = cfg.environments_cfg
    family = make_family(e.family, **e.family_kwargs)
    tasks = demo_tasks(family, n_tasks, max_difficulty, seed, pool)
    episodes = play_tasks(Path(policy_path), cfg, tasks, seed=seed)
    contexts = [c for ep in episodes for c in step_contexts(ep)]
    plus = sum(c.progress for c in contexts)
    for ep in episodes:
        if plus >= MIN_PROGRESS:
            break
        added = [c for c in expert_alternatives(family, ep) if c.progress]
        contexts += added
        plus += len(added)
    return contexts


def rm_prompt(ctx: StepContext, tokenizer: Any, history_window: int | None) -> list[int]:
    """The ids of the step-RM request for ``ctx`` as the JudgeServer templates it."""
    return render_prompt(tokenizer, step_rm_request(ctx, history_window).messages, None)


def rm_sft_rows(contexts: list[StepContext], tokenizer: Any, history_window: int | None,
                label_noise: float = 0.0, seed: int = 0) -> list[dict[str, Any]]:
    r"""One ``sft`` row per kept step: prompt ids = the JudgeServer's template of
    ``step_rm_request(ctx, history_window).messages`` (``JudgeCore.template``: chat template
    with a generation prompt, encoded without special tokens), response = ``verdict`` of the
    oracle label, flipped with probability ``label_noise``, then ``<|im_end|>``.

    Balance: the class (by oracle label) with more steps is subsampled (seeded) to at most
    ``MAX_IMBALANCE`` times the other, so the RM cannot score well by always answering the
    common verdict; the kept rows stay in ``contexts`` order. Both classes must occur."""
    if not 0.0 <= label_noise <= 1.0:
        raise ValueError(f"label_noise must be a probability in [0, 1], got {label_noise}")
    rng = random.Random(seed)
    by_class = {True: [i for i, c in enumerate(contexts) if c.progress],
                False: [i for i, c in enumerate(contexts) if not c.progress]}
    if not by_class[True] or not by_class[False]:
        raise ValueError(f"RM SFT needs progress and no-progress steps; got "
                         f"{len(by_class[True])} and {len(by_class[False])}")
    cap = MAX_IMBALANCE * min(len(v) for v in by_class.values())
    keep = sorted(i for v in by_class.values()
                  for i in (rng.sample(v, cap) if len(v) > cap else v))
    end = tokenizer.convert_tokens_to_ids(IM_END)
    rows = []
    for n, i in enumerate(keep):
        ctx = contexts[i]
        label = ctx.progress != (rng.random() < label_noise)
        response = tokenizer.encode(verdict(label), add_special_tokens=False) + [end]
        rows.append(make_row(
            sample_id=f"rm-sft/{i}", kind="sft", source="env", trajectory_id=f"rm-sft-{n}",
            step=ctx.step,
            prompt_ids=rm_prompt(ctx, tokenizer, history_window),
            response_ids=response, rollout_logprobs=[0.0] * len(response), policy_version=0,
            loss_mask=[1] * len(response), reward=1.0 if label else -1.0))
    return rows


def verdict_probabilities(model: Any, tokenizer: Any, prompts: list[list[int]],
                          temperature: float) -> np.ndarray:
    r"""``(len(prompts), 2)``: the chance that one sampled answer after each prompt is exactly
    ``\boxed{1}`` (column 0) or ``\boxed{-1}`` (column 1) at ``temperature``, by teacher
    forcing (log-softmax of the logits divided by ``temperature``, summed over the verdict's
    tokens; top-p is ignored). An answer that writes its verdict another way counts as
    neither, so the two columns bound the verdicts from below."""
    import torch

    verdicts = [tokenizer.encode(verdict(v), add_special_tokens=False) for v in (True, False)]
    device = next(model.parameters()).device
    out = np.zeros((len(prompts), 2))
    for i, prompt in enumerate(prompts):
        seqs = [prompt + v for v in verdicts]
        width = max(map(len, seqs))
        ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs], device=device)
        # Logits only from the prompt's last position on (most of the cost is the LM head).
        keep = width - len(prompt) + 1
        logits = model(input_ids=ids, logits_to_keep=keep).logits.float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        for j, v in enumerate(verdicts):
            pos = torch.arange(len(v), device=device)
            out[i, j] = float(logp[j, pos, torch.tensor(v, device=device)].sum().exp())
    return out


def expected_vote_accuracy(probs: np.ndarray, progress: list[bool]) -> dict[str, float]:
    """One vote's chance of the oracle's verdict from ``verdict_probabilities``: ``plus`` over
    progress steps, ``minus`` over no-progress ones, ``balanced`` their mean (a vote without a
    verdict counts as wrong), ``verdict`` the mean chance of either verdict. Both classes must
    occur."""
    label = np.asarray(progress, dtype=bool)
    if label.all() or not label.any():
        raise ValueError("expected_vote_accuracy needs progress and no-progress steps")
    plus, minus = float(probs[label, 0].mean()), float(probs[~label, 1].mean())
    return {"plus": plus, "minus": minus, "balanced": (plus + minus) / 2,
            "verdict": float(probs.sum(axis=1).mean())}


def rm_selection(contexts: list[StepContext], tokenizer: Any, history_window: int | None,
                 temperature: float, every: int) -> Selection:
    """Rate the RM being trained by ``expected_vote_accuracy``'s ``balanced`` on ``contexts``
    (templated as the JudgeServer templates them) every ``every`` steps."""
    prompts = [rm_prompt(c, tokenizer, history_window) for c in contexts]
    progress = [c.progress for c in contexts]
    if all(progress) or not any(progress):
        raise ValueError(f"early stopping needs progress and no-progress steps among the "
                         f"{len(progress)} validation steps; got {sum(progress)} progress "
                         f"steps (play more validation tasks: select_tasks)")
    return Selection(every, lambda model: expected_vote_accuracy(
        verdict_probabilities(model, tokenizer, prompts, temperature), progress)["balanced"])


def rm_sft_key(base: Path, policy: Path, cfg: ClawRayConfig, settings: dict[str, Any]) -> str:
    """Hash of what determines the result: base model and policy files, the environment and
    sampling the steps come from, the SFT, RM SFT and learner settings."""
    e, s = cfg.environments_cfg, cfg.sft_cfg
    parts = {"recipe": RECIPE, "base": files_digest(base), "policy": files_digest(policy),
             "env": e.model_dump(include={"family", "family_kwargs", "history_window",
                                          "max_tokens", "temperature", "top_p", "max_steps",
                                          "task_pools"}),
             "sft": s.model_dump(include={"steps", "batch_size", "lr", "seed"}),
             "rm_temperature": cfg.rlanything_cfg.temperature,
             "rm_sft": settings, "learner": learner_settings(cfg)}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def run_rm_sft(cfg: ClawRayConfig, policy_path: str | Path, force: bool = False,
               progress: bool = True, n_tasks: int = 200, max_difficulty: float = 0.5,
               label_noise: float = 0.0, base: str | Path | None = None,
               select_every: int | None = 25, select_tasks: int = 30) -> SFTResult:
    """Warm-start the step-wise RM on the oracle labels of the policy's steps (cached; see
    the module doc). ``base``: the model the RM starts from (default: ``model.path``);
    ``select_every=None`` trains to the last step (no early stopping)."""
    s, r = cfg.sft_cfg, cfg.rlanything_cfg
    if select_every is not None and select_tasks < 1:
        raise ValueError(f"early stopping (select_every={select_every}) needs validation "
                         f"tasks; got select_tasks={select_tasks}")
    base = (Path(resolve_model_path(str(base))) if base is not None
            else Path(policy_model_info(cfg).path))
    policy = Path(policy_path).expanduser()
    settings: dict[str, Any] = {"n_tasks": n_tasks, "max_difficulty": max_difficulty,
                                "label_noise": label_noise}
    if select_every is not None:
        settings.update(select_every=select_every, select_tasks=select_tasks)
    key = rm_sft_key(base, policy, cfg, settings)
    out = Path(s.cache_dir).expanduser() / f"rm-sft-{key}"
    if (hit := cached_result(out, force)) is not None:
        return hit
    t0 = time.perf_counter()
    train_pool, validation_pool = pools(cfg)
    window = cfg.environments_cfg.history_window
    tokenizer = load_tokenizer(base)
    contexts = collect_steps(policy, cfg, n_tasks, max_difficulty, s.seed + TASK_SEED_OFFSET,
                             train_pool)
    rows = rm_sft_rows(contexts, tokenizer, window, label_noise, s.seed)
    select, validation = None, []
    if select_every is not None:
        validation = collect_steps(policy, cfg, select_tasks, max_difficulty,
                                   s.seed + EVAL_SEED_OFFSET, validation_pool)
        select = rm_selection(validation, tokenizer, window, r.temperature, select_every)
    history = train_sft(base, cfg, rows, progress, select=select)
    held_out = (collect_steps(policy, cfg, s.eval_tasks, max_difficulty,
                              s.seed + TEST_SEED_OFFSET, cfg.environments_cfg.pool("test"))
                if s.eval_tasks else [])

    def describe(saved: Path) -> dict[str, Any]:
        nll = history["nll"]
        info: dict[str, Any] = {
            "key": key, "base": str(base), "policy": str(policy), **settings,
            "steps_collected": len(contexts), "progress_steps": sum(c.progress for c in contexts),
            "rows": len(rows), "nll_first": nll[0], "nll_last": nll[-1],
            "train_s": time.perf_counter() - t0, "config": s.model_dump()}
        if select is not None:
            info.update(validation_steps=len(validation),
                        validation_progress_steps=sum(c.progress for c in validation),
                        selection=history["selection"], selected_step=history["selected_step"])
        if held_out:
            info["eval_tasks"], info["eval_pool"] = s.eval_tasks, "test"

            def score(path: Path) -> dict[str, Any]:
                return rm_step_accuracy(path, cfg, held_out, r.m, r.temperature, s.seed)

            info["rm_before"], info["rm_after"] = score(base), score(saved)
            if "last_model" in history:
                with tempfile.TemporaryDirectory(prefix="clawray-rm-last-") as tmp:
                    info["rm_last"] = score(write_model(Path(tmp), base,
                                                        history["last_model"]))
        return info

    return save_result(out, base, history["model"], describe)
