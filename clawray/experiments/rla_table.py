"""``clawray rla-table``: RLAnything's Table 1 on the household family, on CPU.

Three rows, as in the paper: the policy trained with the step-wise RM's rewards (``policy``);
the RM co-trained as well (``policy+rm``); and the environment adapted too (``policy+rm+env``).
For every seed the rows share one warm start: the policy from ``clawray sft`` (the env-demo's
settings) and the RM from ``clawray rm-sft`` on that policy's steps (clean labels by default;
``label_noise`` flips a share, for an RM that starts imperfect). Each row then runs ``steps`` synchronous RLAnything steps through the real
system (a Serve app with the PolicyServer and a JudgeServer, env runners, both learners) and
measures, before and after:

- (i) the policy's success on held-out household tasks of the ``test`` pool (``eval_pool``;
  ``validation`` for choosing settings: contents no training draw, warm start or rewrite can
  produce, ``clawray.envs.task_pool``), played through serving with fixed per-step seeds (the
  env-demo's evaluation);
- (ii) the RM's step accuracy against the environment's step oracle on a fixed held-out set
  of steps (the warm-started policy's steps on held-out tasks of the same pool),
  ``rlanything.m`` scorings each
  through the JudgeServer (``evaluate.step_accuracy``: single scorings, majority, unparseable);
- (iii) the environment adapter's accepted rewrites, step by step.

The "before" numbers are measured once per seed, in the first row: every row starts from the
same weights, and both evaluations are seeded. Results: ``rla_table.json`` (everything),
``rla_table.md`` (the table, mean and spread over seeds) and ``rla_table.png``; each row's
held-out figures go to the ledger as the row finishes (``clawray.ledger``: experiment
``rla-table``, the row as the arm; ``ledger_lines``).

A ``Scale`` sets how big a run is: ``FULL`` (the default, the measured table; about 25 minutes
per seed on 2 cores) or ``SMALL`` (short warm starts, 2 steps, small evaluations: the same
experiment in a few minutes, which ``notebooks/rlanything.ipynb`` runs). Each row starts its own
local Ray cluster, or uses the one the caller started (``ray.init`` first, as the notebook
does), deleting its Serve app at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

# A JudgeServer busy scoring answers Serve's queue-length probe late: give it 1 s instead of
# 0.1 s before Serve warns (it warned on most requests). Serve reads this when it is first
# imported, which the imports below do, so it is set first.
os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S", "1.0")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from clawray import ledger  # noqa: E402
from clawray.apps.env_demo import WARM_START, env_demo_config, warm_start_suffix  # noqa: E402
from clawray.apps.launch import init_local_ray
from clawray.config import ClawRayConfig
from clawray.rlanything.loop import StepScorer
from clawray.serve.app import build_app
from clawray.training.evaluate import (EVAL_MAX_DIFFICULTY, EVAL_SAMPLES, balanced,
                                       held_out_success, held_out_tasks, nothing_happens_rule,
                                       step_accuracy)
from clawray.training.rm_sft import EVAL_SEED_OFFSET, collect_steps, run_rm_sft
from clawray.training.sft import run_sft
from clawray.training.trainer import Trainer

APP = "rla-table"
ROWS: dict[str, dict[str, bool]] = {
    "policy": {"co_train_rm": False, "adapt_env": False},
    "policy+rm": {"co_train_rm": True, "adapt_env": False},
    "policy+rm+env": {"co_train_rm": True, "adapt_env": True},
}
STEPS = 6
ADAPTER_MAX_DIFFICULTY = 0.15
EVAL_TASKS = 100
EVAL_STEP_TASKS = 20
# Clean labels: with 20 % flipped (the first Table 1's setting) the warm start was at chance on
# held-out steps for one SFT seed in three and the table could not test co-training
# (docs/rlanything.md, scripts/rm_probe.py); --label-noise still flips a share.
RM_LABEL_NOISE = 0.0
RM_EVAL_SEED = 1_000
STEP_KEYS = ("policy_version", "rm_version", "samples", "rla_success", "rla_active_success",
             "rla_policy_rows", "rla_rm_rows", "rm_step_acc", "rm_majority_acc",
             "rm_plus_acc", "rm_minus_acc", "rm_balanced_acc", "rm_mu", "target_plus_acc",
             "target_minus_acc", "target_balanced_acc", "trained_target_plus_acc",
             "trained_target_minus_acc", "trained_target_balanced_acc",
             "trained_target_positive_share", "rm_outcome_plus_acc",
             "rm_outcome_minus_acc", "rm_outcome_balanced_acc", "rm_outcome_mu", "rm_unparseable",
             "env_proposed", "env_accepted", "env_rejected",
             "time_rollout_s", "time_rm_score_s", "time_rm_update_s")


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big a table run is."""

    steps: int = STEPS  # RLAnything steps per row
    eval_tasks: int = EVAL_TASKS  # held-out tasks, each played EVAL_SAMPLES times
    eval_step_tasks: int = EVAL_STEP_TASKS  # held-out tasks whose steps test the RM
    slots: int = 6  # the adapter's task slots
    slots_per_step: int = 0  # slots played per step, in turn (0: every slot every step)
    group_size: int = 6  # rollouts per task and step
    runners: int = 2  # env runners
    sft_steps: int | None = None  # the policy's warm start; None: the env-demo's
    sft_select: bool = True  # the policy's warm start picks its checkpoint on validation tasks
    rm_tasks: int = 200  # tasks whose steps the RM's warm start learns from
    rm_sft_steps: int | None = 200  # the RM's warm start (200: as measured while the policy's
    # warm start was 200 steps too); None: as the policy's
    rm_sft_batch_size: int | None = None  # None: as the policy's
    rm_sft_lr: float | None = None  # None: as the policy's
    rm_select_tasks: int = 30  # validation-pool tasks whose steps stop the RM's warm start


FULL = Scale()
# The policy's warm start is the full one (fewer SFT steps leave the tiny policy at 0 %
# success: no group has a spread, nothing trains); the RM's is short, at a higher lr.
SMALL = Scale(steps=2, eval_tasks=4, eval_step_tasks=2, slots=2, group_size=4, runners=1,
              rm_tasks=20, rm_sft_steps=60, rm_sft_batch_size=8, rm_sft_lr=3e-3,
              rm_select_tasks=4)
# The machinery only (the notebook's test in CI): one step from warm starts of a few SFT steps,
# which leave the policy near 0 % success; its figures mean nothing, its path is the same.
TINY = Scale(steps=1, eval_tasks=2, eval_step_tasks=2, slots=2, group_size=4, runners=1,
             sft_steps=20, sft_select=False, rm_tasks=8, rm_sft_steps=10, rm_sft_batch_size=8,
             rm_sft_lr=3e-3,
             rm_select_tasks=2)
SCALES = {"full": FULL, "small": SMALL, "tiny": TINY}


def check_rows(rows: list[str]) -> None:
    for row in rows:
        if row not in ROWS:
            raise ValueError(f"unknown row {row!r}; the rows are {', '.join(ROWS)}")


def measured_engine(cfg: ClawRayConfig) -> ClawRayConfig:
    """``cfg`` on the engine the table was measured on, the transformers engine (serving,
    held-out evaluations and the warm starts' evaluations alike), where it says ``auto`` (the
    default); ``hf`` or ``vllm`` named in the config are kept."""
    if cfg.inference_cfg.engine != "auto":
        return cfg
    return cfg.copy_with(inference={"engine": "hf"})


def table_config(cfg: ClawRayConfig, out: Path, row: str, seed: int, policy: str,
                 rm: str, scale: Scale = FULL) -> ClawRayConfig:
    """One row's settings: the env-demo's environment, the warm starts, the row's switches."""

    check_rows([row])
    run = out / f"seed{seed}" / row.replace("+", "_")
    return env_demo_config(measured_engine(cfg), run, seed).copy_with(
        model={"path": policy},
        # Two served models (policy, RM), two learners and two runners on one CPU machine.
        serving={"replica_num_cpus": 0.5},
        environments={"group_size": scale.group_size, "num_runners": scale.runners},
        # The adapter's first tasks: easier than the held-out ones (≤ 0.3), where the warm
        # start succeeds often enough for tasks to sit in the RM's [0.2, 0.8] band; at ≤ 0.3
        # most slots started near 0 % and gave the RM no rows at all.
        curriculum={"max_difficulty": ADAPTER_MAX_DIFFICULTY},
        rlanything={"m": 3, "temperature": 0.8, "max_tokens": 8, "rm_backend": "server",
                    "rm_model_path": rm, "slots": scale.slots,
                    "slots_per_step": scale.slots_per_step, **ROWS[row],
                    "checkpoint_path": str(run / "env_adapter.json")},
        training={"app": f"{APP}-{row.replace('+', '-')}", "mode": "rlanything",
                  "batch_size": 4096, "min_batch": 1, "lr": 1e-4, "take_timeout_s": 30.0})


def warm_starts(cfg: ClawRayConfig, sft_seed: int, label_noise: float,
                scale: Scale = FULL, progress: bool = True) -> tuple[str, str]:
    """The policy (``clawray sft``, seeded ``sft_seed``) and the RM (``clawray rm-sft`` on that
    policy's steps) every row starts from; both cached by their settings."""

    demo = env_demo_config(measured_engine(cfg), Path("."), sft_seed)
    if scale.sft_steps is not None:
        demo = demo.copy_with(sft={"steps": scale.sft_steps})
    if not scale.sft_select:
        demo = demo.copy_with(sft={"select_every": 0})
    policy = run_sft(demo, progress=progress).path
    rm_sft = {k: v for k, v in (("steps", scale.rm_sft_steps),
                                ("batch_size", scale.rm_sft_batch_size),
                                ("lr", scale.rm_sft_lr)) if v is not None}
    if rm_sft:
        demo = demo.copy_with(sft=rm_sft)
    rm = run_rm_sft(demo, policy, n_tasks=scale.rm_tasks, max_difficulty=EVAL_MAX_DIFFICULTY,
                    label_noise=label_noise, progress=progress,
                    select_tasks=scale.rm_select_tasks).path
    return str(policy), str(rm)


def measure(trainer: Any, cfg: ClawRayConfig, tasks: list[Any],
            contexts: list[Any]) -> dict[str, Any]:
    """(i) held-out policy success through serving (the env-demo's evaluation); (ii) RM step
    accuracy on ``contexts``."""

    t0 = time.perf_counter()
    held = held_out_success(trainer, cfg, tasks)
    # Seeded scorings: the RM's accuracy before and after differs by its weights, not by luck.
    scored = asyncio.run(StepScorer(cfg, trainer.app).score_steps(contexts, seed=RM_EVAL_SEED))
    rm = step_accuracy([c.progress for c in contexts], [s.scores for s in scored])
    # Against the trajectory outcome (Theorem 1's mu), on the steps an episode took (not the
    # expert steps that top up the progress class).
    took = [i for i, c in enumerate(contexts) if c.outcome is not None]
    rm_outcome = step_accuracy([bool(contexts[i].outcome) for i in took],
                               [scored[i].scores for i in took])
    # Without the invalid-action cue: the RM on valid actions only (did the action make
    # progress), and what the one-cue rule scores on all steps and on valid ones.
    valid = [i for i, c in enumerate(contexts) if c.valid]
    rule = nothing_happens_rule(contexts)
    progress = [c.progress for c in contexts]
    return {"success": held["success"], "success_stderr": held["stderr"],
            "episodes": held["n"], "rm": rm, "rm_outcome": rm_outcome,
            "rm_valid": step_accuracy([progress[i] for i in valid],
                                      [scored[i].scores for i in valid]),
            "rule": step_accuracy(progress, rule),
            "rule_valid": step_accuracy([progress[i] for i in valid], [rule[i] for i in valid]),
            "policy_version": trainer.version,
            "seconds": time.perf_counter() - t0}


def describe(measured: dict[str, Any]) -> str:
    """One line of ``measure``'s numbers (an RM with no parseable scoring has no accuracy)."""
    rm = _rm(measured["rm"])
    f = (lambda v: "-" if v is None else f"{v:.3f}")
    return (f"held-out success {measured['success']:.1%}, RM balanced accuracy "
            f"{f(rm['balanced_acc'])} (p₊ {f(rm['plus_acc'])}, p₋ {f(rm['minus_acc'])}, "
            f"unparseable {f(rm['unparseable'])})")


@contextlib.contextmanager
def cluster(cfg: ClawRayConfig, rows: int = 1) -> Iterator[None]:
    """A local Ray cluster with Serve for ``rows`` rows at once; the caller's if it started
    one (``ray.init`` first), which is then left running."""
    own = not ray.is_initialized()
    if own:
        # Logical CPUs beyond the cores: the actors mostly wait on each other (as the tests'
        # cluster). A row asks for about 3 (replicas, learners, runners).
        init_local_ray(num_cpus=max(4 * rows, os.cpu_count() or 1), include_dashboard=False,
                       log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": cfg.serving_cfg.port})
        yield
    finally:
        if own:
            ray.shutdown()


def run_row(cfg: ClawRayConfig, steps: int, tasks: list[Any], contexts: list[Any],
            before: dict[str, Any] | None, log: Callable[[str], None]) -> dict[str, Any]:
    """One row in its own Serve app, on a cluster of its own unless one is running;
    ``before`` measured if None."""
    t0 = time.monotonic()
    with cluster(cfg):
        return _run_row(cfg, steps, tasks, contexts, before, log, t0)


def _run_row(cfg: ClawRayConfig, steps: int, tasks: list[Any], contexts: list[Any],
             before: dict[str, Any] | None, log: Callable[[str], None],
             t0: float) -> dict[str, Any]:
    app = cfg.training_cfg.app
    serve.run(build_app(cfg), name=app, route_prefix=f"/{app}")
    try:
        trainer = Trainer(config=cfg.to_dict())
        try:
            if before is None:
                before = measure(trainer, cfg, tasks, contexts)
                log(f"  before: {describe(before)}")
            per_step = []
            for i in range(1, steps + 1):
                r = trainer.train()
                per_step.append({"step": i, **{k: r.get(k) for k in STEP_KEYS}})
                log(f"  step {i}/{steps}: success {r.get('rla_success', 0):.2f}, policy rows "
                    f"{r.get('rla_policy_rows')}, RM rows {r.get('rla_rm_rows')}, rewrites "
                    f"accepted {r.get('env_accepted')}/{r.get('env_proposed')} proposed")
            after = measure(trainer, cfg, tasks, contexts)
            adapter = trainer.rla.metrics()
        finally:
            trainer.stop()
    finally:
        serve.delete(app)
    log(f"  after: {describe(after)}")
    return {"before": before, "after": after, "steps": per_step,
            "accepted_total": sum(s["env_accepted"] or 0 for s in per_step),
            "env_adapter": adapter, "seconds": time.monotonic() - t0}


def _parallel_rows(cfgs: dict[str, ClawRayConfig], steps: int, tasks: list[Any],
                   contexts: list[Any], log: Callable[[str], None],
                   done: Callable[[str, dict[str, Any]], dict[str, Any]],
                   seed: int) -> dict[str, Any]:
    """The rows of one seed at once, on one cluster, each in its own Serve app (its own
    replicas) measuring its own "before". Both evaluations are seeded, but the rows' "before"
    figures are not always equal: three rows at the tiny scale in one notebook run measured
    different ones (and took no less time than one after another on 2 cores)."""
    from concurrent.futures import ThreadPoolExecutor

    first = next(iter(cfgs.values()))
    summary: dict[str, Any] = {}
    with cluster(first, len(cfgs)), ThreadPoolExecutor(len(cfgs)) as pool:
        t0 = time.monotonic()
        futures = {row: pool.submit(_run_row, c, steps, tasks, contexts, None,
                                    lambda m, row=row: log(f"seed {seed} [{row}] {m.strip()}"),
                                    t0)
                   for row, c in cfgs.items()}
        for row, future in futures.items():
            summary = done(row, future.result())
    return summary


def run_table(cfg: ClawRayConfig, out: Path, seeds: list[int], rows: list[str] | None = None,
              label_noise: float = RM_LABEL_NOISE, sft_seed: int = 0, scale: Scale = FULL,
              parallel: bool = False, log: Callable[[str], None] = print,
              eval_pool: str = "test") -> dict[str, Any]:
    """Every row for every seed (the RL run's seed; all start from the warm starts of
    ``sft_seed``) at ``scale``; writes and returns the summary.

    ``parallel``: a seed's rows run at once on one cluster (faster where the rows leave cores
    idle, as the small scale does; the measured table ran its rows one after another, each on
    its own cluster)."""

    cfg = measured_engine(cfg)
    rows = rows or list(ROWS)
    check_rows(rows)  # before any row runs
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {row: {} for row in rows}
    t0 = time.monotonic()
    policy, rm = warm_starts(cfg, sft_seed, label_noise, scale)
    log(f"warm starts: policy {policy}, RM {rm}")
    for seed in seeds:
        cfgs = {row: table_config(cfg, out, row, seed, policy, rm, scale) for row in rows}
        first = cfgs[rows[0]]
        tasks = held_out_tasks(first, scale.eval_tasks, seed, eval_pool) * EVAL_SAMPLES
        contexts = collect_steps(policy, first, scale.eval_step_tasks, EVAL_MAX_DIFFICULTY,
                                 seed + EVAL_SEED_OFFSET,
                                 first.environments_cfg.pool(eval_pool))

        def done(row: str, result: dict[str, Any]) -> dict[str, Any]:
            runs[row][str(seed)] = result
            summary = summarize(runs, seeds, scale.steps, label_noise, time.monotonic() - t0)
            summary.update(policy=policy, rm=rm, sft_seed=sft_seed, parallel=parallel,
                           eval_pool=eval_pool, warm_start=WARM_START,
                           scale=dataclasses.asdict(scale))
            (out / "rla_table.json").write_text(json.dumps(summary, indent=2))
            # one after another, the seed's first row measures "before" for all of them
            ledger.record_lines(ledger_lines(summary, row, seed,
                                             None if parallel else rows[0]))
            return summary

        if parallel:
            summary = _parallel_rows(cfgs, scale.steps, tasks, contexts, log, done, seed)
            continue
        before = None
        for row in rows:
            log(f"seed {seed}, row {row}:")
            result = run_row(cfgs[row], scale.steps, tasks, contexts, before, log)
            before = result["before"]
            summary = done(row, result)
    write_table(summary, out)
    return summary


def experiment_name(summary: dict[str, Any]) -> str:
    """The table's experiment on the ledger: ``rla-table`` at the full scale with clean RM
    labels; otherwise the nearest named scale and what differs from it, and the label noise
    (``rla-table-small``, ``rla-table-small-steps4``, ``rla-table-noise0.2``); then the policy
    warm start's recipe (``env_demo.warm_start_suffix``: ``-warm2`` since 2026-12-07)."""
    scale = summary["scale"]
    named = {k: dataclasses.asdict(v) for k, v in SCALES.items()}
    base = min(named, key=lambda k: sum(named[k][f] != scale.get(f) for f in named[k]))
    name = "rla-table" + ("" if base == "full" else f"-{base}") + "".join(
        f"-{f}{scale.get(f)}" for f in named[base] if named[base][f] != scale.get(f))
    noise = summary.get("rm_label_noise") or 0.0
    return (name + (f"-noise{noise:g}" if noise != RM_LABEL_NOISE else "")
            + warm_start_suffix(summary))


def ledger_lines(summary: dict[str, Any], row: str, seed: int,
                 before_from: str | None = None) -> list[dict[str, Any]]:
    """One row's figures of one seed for the ledger (``experiment_name``, the row as the arm),
    on the summary's evaluation pool: held-out success and the RM's balanced accuracy against
    the step oracle, each before, after and the change; the RM's p₊ and p₋ and its balanced
    accuracy against the trajectory outcome, before and after. Only what was measured (an RM
    with no parseable scoring has no accuracy). ``before_from``: the row whose run measured
    this seed's "before" when it is another row (rows run one after another share it): this
    row then records no "before" of its own, and its changes name the row they pair with."""
    r = summary["runs"][row][str(seed)]
    measured_here = before_from in (None, row)
    fields = {"experiment": experiment_name(summary), "arm": row, "seed": seed,
              "pool": summary.get("eval_pool") or "test", "steps": summary["steps"],
              "sft_seed": summary.get("sft_seed")}
    if not measured_here:
        fields["before_from"] = before_from
    rm = {when: _rm(r[when]["rm"]) for when in ("before", "after")}
    outcome = {when: _rm(r[when].get("rm_outcome") or {}) for when in ("before", "after")}
    lines = ledger.before_after("success", r["before"]["success"], r["after"]["success"],
                                record_before=measured_here, n=r["after"].get("episodes"),
                                **fields)
    lines += ledger.before_after("rm_balanced_acc", rm["before"]["balanced_acc"],
                                 rm["after"]["balanced_acc"], record_before=measured_here,
                                 n=rm["after"].get("n_steps"), **fields)
    valid = {when: _rm(r[when].get("rm_valid") or {}) for when in ("before", "after")}
    lines += ledger.before_after("rm_valid_balanced_acc", valid["before"].get("balanced_acc"),
                                 valid["after"].get("balanced_acc"), record_before=measured_here,
                                 n=valid["after"].get("n_steps"), **fields)
    if measured_here:  # the rule reads the steps only: one figure a seed, with its "before"
        for metric in ("rule", "rule_valid"):
            m = _rm(r["before"].get(metric) or {})
            if m.get("balanced_acc") is not None:
                lines.append({**fields, "metric": f"{metric}_balanced_acc",
                              "value": m["balanced_acc"], "n": m.get("n_steps")})
    for when in ("before", "after"):
        if when == "before" and not measured_here:
            continue
        for metric, m, key in (("rm_plus_acc", rm, "plus_acc"),
                               ("rm_minus_acc", rm, "minus_acc"),
                               ("rm_outcome_balanced_acc", outcome, "balanced_acc")):
            if m[when].get(key) is not None:
                lines.append({**fields, "metric": f"{metric}_{when}", "value": m[when][key],
                              "n": m[when].get("n_steps")})
    return lines


# What a table's runs must share to be one table: the same warm starts, evaluation and scale.
MERGE_KEYS = ("steps", "policy", "rm", "sft_seed", "eval_pool", "scale", "rm_label_noise",
              "warm_start")


def merge_tables(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One table from runs made apart (rows or seeds run at different times, as
    ``--rows``/``--seeds`` allow): the runs must share ``MERGE_KEYS`` (else a ValueError naming
    the key) and no (row, seed) may appear twice. Every row of a seed then starts from the same
    weights and is evaluated on the same seeded tasks and steps, so the paired comparisons hold;
    where two runs' "before" measurements of a seed differ anyway (they are seeded, so they
    should not), the summary lists them under ``before_differs`` rather than hiding it."""
    if len(summaries) < 2:
        raise ValueError("merging needs at least two rla_table.json results")
    first = summaries[0]
    for k, other in enumerate(summaries[1:], 2):
        for key in MERGE_KEYS:
            if other.get(key) != first.get(key):
                raise ValueError(f"result {k} differs from result 1 in {key!r} "
                                 f"({other.get(key)!r} vs {first.get(key)!r}): not one table")
    runs: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for row, by_seed in summary["runs"].items():
            for seed, result in by_seed.items():
                if seed in runs.get(row, {}):
                    raise ValueError(f"row {row!r}, seed {seed} appears in two results")
                runs.setdefault(row, {})[seed] = result
    check_rows(list(runs))
    runs = {row: dict(sorted(runs[row].items(), key=lambda kv: int(kv[0])))
            for row in sorted(runs, key=lambda r: list(ROWS).index(r))}
    differs = []
    for seed in sorted({s for by_seed in runs.values() for s in by_seed}, key=int):
        befores = {row: _before_key(by_seed[seed]["before"])
                   for row, by_seed in runs.items() if seed in by_seed}
        if len({json.dumps(b, sort_keys=True) for b in befores.values()}) > 1:
            differs.append({"seed": seed, "before": befores})
    seeds = sorted({int(s) for by_seed in runs.values() for s in by_seed})
    summary = summarize(runs, seeds, first["steps"], first.get("rm_label_noise", 0.0),
                        sum(s.get("seconds", 0.0) for s in summaries))
    summary.update({key: first.get(key) for key in MERGE_KEYS if key != "steps"},
                   parallel=any(s.get("parallel") for s in summaries),
                   merged_from=len(summaries), before_differs=differs)
    return summary


def _before_key(before: dict[str, Any]) -> dict[str, Any]:
    """A "before" measurement without what may differ between equal runs (time, version)."""
    return {k: v for k, v in before.items() if k not in ("seconds", "policy_version")}


def write_table(summary: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "rla_table.json").write_text(json.dumps(summary, indent=2))
    (out / "rla_table.md").write_text(table_markdown(summary))
    plot_table(summary, out / "rla_table.png")


def _spread(values: list[float]) -> dict[str, Any]:
    """Mean, population std and standard error (sample std / √n) over seeds."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    if not len(arr):
        return {"mean": None, "std": None, "se": None, "n": 0, "values": []}
    se = float(arr.std(ddof=1) / np.sqrt(len(arr))) if len(arr) > 1 else None
    return {"mean": float(arr.mean()), "std": float(arr.std()), "se": se, "n": int(len(arr)),
            "values": [float(v) for v in arr]}


def _rm(rm: dict[str, Any]) -> dict[str, Any]:
    """An RM measurement with its balanced accuracy (older results lack the key)."""
    return {**rm, **balanced(rm.get("plus_acc"), rm.get("minus_acc"))}


def _step_mean(steps: list[dict[str, Any]], key: str) -> float | None:
    values = [s[key] for s in steps if s.get(key) is not None]
    return float(np.mean(values)) if values else None


def table_rows(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary's rows, recomputed from its runs when it predates a measure."""
    rows = summary["rows"]
    if all("success_change" in t and "rm_balanced_acc_after" in t for t in rows.values()):
        return rows
    return summarize(summary["runs"], summary["seeds"], summary["steps"],
                     summary.get("rm_label_noise", 0.0), summary.get("seconds", 0.0))["rows"]


def summarize(runs: dict[str, dict[str, Any]], seeds: list[int], steps: int,
              label_noise: float, seconds: float) -> dict[str, Any]:
    """Per row: mean and spread over seeds of each measure, before and after."""
    table = {}
    base = runs.get("policy", {})

    def change(r: dict[str, Any], key: Callable[[dict[str, Any]], float | None]) -> float | None:
        a, b = key(r["after"]), key(r["before"])
        return None if a is None or b is None else a - b

    def success(m: dict[str, Any]) -> float | None:
        return m["success"]

    def bal(key: str) -> Callable[[dict[str, Any]], float | None]:
        """A measurement's balanced accuracy of RM measure ``key`` (None where not taken)."""
        return lambda m: _rm(m.get(key) or {})["balanced_acc"]

    for row, by_seed in runs.items():
        rs = list(by_seed.values())
        table[row] = {
            # Paired per seed: a row's after minus its before (the same held-out tasks and
            # starting weights), and its after minus the policy-only row's after.
            "success_change": _spread([change(r, success) for r in rs]),
            "rm_balanced_change": _spread([change(r, bal("rm")) for r in rs]),
            "success_vs_policy": _spread([r["after"]["success"] - base[s]["after"]["success"]
                                          for s, r in by_seed.items()
                                          if row != "policy" and s in base]),
            "difficulty_after": _spread([r.get("env_adapter", {}).get("mean_active_difficulty")
                                         for r in rs]),
            "seeds": list(by_seed),
            "success_before": _spread([r["before"]["success"] for r in rs]),
            "success_after": _spread([r["after"]["success"] for r in rs]),
            "rm_step_acc_before": _spread([r["before"]["rm"]["step_acc"] for r in rs]),
            "rm_step_acc_after": _spread([r["after"]["rm"]["step_acc"] for r in rs]),
            **{f"rm_{k}_{when}": _spread([_rm(r[when]["rm"])[k] for r in rs])
               for k in ("balanced_acc", "plus_acc", "minus_acc") for when in ("before", "after")},
            "rm_majority_acc_before": _spread([r["before"]["rm"]["majority_acc"] for r in rs]),
            "rm_majority_acc_after": _spread([r["after"]["rm"]["majority_acc"] for r in rs]),
            "accepted_rewrites": _spread([r["accepted_total"] for r in rs]),
            "rm_mu_before": _spread([_rm(r["before"]["rm"])["mu"] for r in rs]),
            # Theorem 1 in the co-training data: what the consistency target sign(R) says on
            # the steps the co-trainer trains on, against the step oracle (per seed, the mean
            # over its steps; results that predate the measure have none).
            **{f"target_{k}": _spread([_step_mean(r["steps"], f"trained_target_{k}")
                                       for r in rs])
               for k in ("plus_acc", "minus_acc", "balanced_acc")},
            # Theorem 1's own mu: the RM against the trajectory outcome, on the held-out steps
            # (before / after, paired) and on each step's own rollouts (the mean over steps).
            **{f"rm_outcome_{k}_{when}": _spread([_rm(r[when].get("rm_outcome") or {}).get(k)
                                                  for r in rs])
               for k in ("balanced_acc", "plus_acc", "minus_acc", "mu")
               for when in ("before", "after")},
            "rm_outcome_balanced_change": _spread([change(r, bal("rm_outcome")) for r in rs]),
            # Without the invalid-action cue: the RM on valid actions only, before / after,
            # paired; the one-cue rule on all steps and on valid ones (results that predate
            # the measure have none).
            **{f"rm_valid_{k}_{when}": _spread([_rm(r[when].get("rm_valid") or {}).get(k)
                                                for r in rs])
               for k in ("balanced_acc", "plus_acc", "minus_acc") for when in ("before", "after")},
            "rm_valid_balanced_change": _spread([change(r, bal("rm_valid")) for r in rs]),
            **{f"{rule}_balanced_acc": _spread([_rm(r["before"].get(rule) or {}).get(
                "balanced_acc") for r in rs]) for rule in ("rule", "rule_valid")},
            # Which way co-training pushed the RM: the share of its trained steps whose target
            # is +1 (per seed the mean over steps; results that predate the measure have none).
            "target_positive_share": _spread([_step_mean(r["steps"],
                                                         "trained_target_positive_share")
                                              for r in rs]),
            "rm_outcome_mu_batches": _spread([_step_mean(r["steps"], "rm_outcome_mu")
                                              for r in rs]),
        }
    return {"rows": table, "runs": runs, "seeds": seeds, "steps": steps,
            "rm_label_noise": label_noise, "seconds": seconds}


def table_markdown(summary: dict[str, Any]) -> str:
    def cell(s: dict[str, Any], pct: bool) -> str:
        if s["mean"] is None:
            return "-"
        f = (lambda v: f"{100 * v:.1f} %") if pct else (lambda v: f"{v:.3f}")
        se = s.get("se")
        return f(s["mean"]) + (f" ± {f(se)}" if se is not None else "")

    lines = [f"Seeds {summary['seeds']}, {summary['steps']} steps per row "
             f"(mean ± standard error over seeds). RM accuracy against the step oracle: "
             f"balanced accuracy (p₊ + p₋)/2 of single scorings, p₊ on progress steps, p₋ on "
             f"no-progress steps.", "",
             "| row | held-out success before | after | RM balanced acc before | after "
             "| RM p₊ after | RM p₋ after | accepted rewrites |",
             "|---|---|---|---|---|---|---|---|"]
    for row, t in table_rows(summary).items():
        lines.append(
            f"| {row} | {cell(t['success_before'], True)} | {cell(t['success_after'], True)} "
            f"| {cell(t['rm_balanced_acc_before'], False)} "
            f"| {cell(t['rm_balanced_acc_after'], False)} "
            f"| {cell(t['rm_plus_acc_after'], False)} | {cell(t['rm_minus_acc_after'], False)} "
            f"| {cell(t['accepted_rewrites'], False)} |")
    lines += ["", "Paired over seeds (every row of a seed starts from the same weights and is "
              "measured on the same held-out tasks and steps): the change after − before, the "
              "row's success after minus the policy-only row's, and the mean difficulty "
              "(0 easiest, 1 hardest) of the adapter's active tasks at the end.", "",
              "| row | success change | success vs policy row | RM balanced acc change "
              "| active task difficulty at the end |", "|---|---|---|---|---|"]
    for row, t in table_rows(summary).items():
        if "success_change" not in t:
            continue
        lines.append(
            f"| {row} | {cell(t['success_change'], True)} "
            f"| {cell(t['success_vs_policy'], True)} "
            f"| {cell(t['rm_balanced_change'], False)} "
            f"| {cell(t['difficulty_after'], False)} |")
    none = {"mean": None}
    theorem = {row: t for row, t in table_rows(summary).items()
               if t.get("target_balanced_acc", {}).get("mean") is not None
               or t.get("rm_outcome_mu_before", {}).get("mean") is not None}
    if theorem:
        lines += ["", "Theorem 1 in the co-training data: the RM's μ = p₊ + p₋ before, against "
                  "the step oracle and against the trajectory outcome (Theorem 1's μ: steps of "
                  "successful episodes should score +1; the held-out steps an episode took); "
                  "the consistency target sign(R) against the step oracle on the steps the "
                  "co-trainer trains on (RM-band tasks, unequally rewarded scorings; per seed "
                  "the mean over its steps, measured in every row); and the RM's balanced "
                  "accuracy change on the held-out steps, against each label.", "",
                  "| row | RM μ before (step oracle) | RM μ before (outcome) | target p₊ "
                  "| target p₋ | target balanced acc | RM balanced acc change (step oracle) "
                  "| RM balanced acc change (outcome) |", "|---|---|---|---|---|---|---|---|"]
        for row, t in theorem.items():
            lines.append(
                f"| {row} | {cell(t['rm_mu_before'], False)} "
                f"| {cell(t.get('rm_outcome_mu_before', none), False)} "
                f"| {cell(t.get('target_plus_acc', none), False)} "
                f"| {cell(t.get('target_minus_acc', none), False)} "
                f"| {cell(t.get('target_balanced_acc', none), False)} "
                f"| {cell(t['rm_balanced_change'], False)} "
                f"| {cell(t.get('rm_outcome_balanced_change', none), False)} |")
    cue = {row: t for row, t in table_rows(summary).items()
           if t.get("rm_valid_balanced_acc_before", {}).get("mean") is not None}
    if cue:
        lines += ["", "Without the invalid-action cue: the RM's balanced accuracy against the "
                  "step oracle on all held-out steps and on valid actions only (where the "
                  "question is whether the action made progress), before → after, next to the "
                  "one-cue rule (−1 iff the observation says \"nothing happens\"; on valid "
                  "actions it always says +1).", "",
                  "| row | RM all steps: before | after | rule, all steps | RM valid actions: "
                  "before | after | change (paired) | RM valid p₊ after | RM valid p₋ after "
                  "| rule, valid actions |", "|---|---|---|---|---|---|---|---|---|---|"]
        for row, t in cue.items():
            lines.append(
                f"| {row} | {cell(t['rm_balanced_acc_before'], False)} "
                f"| {cell(t['rm_balanced_acc_after'], False)} "
                f"| {cell(t['rule_balanced_acc'], False)} "
                f"| {cell(t['rm_valid_balanced_acc_before'], False)} "
                f"| {cell(t['rm_valid_balanced_acc_after'], False)} "
                f"| {cell(t['rm_valid_balanced_change'], False)} "
                f"| {cell(t['rm_valid_plus_acc_after'], False)} "
                f"| {cell(t['rm_valid_minus_acc_after'], False)} "
                f"| {cell(t['rule_valid_balanced_acc'], False)} |")
    lines += ["", "Per seed: held-out success before → after, rollout success (the mean over the "
              "steps), the co-trainer's RM rows over the run, accepted rewrites of proposed, and "
              "the RM's balanced accuracy (p₊, p₋) before → after against the step oracle and "
              "against the trajectory outcome.", "",
              "| row | seed | held-out success | rollout success | RM rows | rewrites "
              "| RM vs step oracle | RM vs outcome |", "|---|---|---|---|---|---|---|---|"]
    for row, by_seed in summary["runs"].items():
        for seed, r in by_seed.items():
            lines.append(f"| {row} | {seed} | {_pct(r['before']['success'])} → "
                         f"{_pct(r['after']['success'])} "
                         f"| {_pct(_step_mean(r['steps'], 'rla_success'))} "
                         f"| {sum(s.get('rla_rm_rows') or 0 for s in r['steps'])} "
                         f"| {r.get('accepted_total', 0)} of "
                         f"{sum(s.get('env_proposed') or 0 for s in r['steps'])} "
                         f"| {_rm_change(r, 'rm')} | {_rm_change(r, 'rm_outcome')} |")
    if summary.get("merged_from"):
        lines += ["", f"Merged from {summary['merged_from']} runs that share their warm starts, "
                  "evaluation and scale (`clawray rla-table --merge`)."]
        for d in summary.get("before_differs") or []:
            successes = ", ".join(f"{row} {b.get('success')}" for row, b in d["before"].items())
            lines.append(f"- seed {d['seed']}: the rows' before measurements differ "
                         f"(held-out success {successes})")
    return "\n".join(lines) + "\n"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _rm_change(r: dict[str, Any], key: str) -> str:
    """``0.792 (0.82, 0.77) → 0.854 (0.97, 0.73)``: balanced (p₊, p₋) before → after."""
    def one(m: dict[str, Any] | None) -> str:
        b = _rm(m or {})
        if b.get("balanced_acc") is None:
            return "-"
        return f"{b['balanced_acc']:.3f} ({b['plus_acc']:.2f}, {b['minus_acc']:.2f})"
    return f"{one(r['before'].get(key))} → {one(r['after'].get(key))}"


def plot_table(summary: dict[str, Any], path: Path) -> None:
    # No matplotlib.use("Agg") here: it would switch a notebook's inline backend off for every
    # later plot; without a display matplotlib picks Agg by itself.
    import matplotlib.pyplot as plt

    fig = draw_table(summary)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def draw_table(summary: dict[str, Any]) -> Any:
    """The table's figure: success and RM accuracy before/after per row, accepted rewrites."""
    import matplotlib.pyplot as plt

    table = table_rows(summary)
    rows = list(table)
    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    x = np.arange(len(rows))
    for ax, key, title in ((axes[0], "success", "held-out policy success"),
                           (axes[1], "rm_balanced_acc", "RM balanced accuracy (vs step oracle)")):
        for k, (when, off) in enumerate((("before", -0.2), ("after", 0.2))):
            s = [table[r][f"{key}_{when}"] for r in rows]
            ax.bar(x + off, [v["mean"] or 0 for v in s], 0.4,
                   yerr=[v.get("se") or 0 for v in s], label=when, color=f"C{k}")
        ax.set(title=title, xticks=x, xticklabels=rows, ylim=(0, 1))
        ax.legend()
    for row in rows:
        for seed, run in summary["runs"][row].items():
            acc = np.cumsum([s["env_accepted"] or 0 for s in run["steps"]])
            axes[2].plot(range(1, len(acc) + 1), acc, ".-", label=f"{row} (seed {seed})")
    axes[2].set(title="accepted rewrites (cumulative)", xlabel="step")
    axes[2].legend(fontsize=7)
    # The co-trained RM on each step's own rollouts against the step oracle: p+ solid, p- dashed.
    k = 0
    for row in rows:
        for seed, run in summary["runs"][row].items():
            if not any(s.get("rm_version") for s in run["steps"]):
                continue
            for key, style in (("rm_plus_acc", "-"), ("rm_minus_acc", "--")):
                axes[3].plot(range(1, len(run["steps"]) + 1),
                             [s.get(key) if s.get(key) is not None else np.nan
                              for s in run["steps"]], style, color=f"C{k}",
                             label=f"{row} (seed {seed})" if style == "-" else None)
            k += 1
    axes[3].set(title="co-trained RM on its rollouts: p₊ (solid), p₋ (dashed)", xlabel="step",
                ylim=(0, 1))
    if k:
        axes[3].legend(fontsize=7)
    fig.tight_layout()
    return fig
