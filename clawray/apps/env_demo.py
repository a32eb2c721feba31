"""``clawray env-demo``: SFT warm start, then GRPO on the household family.

One seeded CPU run on the embedded tiny model:

1. ``clawray sft`` (cached): the model imitates the household expert on easy tasks for 200
   steps, which gives it a non-zero but imperfect success rate (about 20 % on held-out tasks
   at ≤ 0.3 of the box);
2. the warm-started model is served; env runners play GRPO groups of household tasks that the
   curriculum actor draws uniformly within ≤ 0.3 of every axis (the held-out distribution);
   the trainer (``training.mode: env``) updates the policy on 384-row batches at lr 2e-4 and
   pushes weights into serving. Advantages are anchor-state step advantages with negatives on
   (``environments.step_weight: 1``, ``episode_weight: 0``, ``negative_scale: 1``): each step
   is compared with the group's other steps taken from the same prompt. Chosen on the
   validation pool against plain GRPO and GiGPO's sum of both (docs/environments.md,
   "Measured so far", which also has the earlier positive-only and ALP-GMM runs);
3. a fixed held-out task set (never trained on: its own seed) is played through serving
   before training, every ``eval_every`` iterations and at the end, sampling at the training
   temperature with fixed seeds (the same weights give the same episodes; every step has its
   own seed) and ``EVAL_SAMPLES`` episodes per task;
4. ``env_progress.png`` shows held-out success, training success and the curriculum's
   sampled difficulty over time; ``env_summary.json`` and ``metrics.jsonl`` hold the numbers;
   every held-out evaluation goes to the ledger (``clawray.ledger``: experiment ``env-demo``
   with the warm-start recipe's suffix, the arm the ``--set`` overrides; ``ledger_lines``).

``--seeds 0 1 2`` runs it once per seed and summarizes the rises (``env_seeds.json``,
``env_seeds.png``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray import serve

from clawray import ledger
from clawray.apps.launch import init_local_ray
from clawray.config import ClawRayConfig, apply_sets
from clawray.serve.app import build_app
from clawray.training.evaluate import (EVAL_MAX_DIFFICULTY, EVAL_SAMPLES, held_out_success,
                                       held_out_tasks)
from clawray.training.sft import run_sft
from clawray.training.trainer import Trainer

ITERATIONS = 20
EVAL_N = 100
SEED = 0
APP = "env-demo"
# The warm start: 600 NLL steps, the checkpoint chosen every 50 on 100 validation tasks
# (docs/environments.md, "SFT warm start": 200 steps left seeds 0-2 anywhere from 0.5% to 24%).
SFT_STEPS = 600
SFT_SELECT_EVERY = 50
# The warm-start recipe's version: 1, 200 steps and the last checkpoint (until 2026-12-07);
# 2, the above. Runs from a later recipe go to the ledger under experiments named for it
# (``warm_start_suffix``), so a seed's first run there is not a run from another warm start.
WARM_START = 2


def warm_start_suffix(summary: dict[str, Any]) -> str:
    """What a ledger experiment's name carries for the summary's warm-start recipe: nothing for
    recipe 1 (the summaries written before the field existed), ``-warm<N>`` after it."""
    recipe = summary.get("warm_start", 1)
    return "" if recipe == 1 else f"-warm{recipe}"


def env_demo_config(cfg: ClawRayConfig, out: Path, seed: int = SEED,
                    sft_seed: int | None = None,
                    sets: list[str] | None = None) -> ClawRayConfig:
    """The demo's settings on top of ``cfg`` (see docs/environments.md for what they do).

    ``seed`` seeds the RL run (runners, curriculum, learner); ``sft_seed`` (default: ``seed``)
    the warm start, so several RL seeds can share one warm-started model; ``sets``
    (``--set SECTION.KEY=VALUE`` overrides) are applied last.
    """
    sft_seed = seed if sft_seed is None else sft_seed
    demo = cfg.copy_with(
        serving={"record_sink": ["none"]},
        buffer={"path": str(out / "samples"), "seal_age_s": 0.2, "max_staleness": 1},
        environments={"family": "household", "history_window": 0, "num_runners": 2,
                      "runner_num_cpus": 0.25, "concurrency": 4, "group_size": 8,
                      "max_tokens": 16, "temperature": 1.0, "zero_advantage": "drop",
                      "step_weighting": "trajectory", "negative_scale": 1.0,
                      "episode_weight": 0.0, "step_weight": 1.0,
                      "seed": seed},
        curriculum={"sampler": "uniform", "max_difficulty": EVAL_MAX_DIFFICULTY,
                    "sampler_kwargs": {}},
        sft={"tasks": 600, "steps": SFT_STEPS, "max_difficulty": 0.3, "eval_tasks": 0,
             "seed": sft_seed, "select_every": SFT_SELECT_EVERY, "select_tasks": 100},
        training={"app": APP, "mode": "env", "batch_size": 384, "min_batch": 96,
                  "take_timeout_s": 60.0, "lr": 2e-4, "zero_stage": 1,
                  "learner_num_cpus": 0.5, "seed": seed,
                  "checkpoint_dir": str(out / "checkpoints"),
                  "metrics_path": str(out / "metrics.jsonl")})

    return apply_sets(demo, sets or [])


def run_env_learning(cfg: ClawRayConfig, out: Path, iterations: int = ITERATIONS,
                     eval_n: int = EVAL_N, eval_every: int = 10, seed: int = SEED,
                     progress: bool = True, eval_pool: str = "test") -> dict[str, Any]:
    """Train ``iterations`` env iterations on an app already serving ``cfg``'s model,
    evaluating on held-out tasks of ``eval_pool`` (``validation`` to choose settings,
    ``test`` to report)."""
    tasks = held_out_tasks(cfg, eval_n, seed, eval_pool) * EVAL_SAMPLES
    trainer = Trainer(config=cfg.to_dict())
    evals: list[dict[str, Any]] = []

    def evaluate(iteration: int) -> None:
        t0 = time.perf_counter()
        held = held_out_success(trainer, cfg, tasks)
        evals.append({"iteration": iteration, "version": trainer.version, **held,
                      "seconds": time.perf_counter() - t0})
        if progress:
            print(f"clawray env-demo: held-out success at iteration {iteration} "
                  f"(v{trainer.version}): {held['success']:.1%} of {held['n']}", flush=True)

    try:
        evaluate(0)
        results = []
        for i in range(1, iterations + 1):
            results.append(trainer.train())
            if i % eval_every == 0 or i == iterations:
                evaluate(i)
        curriculum = trainer.envs.stats()["curriculum"]
    finally:
        trainer.stop()
    train = [{"iteration": i + 1, "version": r.get("policy_version"),
              "samples": r.get("samples"), "env_success": r.get("env_success"),
              "reward_mean": r.get("reward_mean"), "episodes_per_s": r.get("env_episodes_per_s"),
              "conflict_share": r.get("env_conflict_share"),
              "anchored_share": r.get("env_anchored_share")}
             for i, r in enumerate(results)]
    return {"before": evals[0], "after": evals[-1], "evals": evals, "train": train,
            "curriculum": {k: curriculum.get(k) for k in
                           ("trajectory", "difficulty_histogram", "reported", "episodes",
                            "success_rate", "mean_difficulty")},
            "eval_max_difficulty": EVAL_MAX_DIFFICULTY,
            "sampler": cfg.curriculum_cfg.sampler}


def env_arm(sets: list[str] | None) -> str:
    """The run's arm on the ledger: ``default`` (the demo's settings) or its ``--set``
    overrides, in the order given."""
    return " ".join(sets) if sets else "default"


def ledger_lines(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's lines for the ledger (experiment ``env-demo`` and the warm start's
    ``warm_start_suffix``, arm ``env_arm``): held-out
    success before training, after it and the change, and each evaluation in between as
    ``success_iter<k>``; each line with the ``iteration`` it was measured at."""
    fields = {"experiment": "env-demo" + warm_start_suffix(summary),
              "arm": env_arm(summary.get("sets")),
              "seed": summary["seed"], "pool": summary["eval_pool"],
              "sft_seed": summary.get("sft_seed"), "iterations": summary["iterations"]}
    before, after = summary["before"], summary["after"]
    lines = [{**line, "iteration": (after if line["metric"] != "success_before"
                                    else before)["iteration"]}
             for line in ledger.before_after("success", before["success"], after["success"],
                                             n=after["n"], **fields)]
    lines += [{**fields, "metric": f"success_iter{e['iteration']}", "value": e["success"],
               "n": e["n"], "iteration": e["iteration"]} for e in summary["evals"][1:-1]]
    return lines


def plot_env_progress(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ev = summary["evals"]
    axes[0].plot([e["iteration"] for e in ev], [e["success"] for e in ev], "o-")
    axes[0].set(title=f"held-out success ({ev[0]['n']} episodes)", xlabel="iteration",
                ylabel="success rate", ylim=(0, 1))
    tr = [t for t in summary["train"] if t["env_success"] is not None]
    axes[1].plot([t["iteration"] for t in tr], [t["env_success"] for t in tr], ".-")
    axes[1].set(title="training episodes' success (sampled)", xlabel="iteration",
                ylim=(0, 1))
    traj = summary["curriculum"].get("trajectory") or []
    if traj:
        eps, diff, succ = zip(*traj)
        axes[2].plot(eps, diff, label="mean sampled difficulty")
        axes[2].plot(eps, succ, label="recent success")
        axes[2].legend()
    axes[2].set(title=f"curriculum ({summary.get('sampler', 'alp_gmm')})", xlabel="episodes",
                ylim=(0, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def aggregate_seeds(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Several seeds' ``env_summary.json``: per seed the held-out curve and its rise, and over
    seeds the mean and (population) spread of before, after and the rise."""
    per_seed = [{"seed": s.get("seed"), "before": s["before"]["success"],
                 "after": s["after"]["success"],
                 "rise": s["after"]["success"] - s["before"]["success"],
                 "n": s["after"]["n"],
                 "curve": [[e["iteration"], e["success"]] for e in s["evals"]]}
                for s in summaries]

    def stat(key: str) -> dict[str, float]:
        v = np.asarray([p[key] for p in per_seed], dtype=float)
        return {"mean": float(v.mean()), "std": float(v.std()), "min": float(v.min()),
                "max": float(v.max())}

    rises = np.asarray([p["rise"] for p in per_seed], dtype=float)
    return {"seeds": per_seed, "before": stat("before"), "after": stat("after"),
            "rise": stat("rise"), "rose_in": int((rises > 0).sum()), "runs": len(per_seed),
            # The rise's standard error from the seeds' spread (n - 1 in the variance).
            "rise_stderr": float(rises.std(ddof=1) / np.sqrt(len(rises))) if len(rises) > 1
            else None}


def plot_seeds(agg: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in agg["seeds"]:
        it, succ = zip(*p["curve"])
        ax.plot(it, succ, "o-", label=f"seed {p['seed']}")
    r = agg["rise"]
    ax.set(title=f"held-out success, {agg['runs']} seeds: rise {r['mean']:+.1%} "
                 f"(min {r['min']:+.1%})", xlabel="iteration", ylabel="success rate",
           ylim=(0, max(0.6, max(s for p in agg["seeds"] for _, s in p["curve"]) + 0.1)))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_env_demo_seeds(cfg: ClawRayConfig, out: Path, seeds: list[int], sft_seed: int | None,
                       **kwargs: Any) -> int:
    """``run_env_demo`` once per seed (``out/seed<k>``), then ``env_seeds.json`` and
    ``env_seeds.png`` in ``out``; 0 if held-out success rose in every seed."""
    summaries = []
    for seed in seeds:
        run_env_demo(cfg, out / f"seed{seed}", seed=seed, sft_seed=sft_seed, **kwargs)
        summaries.append(json.loads((out / f"seed{seed}" / "env_summary.json").read_text()))
    agg = aggregate_seeds(summaries)
    (out / "env_seeds.json").write_text(json.dumps(agg, indent=2))
    plot_seeds(agg, out / "env_seeds.png")
    r = agg["rise"]
    print(f"clawray env-demo: {agg['runs']} seeds, held-out success {agg['before']['mean']:.1%} "
          f"→ {agg['after']['mean']:.1%}; rise {r['mean']:+.1%} ± {r['std']:.1%} (min "
          f"{r['min']:+.1%}), rose in {agg['rose_in']} of {agg['runs']}; {out / 'env_seeds.png'}")
    return 0 if agg["rose_in"] == agg["runs"] else 1


def run_env_demo(cfg: ClawRayConfig, out: Path, iterations: int = ITERATIONS,
                 eval_n: int = EVAL_N, eval_every: int = 10, seed: int = SEED,
                 sft_seed: int | None = None,
                 sets: list[str] | None = None, eval_pool: str = "test") -> int:
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("samples", "samples-env", "checkpoints"):
        shutil.rmtree(out / stale, ignore_errors=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    cfg = env_demo_config(cfg, out, seed, sft_seed, sets)
    t0 = time.monotonic()
    sft = run_sft(cfg)
    print(f"clawray env-demo: warm-started model {sft.path} "
          f"({'cached' if sft.cached else f'{time.monotonic() - t0:.0f} s'})", flush=True)
    cfg = cfg.copy_with(model={"path": str(sft.path)})
    init_local_ray(include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": cfg.serving_cfg.port})
        serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
        summary = run_env_learning(cfg, out, iterations, eval_n, eval_every, seed=seed,
                                   eval_pool=eval_pool)
    finally:
        ray.shutdown()
    summary.update(seed=seed, sft_seed=cfg.sft_cfg.seed, sets=sets or [], eval_pool=eval_pool,
                   iterations=iterations, warm_start=WARM_START, sft=sft.info,
                   seconds=time.monotonic() - t0)
    (out / "env_summary.json").write_text(json.dumps(summary, indent=2))
    ledger.record_lines(ledger_lines(summary))
    plot_env_progress(summary, out / "env_progress.png")
    print(f"clawray env-demo: held-out success {summary['before']['success']:.1%} → "
          f"{summary['after']['success']:.1%} on {summary['after']['n']} tasks; plot "
          f"{out / 'env_progress.png'} ({time.monotonic() - t0:.0f} s in all)")
    return 0 if summary["after"]["success"] > summary["before"]["success"] else 1
