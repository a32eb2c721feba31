"""Why is RLAnything's step RM at chance? A probe of its warm start (issue "Learning you can trust").

The RM warm start (``clawray rm-sft``) learns ``\\boxed{1}`` / ``\\boxed{-1}`` from the oracle
labels of the policy's household steps. This script measures, on three disjoint step pools —
steps of tasks the warm start trains on, a validation pool, a test pool (tasks from separate
seeds, none among the policy's SFT tasks, checked) — how well the RM separates progress from
no-progress steps, reading its verdict log-odds directly (log P(``\\boxed{1}``) − log
P(``\\boxed{-1}``), teacher-forced: no sampling noise), for the variables that could explain
chance-level accuracy:

- ``window``: how much of the interaction the RM prompt shows (``environments.history_window``;
  the env demo uses 0: the task's first message, the observation the action answered, the
  action and the observation after it — every state the oracle's label depends on);
- ``label_noise``: the share of flipped training labels (Table 1's warm start used 0.2);
- ``steps``: how long the warm start trains (``sft.steps``);
- ``source``: where the training steps come from — ``policy`` (the policy's own steps on the
  train pool's tasks, as they are), ``recipe1`` (what ``clawray rm-sft`` recipe 1 did: the
  policy's steps on the first tasks of its own SFT stream, topped up with whole expert episodes
  of the same tasks while progress steps are fewer than a third), or ``recipe2`` (what it does
  now, ``rm_sft.collect_steps``: tasks of their own stream, topped up with the expert's action
  at the policy's own states);
- trivial cues: how much a rule that only reads "nothing happens." (an invalid action) gets.

Reported per setting: p₊ (progress steps scored > 0), p₋ (no-progress steps scored < 0),
balanced accuracy (p₊ + p₋)/2, μ = p₊ + p₋ and the ranking AUC, on the train and test pools;
the threshold is 0 (what a sampled verdict's majority approximates), settings are compared on
the validation pool only. Seeds: each setting is trained with ``--seeds`` SFT seeds; mean and
standard error across them.

    .venv/bin/python scripts/rm_probe.py --out docs/results/rm_probe.json   # ~25 min, 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from clawray.apps.env_demo import env_demo_config
from clawray.config import ClawRayConfig
from clawray.envs import make_family
from clawray.envs.base import demo_tasks
from clawray.envs.rollout import play_episode, render_prompt
from clawray.inference.engine import SamplingParams, TokenOutput
from clawray.models.chat_template import IM_END
from clawray.models.loader import load_tokenizer, policy_model_info
from clawray.rlanything.steps import StepContext, step_contexts, step_rm_request
from clawray.training.evaluate import (EVAL_MAX_DIFFICULTY, balanced, nothing_happens_rule,
                                       play_tasks)
from clawray.training.rm_sft import (MAX_IMBALANCE, TASK_SEED_OFFSET, collect_steps,
                                     rm_sft_rows, verdict)
from clawray.training.sft import run_sft, train_sft

POOL_SEEDS = {"train": 7_000_001, "validation": 7_000_002, "test": 7_000_003}


def collect(policy: Path, cfg: ClawRayConfig, n_tasks: int, seed: int) -> tuple[list[Any],
                                                                                list[StepContext]]:
    e = cfg.environments_cfg
    family = make_family(e.family, **e.family_kwargs)
    tasks = demo_tasks(family, n_tasks, EVAL_MAX_DIFFICULTY, seed)
    episodes = play_tasks(policy, cfg, tasks, seed=seed)
    return tasks, [c for ep in episodes for c in step_contexts(ep)]


def recipe1_steps(policy: Path, cfg: ClawRayConfig, n_tasks: int) -> list[StepContext]:
    """``clawray rm-sft`` recipe 1's steps: the policy's on the first ``n_tasks`` of its own SFT
    task stream, then whole expert episodes of those tasks while progress steps are fewer than
    one in ``MAX_IMBALANCE + 1``."""
    e = cfg.environments_cfg
    family = make_family(e.family, **e.family_kwargs)
    tasks = demo_tasks(family, n_tasks, EVAL_MAX_DIFFICULTY, cfg.sft_cfg.seed)
    contexts = [c for ep in play_tasks(policy, cfg, tasks, seed=cfg.sft_cfg.seed)
                for c in step_contexts(ep)]
    plus = sum(c.progress for c in contexts)
    minus = len(contexts) - plus
    tokenizer = load_tokenizer(policy)
    end = tokenizer.convert_tokens_to_ids(IM_END)
    for task in tasks:
        if plus * MAX_IMBALANCE >= minus:
            break
        shadow = family.make_env()
        shadow.reset(task)

        async def generate(_ids: list[int], _params: SamplingParams, shadow=shadow) -> TokenOutput:
            action = shadow.expert_action()
            shadow.step(action)
            ids = tokenizer.encode(action.text(), add_special_tokens=False) + [end]
            return TokenOutput(ids, [0.0] * len(ids), "stop", 0)

        ep = asyncio.run(play_episode(family, task, generate, tokenizer, SamplingParams(),
                                      max_steps=100, history_window=e.history_window))
        expert = step_contexts(ep)
        contexts += expert
        plus += sum(c.progress for c in expert)
        minus += sum(not c.progress for c in expert)
    return contexts


def verdict_scores(model: Any, tokenizer: Any, contexts: list[StepContext],
                   window: int | None) -> list[float]:
    """log P(\\boxed{1}<|im_end|>) − log P(\\boxed{-1}<|im_end|>) after each step's prompt."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    answers = [tokenizer.encode(verdict(v), add_special_tokens=False) + [end]
               for v in (True, False)]
    out = []
    with torch.no_grad():
        for ctx in contexts:
            prompt = render_prompt(tokenizer, step_rm_request(ctx, window).messages, None)
            lp = []
            for ans in answers:
                ids = torch.tensor([prompt + ans])
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
                lp.append(sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ans)))
            out.append(lp[0] - lp[1])
    return out


def separation(labels: list[bool], scores: list[float]) -> dict[str, float]:
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    p_plus = sum(s > 0 for s in pos) / len(pos)
    p_minus = sum(s < 0 for s in neg) / len(neg)
    auc = sum((a > b) + 0.5 * (a == b) for a in pos for b in neg) / (len(pos) * len(neg))
    return {"p_plus": p_plus, "p_minus": p_minus, **balanced(p_plus, p_minus), "auc": auc,
            "n_plus": len(pos), "n_minus": len(neg)}


def valid_only(contexts: list[StepContext], scores: list[float]) -> dict[str, float] | None:
    """``separation`` among valid actions only (progress against none, without the
    invalid-action cue); None where those steps hold one class only."""
    valid = [(c.progress, s) for c, s in zip(contexts, scores) if c.valid]
    if not any(y for y, _ in valid) or all(y for y, _ in valid):
        return None
    return separation([y for y, _ in valid], [s for _, s in valid])


def record_test(result: dict[str, Any], arm: str, seed: int) -> None:
    """The test pool's figures on the ledger (experiment ``rm-probe``): balanced accuracy and
    AUC over all steps and among valid actions only."""
    from clawray import ledger

    def n(r: dict[str, Any]) -> int:
        return r["n_plus"] + r["n_minus"]

    lines = [{"metric": "rm_balanced_acc", "value": result["balanced_acc"], "n": n(result)},
             {"metric": "rm_auc", "value": result["auc"], "n": n(result)}]
    if valid := result.get("valid_only"):
        lines += [{"metric": "rm_valid_balanced_acc", "value": valid["balanced_acc"],
                   "n": n(valid)},
                  {"metric": "rm_valid_auc", "value": valid["auc"], "n": n(valid)}]
    ledger.record_lines([{**line, "experiment": "rm-probe", "arm": arm, "seed": seed,
                          "pool": "test"} for line in lines])


def sample(contexts: list[StepContext], n: int) -> list[StepContext]:
    """A seeded sample of ``n`` steps, both classes kept in proportion (all when n is 0)."""
    if not n or n >= len(contexts):
        return contexts
    return random.Random(0).sample(contexts, n)


def rule_scores(contexts: list[StepContext]) -> list[float]:
    """The trivial cue: +1 unless the observation says the action did nothing
    (``evaluate.nothing_happens_rule``, as scores for the AUC)."""
    return [float(s[0]) for s in nothing_happens_rule(contexts)]


def mean_se(values: list[float]) -> dict[str, float]:
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return {"mean": statistics.fmean(values), "se": se, "n": len(values)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("docs/results/rm_probe.json"))
    p.add_argument("--train-tasks", type=int, default=200)
    p.add_argument("--eval-tasks", type=int, default=40)
    p.add_argument("--windows", default="0")
    p.add_argument("--noise", default="0.0,0.2")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", default="200", help="RM SFT steps (a list)")
    p.add_argument("--sources", default="policy", help="policy, recipe1, recipe2 (a list)")
    p.add_argument("--score-train", type=int, default=500,
                   help="train-pool steps scored per run (a seeded sample; all: 0)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args(argv)
    t0 = time.time()
    cfg = env_demo_config(ClawRayConfig(), Path("."), 0)
    policy = run_sft(cfg, progress=False).path
    base = Path(policy_model_info(cfg).path)
    tokenizer = load_tokenizer(base)
    e = cfg.environments_cfg
    sft_tasks = {t.task_id for t in demo_tasks(make_family(e.family, **e.family_kwargs),
                                               cfg.sft_cfg.tasks, cfg.sft_cfg.max_difficulty,
                                               cfg.sft_cfg.seed)}
    pools: dict[str, list[StepContext]] = {}
    ids: dict[str, set[str]] = {}
    for name, seed in POOL_SEEDS.items():
        n = args.train_tasks if name == "train" else args.eval_tasks
        tasks, pools[name] = collect(policy, cfg, n, seed)
        ids[name] = {t.task_id for t in tasks}
        print(f"{name}: {len(tasks)} tasks, {len(pools[name])} steps, "
              f"{sum(c.progress for c in pools[name])} progress", flush=True)
    overlaps = {f"{a}&{b}": len(ids[a] & ids[b]) for a in ids for b in ids if a < b}
    overlaps.update({f"{a}&policy_sft": len(ids[a] & sft_tasks) for a in ids})
    assert not any(overlaps.values()), overlaps  # disjoint by construction, and checked
    report: dict[str, Any] = {
        "command": "scripts/rm_probe.py " + " ".join(argv or []), "policy": str(policy),
        "pools": {k: {"tasks": len(ids[k]), "steps": len(v),
                      "progress": sum(c.progress for c in v),
                      "invalid": sum(not c.valid for c in v),
                      "progress_among_valid": (sum(c.progress for c in v if c.valid)
                                               / max(1, sum(c.valid for c in v)))}
                  for k, v in pools.items()},
        "overlaps": overlaps,
        "rule_nothing_happens": {k: separation([c.progress for c in v], rule_scores(v))
                                 for k, v in pools.items()},
        # the same rule among valid actions only, where the cue is gone
        "rule_nothing_happens_valid_only": {
            k: valid_only(v, rule_scores(v)) for k, v in pools.items()},
        "settings": {}}
    from transformers import AutoModelForCausalLM

    sources = {"policy": pools["train"]}
    if "recipe1" in args.sources:
        sources["recipe1"] = recipe1_steps(policy, cfg, args.train_tasks)
    if "recipe2" in args.sources:
        sources["recipe2"] = collect_steps(policy, cfg, args.train_tasks, EVAL_MAX_DIFFICULTY,
                                           cfg.sft_cfg.seed + TASK_SEED_OFFSET)
    report["sources"] = {k: {"steps": len(v), "progress": sum(c.progress for c in v)}
                         for k, v in sources.items()}

    base_model = AutoModelForCausalLM.from_pretrained(base).eval()
    for window in [None if w == "all" else int(w) for w in args.windows.split(",")]:
        for k, v in pools.items():
            if k == "train":
                continue
            scores = verdict_scores(base_model, tokenizer, v, window)
            report.setdefault("base_model", {}).setdefault(str(window), {})[k] = {
                **separation([c.progress for c in v], scores),
                "valid_only": valid_only(v, scores)}
        record_test(report["base_model"][str(window)]["test"], f"base-model/window{window}", 0)
        for source, noise, steps in [(src, float(x), int(n)) for src in args.sources.split(",")
                                     for x in args.noise.split(",")
                                     for n in args.steps.split(",")]:
            runs = []
            for seed in [int(s) for s in args.seeds.split(",")]:
                run_cfg = cfg.copy_with(sft={"steps": steps, "batch_size": args.batch_size,
                                             "lr": args.lr, "seed": seed})
                rows = rm_sft_rows(sources[source], tokenizer, window, noise, seed)
                model = train_sft(base, run_cfg, rows, progress=False)["model"].eval()
                scored = {**pools, "train": sample(pools["train"], args.score_train)}
                run: dict[str, Any] = {}
                for k, v in scored.items():
                    scores = verdict_scores(model, tokenizer, v, window)
                    run[k] = separation([c.progress for c in v], scores)
                    run[k]["valid_only"] = valid_only(v, scores)
                runs.append(run)
                record_test(run["test"], f"{source}/window{window}/noise{noise}/steps{steps}",
                            seed)
                print(f"{source} window {window} noise {noise} steps {steps} seed {seed}: "
                      + ", ".join(
                    f"{k} bal {r['balanced_acc']:.3f} auc {r['auc']:.3f}"
                    + (f" (valid actions: bal {r['valid_only']['balanced_acc']:.3f})"
                       if r["valid_only"] else "")
                    for k, r in runs[-1].items()), flush=True)
            report["settings"][f"{source},window={window},noise={noise},steps={steps}"] = {
                "source": source, "window": window, "label_noise": noise, "steps": steps,
                "runs": runs,
                "summary": {pool: {m: mean_se([r[pool][m] for r in runs])
                                   for m in ("p_plus", "p_minus", "balanced_acc", "auc")}
                            for pool in pools},
                "summary_valid_only": {
                    pool: {m: mean_se([r[pool]["valid_only"][m] for r in runs])
                           for m in ("p_plus", "p_minus", "balanced_acc", "auc")}
                    for pool in pools if all(r[pool]["valid_only"] for r in runs)}}
    report["seconds"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
