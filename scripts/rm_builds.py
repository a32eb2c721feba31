"""Does the RM warm start discriminate in every build? (issue "Learning you can trust")

Table 1's RM warm start (``clawray rm-sft`` on the env demo's policy, 200 tasks, 200 steps of
32 rows) scored 0.753 balanced accuracy built on one torch thread and 0.518 on two, from the
same policy and rows (docs/rlanything.md): a fixed step count overtrains some builds. Recipe 5
stops early on validation-pool steps (``rm_sft.rm_selection``). This script builds that recipe
several times — RM seeds (``sft.seed``: the RM's tasks, row subsample and batch order) × torch
thread counts, on one policy — and reports, per build and as mean ± standard error over builds:

- the step early stopping kept and its validation rating (the curve: ``selection``);
- the kept weights' balanced accuracy, p₊, p₋ and μ on steps of TEST-pool tasks (m sampled
  votes, ``rm_step_accuracy``), and the same for the last step's weights (``rm_last``: what
  recipe 4 shipped), paired per build.

Every build has its own cache folder (the thread count is not part of the cache key).

    .venv/bin/python scripts/rm_builds.py --out docs/results/rm_selection --threads 1 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from clawray.apps.env_demo import env_demo_config
from clawray.config import ClawRayConfig
from clawray.stats import seed_stats
from clawray.training.evaluate import EVAL_MAX_DIFFICULTY
from clawray.training.rm_sft import run_rm_sft
from clawray.training.sft import run_sft, torch_threads


def build(out: Path, policy_seed: int, rm_seed: int, threads: int, tasks: int,
          eval_tasks: int, select_every: int | None, policy_threads: int = 1) -> dict[str, Any]:
    demo = env_demo_config(ClawRayConfig(), Path("."), policy_seed)
    # The env demo's (Table 1's) policy, cached by its settings (a cached build is whichever
    # thread count built it first; a missing one is built on ``policy_threads``).
    with torch_threads(policy_threads):
        sft = run_sft(demo, progress=False)
    policy = sft.path
    cfg = demo.copy_with(sft={"seed": rm_seed, "eval_tasks": eval_tasks,
                              "cache_dir": str(out / "cache" / f"threads{threads}")})
    t0 = time.monotonic()
    with torch_threads(threads):
        result = run_rm_sft(cfg, policy, n_tasks=tasks, max_difficulty=EVAL_MAX_DIFFICULTY,
                            progress=False, select_every=select_every)
    info = result.info
    keep = ("rm_before", "rm_after", "rm_last", "selection", "selected_step", "rows",
            "steps_collected", "validation_steps", "nll_last")
    return {"policy": str(policy), "policy_seed": policy_seed,
            "policy_success": sft.info.get("success_after"), "rm_seed": rm_seed,
            "threads": threads, "cached": result.cached, "seconds": time.monotonic() - t0,
            **{k: info[k] for k in keep if k in info}}


def last_scored(b: dict[str, Any]) -> dict[str, Any]:
    """The last step's test figures (``rm_last`` is absent where early stopping kept the last
    step: the kept weights are the last)."""
    return b.get("rm_last") or b["rm_after"]


def summarize(builds: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str, which: str) -> dict[str, float | None]:
        return seed_stats([b[which][key] for b in builds if b.get(which)])

    last = [last_scored(b) for b in builds]
    paired = [a["rm_after"]["balanced_acc"] - l["balanced_acc"] for a, l in zip(builds, last)]
    return {"builds": len(builds),
            "selected": {k: stats(k, "rm_after") for k in ("balanced_acc", "plus_acc",
                                                           "minus_acc", "mu", "unparseable")},
            "last": {k: seed_stats([l[k] for l in last])
                     for k in ("balanced_acc", "plus_acc", "minus_acc", "mu", "unparseable")},
            "selected_minus_last": seed_stats(paired),
            "selected_steps": [b.get("selected_step") for b in builds]}


def markdown(builds: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """Per build and over builds: the kept step, test-pool balanced accuracy, p₊, p₋, μ of the
    kept weights, and the last step's balanced accuracy and p₊ beside them."""
    f = (lambda v: "-" if v is None else f"{v:.3f}")
    policies = {(b["policy_seed"], Path(b["policy"]).name, b.get("policy_success"))
                for b in builds}
    lines = [f"Policy seed {seed}: `{name}` (held-out success {f(success)})"
             for seed, name, success in sorted(policies, key=str)] + [""]
    lines += ["| RM seed | threads | kept step | test balanced | p₊ | p₋ | μ | last step: balanced "
             "| last: p₊ | last: p₋ |", "|---|---|---|---|---|---|---|---|---|---|"]
    for b in sorted(builds, key=lambda b: (b["threads"], b["rm_seed"])):
        a, last = b["rm_after"], last_scored(b)
        lines.append(f"| {b['rm_seed']} | {b['threads']} | {b.get('selected_step')} | "
                     f"{f(a['balanced_acc'])} | {f(a['plus_acc'])} | {f(a['minus_acc'])} | "
                     f"{f(a['mu'])} | {f(last['balanced_acc'])} | {f(last['plus_acc'])} | "
                     f"{f(last['minus_acc'])} |")

    def ms(d: dict[str, Any]) -> str:
        return f"{f(d['mean'])} ± {f(d['stderr'])}"

    sel, last = summary["selected"], summary["last"]
    lines.append(f"| mean ± s.e. ({summary['builds']} builds) | | | {ms(sel['balanced_acc'])} | "
                 f"{ms(sel['plus_acc'])} | {ms(sel['minus_acc'])} | {ms(sel['mu'])} | "
                 f"{ms(last['balanced_acc'])} | {ms(last['plus_acc'])} | "
                 f"{ms(last['minus_acc'])} |")
    lines.append("")
    lines.append(f"Kept − last step, paired per build: {ms(summary['selected_minus_last'])} "
                 "balanced accuracy.")
    return "\n".join(lines) + "\n"


def plot(builds: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for b in sorted(builds, key=lambda b: (b["threads"], b["rm_seed"])):
        curve = b.get("selection") or []
        line, = ax.plot([c["step"] for c in curve], [c["score"] for c in curve], marker="o",
                        ms=4, label=f"RM seed {b['rm_seed']}, {b['threads']} thread(s)")
        last = last_scored(b)
        ax.plot([b["selected_step"]], [b["rm_after"]["balanced_acc"]], marker="*", ms=13,
                color=line.get_color(), ls="none")
        ax.plot([curve[-1]["step"]], [last["balanced_acc"]], marker="x", ms=9, mew=2,
                color=line.get_color(), ls="none")
    ax.plot([], [], "k*", ls="none", label="test pool, kept step (m = 3 votes)")
    ax.plot([], [], "kx", ls="none", label="test pool, last step")
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("RM warm-start step")
    ax.set_ylabel("balanced accuracy")
    ax.set_title("RM warm start: validation rating (lines), test (markers)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--policy-seed", type=int, default=0)
    p.add_argument("--rm-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tasks", type=int, default=200, help="train-pool tasks (Table 1: 200)")
    p.add_argument("--eval-tasks", type=int, default=30, help="test-pool tasks")
    p.add_argument("--select-every", type=int, default=25)
    p.add_argument("--policy-threads", type=int, default=1,
                   help="torch threads of a policy build not in the cache")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = out / "builds.jsonl"
    builds = [json.loads(line) for line in done.read_text().splitlines()] if done.exists() else []
    have = {(b["rm_seed"], b["threads"]) for b in builds}
    for threads in args.threads:
        for rm_seed in args.rm_seeds:
            if (rm_seed, threads) in have:
                continue
            b = build(out, args.policy_seed, rm_seed, threads, args.tasks, args.eval_tasks,
                      args.select_every, args.policy_threads)
            after, last = b["rm_after"], last_scored(b)
            print(f"RM seed {rm_seed}, {threads} thread(s): kept step {b.get('selected_step')}"
                  f" -> test balanced {after['balanced_acc']} (p+ {after['plus_acc']},"
                  f" p- {after['minus_acc']}); last step {last['balanced_acc']}"
                  f" [{b['seconds']:.0f} s]", flush=True)
            with done.open("a") as f:
                f.write(json.dumps(b) + "\n")
            builds.append(b)
    mine = [b for b in builds if b["rm_seed"] in args.rm_seeds and b["threads"] in args.threads]
    summary = {"command": "scripts/rm_builds.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items()), **summarize(mine)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown(mine, summary))
    plot(mine, out / "validation_curves.png")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
