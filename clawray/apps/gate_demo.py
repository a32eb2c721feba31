"""``clawray demo --gate``: the policy gate against a poisoned judge, and on a healthy run.

Four simulated users talk to one clawray through its HTTP API, each with a key of their own,
greetings and questions half each (as in ``clawray demo --per-user``). One shared LoRA policy
trains on their turns. Each run is on a fresh cluster, with and without ``gate.enabled``:

- ``poisoned``: the users want detailed replies (``DetailedReplies``: at least 10 words) and
  the judge is ``clawray.judging.rules:brevity_judge``, which rewards replies of at most 8
  words whatever the user said: training pushes the policy toward what these users dislike
  (short answers to questions, which the embedded model learns fast). Without the gate every
  new version serves everyone; with it, each version is shadow-evaluated on held-out
  ``validation`` prompts (and the health checks) before any user sees it.
- ``healthy``: users who want brief replies (``BriefReplies``), the heuristic judge reading
  their reactions (the live demo's default): what does the gate cost in improvement?

How the shadow evaluation scores a reply (``shadow_score``):

- ``feedback`` (the default; the arm name ends ``-feedback``): with something an operator has. Before training, the users rate
  the base model's replies to ``FEEDBACK_N`` validation prompts up or down (explicit feedback,
  kept out of training: ``feedback.jsonl``); a reply scorer fitted on those ratings
  (``clawray.gate.feedback``, its cross-validated balanced accuracy in the summary) scores the
  candidate's and the incumbent's replies to those prompts;
- ``preference``: with the users' hidden preference itself (an oracle no operator has; how
  the runs before 2026-12-06 scored).

Before and after, the users' satisfaction is measured on the held-out ``test`` pool (with a
gate, the candidate pending at the end is set aside first, so "after" is what serves
everyone). Reported per run: before/after, live satisfaction by serving version, user turns
served by versions the gate abandoned, and the time from each abandoned version's publication
to its rejection or rollback. Writes ``gate.json`` and ``gate.png`` into ``--out``, and each
run's figures to the ledger (``clawray.ledger``: experiment ``gate-demo``, or
``gate-demo-<model>`` on a real model; arm
``<scenario>/<nogate|gate-restart|gate-keep_line>[-feedback]``; ``ledger_lines``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from clawray import ledger
from clawray.apps.demo import UserPool, demo_config, is_real_model, run_defaults
from clawray.config import ClawRayConfig
from clawray.sim.preferences import BriefReplies, DetailedReplies
from clawray.sim.users import evaluate

SCENARIOS = ("poisoned", "healthy")
END_OF_RUN_WHY = "end of the demonstration run"
END_OF_RUN = f"demo: rejected by hand ({END_OF_RUN_WHY})"  # not the gate's decision
JUDGES = {"poisoned": "clawray.judging.rules:brevity_judge",
          "healthy": "clawray.judging.rules:heuristic_judge"}
USERS_WANT = {"poisoned": DetailedReplies, "healthy": BriefReplies}
TYPE_WEIGHTS = {"greeting": 0.5, "question": 0.5}
USERS = 4
BUDGET = 768  # rows trained per run
EVAL_N = 120
LORA = {"lora_rank": 8, "lora_alpha": 16.0, "lr": 3e-3}
KL = 1.0
ON_REJECT = "restart"
# The canary's test needs turns: judge rewards in {-1, 0, 1} spread ~0.9, so 30 turns a side
# per look and half the sessions (a first run with 12 turns and a quarter of the sessions
# promoted nothing in 768 rows: its confidence bounds were +-0.4 to +-0.8 wide).
SHADOW_SCORES = ("feedback", "preference")
FEEDBACK_N = 160  # rated replies the operator holds out (users' explicit thumbs)
FEEDBACK_SEED = 7919  # their sampling seeds differ from the shadow evaluation's
GATE = {"canary_share": 0.5, "canary_min_turns": 30, "canary_looks": 3, "canary_margin": 0.3,
        "shadow_margin": 0.05, "shadow_set": "clawray.sim.users:shadow_set",
        "shadow_kwargs": {"n": 40, "pool": "validation", "type_weights": TYPE_WEIGHTS}}


def gate_demo_config(cfg: ClawRayConfig, out: Path, seed: int, scenario: str, gated: bool,
                     keys: list[str], on_reject: str = ON_REJECT,
                     shadow_score: str = "feedback") -> ClawRayConfig:
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}: one of {SCENARIOS}")
    if shadow_score not in SHADOW_SCORES:
        raise ValueError(f"unknown shadow score {shadow_score!r}: one of {SHADOW_SCORES}")
    if shadow_score == "feedback":  # the file run_once writes before training starts
        shadow = {"shadow_set": "clawray.gate.feedback:feedback_shadow_set",
                  "shadow_kwargs": {"path": str(out / "feedback.jsonl"),
                                    "n": GATE["shadow_kwargs"]["n"], "seed": seed}}
    else:
        shadow = {"shadow_kwargs": {**GATE["shadow_kwargs"],
                                    "preference": USERS_WANT[scenario].name}}
    # the embedded model's LoRA settings; a real model keeps the live demo's (REAL_MODEL)
    lora = ({} if is_real_model(cfg)
            else {"inference": {"max_lora_rank": LORA["lora_rank"]},
                  "training": {**LORA, "loss": {"kl_coef": KL}}})
    return demo_config(cfg, out, seed).copy_with(**lora).copy_with(
        serving={"api_keys": keys},
        inference={"max_loras": 4},
        # rows carry the version of the adapter that sampled them (the incumbent may be far
        # behind the trainer's newest): no staleness limit, in both arms alike
        buffer={"max_staleness": None, "lease_s": 120.0},
        judge={"backend": "function", "function": JUDGES[scenario]},
        training={"zero_stage": 0},
        gate={**GATE, "enabled": gated, "dir": str(out / "gate"), "on_reject": on_reject,
              **shadow})


def collect_feedback(base_url: str, api_key: str, model: str, pref: Any, path: Path, *,
                     seed: int, n: int = FEEDBACK_N, **sampling: Any) -> dict[str, Any]:
    """The users' explicit ratings of the serving model's replies to ``n`` validation
    prompts (up: the reply satisfied them), written as rated replies to ``path``; the reply
    scorer's report on them."""
    from clawray.gate.feedback import FeedbackScorer, read_rated
    from clawray.sim.users import SYSTEM_PROMPT

    r = asyncio.run(evaluate(base_url, api_key, model, n=n, seed=seed * 100 + FEEDBACK_SEED,
                             preference=pref, pool="validation", type_weights=TYPE_WEIGHTS,
                             **sampling))
    rows = [{"messages": [{"role": "system", "content": SYSTEM_PROMPT},
                          {"role": "user", "content": x.request}],
             "reply": x.reply, "rating": "up" if x.satisfied else "down"}
            for x in r.interactions if x.satisfied is not None]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return FeedbackScorer.fit(read_rated(path), seed=seed).report


def run_once(cfg: ClawRayConfig, out: Path, *, seed: int, scenario: str, gated: bool,
             budget: int = BUDGET, eval_n: int = EVAL_N, eval_pool: str = "test",
             on_reject: str = ON_REJECT, shadow_score: str = "feedback",
             log: Any = print) -> dict[str, Any]:
    import ray

    from clawray.apps.launch import start_serving
    from clawray.gate.actor import get_policy_gate
    from clawray.models.loader import policy_model_info
    from clawray.training.trainer import Trainer

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    keys = [f"sk-demo-{seed}-{secrets.token_urlsafe(16)}" for _ in range(USERS)]
    cfg = gate_demo_config(cfg, out, seed, scenario, gated, keys, on_reject, shadow_score)
    pref = USERS_WANT[scenario](phrasing="keywords")  # the heuristic judge reads its keywords
    # the model's sampling: the embedded model's, or a real model's (shorter replies, cooler)
    sampling = {k: run_defaults(cfg)[k] for k in ("temperature", "max_tokens")}
    started = time.monotonic()
    name = f"{scenario}, " + (f"gate ({on_reject}, {shadow_score})" if gated else "no gate")
    scorer = None
    try:
        base_url = start_serving(cfg, blocking=False)
        model = policy_model_info(cfg).name

        def held_out() -> float:
            r = asyncio.run(evaluate(base_url, keys[0], model, n=eval_n, seed=seed,
                                     preference=pref, pool=eval_pool,
                                     type_weights=TYPE_WEIGHTS, **sampling))
            return r.rate

        log(f"clawray demo --gate: seed {seed}, {name}: serving at {base_url} "
            f"({time.monotonic() - started:.0f} s)")
        before = held_out()
        log(f"  before: {before:.1%} satisfied on the held-out {eval_pool!r} pool")
        if gated and shadow_score == "feedback":
            scorer = collect_feedback(base_url, keys[0], model, pref, out / "feedback.jsonl",
                                      seed=seed, **sampling)
            log(f"  explicit feedback held out: {scorer['up']} up, {scorer['down']} down; "
                "the shadow scorer's balanced accuracy "
                f"{scorer['scorer']['balanced_accuracy']:.3f} (length alone "
                f"{scorer['length_only']['balanced_accuracy']:.3f}), cross-validated")
        trainer = Trainer(config=cfg.to_dict())
        gate = get_policy_gate(cfg.training_cfg.app) if gated else None
        pool = UserPool(base_url, model, [(k, pref) for k in keys], seed,
                        out / "interactions.jsonl", TYPE_WEIGHTS, **sampling).start()
        trained, steps, curve = 0, 0, []
        try:
            while trained < budget and steps < 4 * budget // 32:
                r = trainer.train()
                steps += 1
                trained += int(r.get("samples", 0) if "optimizer_steps" in r else 0)
                st = ray.get(gate.status.remote()) if gate is not None else None
                point = {"step": steps, "rows_trained": trained, "t": time.monotonic() - started,
                         "version": r.get("policy_version"),
                         "serving": st["incumbent"] if st else r.get("policy_version"),
                         "candidate": st["candidate"] if st else None,
                         "phase": st["phase"] if st else None}
                curve.append(point)
                log(f"  step {steps:>3}  rows {trained:>4}/{budget}  trained version "
                    f"{point['version']}  serving everyone {point['serving']}"
                    + (f"  candidate {point['candidate']} ({point['phase']})"
                       if point["candidate"] else ""))
        finally:
            pool.stop()
            trainer.stop()
        if gate is not None:  # "after" is what serves everyone: set a pending candidate aside
            st = ray.get(gate.status.remote())
            if st["candidate"] is not None:
                ray.get(gate.reject.remote(END_OF_RUN_WHY, by="demo"))
        after = held_out()
        log(f"  after:  {after:.1%}")
        events = ray.get(gate.events.remote(200)) if gate is not None else []
    finally:
        ray.shutdown()
    summary = {"seed": seed, "scenario": scenario, "gated": gated, "model": model,
               "real_model": is_real_model(cfg),
               "on_reject": on_reject if gated else None,
               "shadow_score": shadow_score if gated else None, "shadow_scorer": scorer,
               "budget": budget,
               "eval_pool": eval_pool, "eval_n": eval_n,
               "rows_trained": trained, "steps": steps, "before": before, "after": after,
               "curve": curve, "events": events, **turns_by_version(pool, events),
               "judge": JUDGES[scenario], "gate": GATE if gated else None,
               "lora_rank": cfg.training_cfg.lora_rank, "lr": cfg.training_cfg.lr,
               "kl": cfg.training_cfg.loss.kl_coef,
               "seconds": round(time.monotonic() - started, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    ledger.record_lines(ledger_lines(summary))
    return summary


def ledger_lines(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's lines for the ledger (experiment ``gate-demo``, ``gate-demo-<model>`` on a
    real model; arm
    ``<scenario>/<arm_name>``): the users' satisfaction before, after and the change on the
    held-out pool; with a gate its decisions in numbers, measured on the live turns (pool
    ``train``, the users' request pool): the versions it promoted and abandoned, and the share
    of live turns that abandoned versions served."""
    experiment = "gate-demo" + (f"-{summary['model']}" if summary.get("real_model") else "")
    fields = {"experiment": experiment, "seed": summary["seed"],
              "arm": f"{summary['scenario']}/{arm_of(summary)}",
              "budget": summary["budget"], "rows_trained": summary["rows_trained"]}
    lines = ledger.before_after("satisfaction", summary["before"], summary["after"],
                                pool=summary["eval_pool"], n=summary["eval_n"], **fields)
    if summary["gated"]:
        live = {**fields, "pool": "train", "measured_on": "live turns"}
        promoted = {ev["version"] for ev in summary["events"] if ev["event"] == "promoted"}
        lines += [{**live, "metric": "versions_promoted", "value": len(promoted), "n": None},
                  {**live, "metric": "versions_abandoned", "value": len(summary["abandoned"]),
                   "n": None}]
        if summary["live_turns"]:
            lines.append({**live, "metric": "abandoned_turn_share", "n": summary["live_turns"],
                          "value": summary["turns_by_abandoned"] / summary["live_turns"]})
    return lines


def turns_by_version(pool: UserPool, events: list[dict[str, Any]]) -> dict[str, Any]:
    """The users' live turns and satisfaction by serving version; turns served by versions the
    gate rejected or rolled back (with ``restart``: every version of an abandoned line); for
    each rejected or rolled-back version the seconds from its publication and from its canary
    start (users see it from there; None: rejected at shadow) to that decision."""
    by = pool.rate_by_version()
    abandoned: set[int] = set()
    exposure = []
    published: dict[int, float] = {}
    canary: dict[int, float] = {}
    for ev in events:
        if ev["event"] in ("candidate", "queued", "held"):
            published.setdefault(ev["version"], ev["t"])
        elif ev["event"] == "canary":
            canary[ev["version"]] = ev["t"]
        if ev["event"] in ("rejected", "rolled_back") and not str(
                ev.get("reason", "")).startswith(END_OF_RUN):
            abandoned.update(ev.get("abandoned") or ev.get("rejected") or [ev["version"]])
            v = ev["version"]
            if v in published:
                exposure.append({"version": v, "how": ev["event"], "reason": ev.get("reason"),
                                 "from_publication_s": round(ev["t"] - published[v], 1),
                                 "from_canary_s": (round(ev["t"] - canary[v], 1)
                                                   if v in canary else None)})
    turns = sum(n for _, n in by.values())
    bad = sum(n for v, (_, n) in by.items() if v in abandoned)
    return {"live_by_version": {str(v): {"rate": r, "turns": n} for v, (r, n) in by.items()},
            "live_turns": turns, "turns_by_abandoned": bad, "abandoned": sorted(abandoned),
            "exposure": exposure}


def arm_name(gated: bool, on_reject: str, shadow_score: str = "feedback") -> str:
    if not gated:
        return "nogate"
    return f"gate-{on_reject}" + ("-feedback" if shadow_score == "feedback" else "")


def arm_of(summary: dict[str, Any]) -> str:
    """A run's arm (runs before shadow scores were named scored with the preference)."""
    return arm_name(summary["gated"], summary.get("on_reject") or ON_REJECT,
                    summary.get("shadow_score") or "preference")


def run_gate_demo(cfg: ClawRayConfig, out: Path, seeds: list[int],
                  scenarios: tuple[str, ...] = SCENARIOS,
                  arms: tuple[bool, ...] = (False, True), on_reject: str = ON_REJECT,
                  **kwargs: Any) -> int:
    """Every scenario with (and without) the gate for every seed, then gate.json, gate.png."""
    score = kwargs.get("shadow_score", "feedback")
    summaries = [run_once(cfg, out / f"{sc}-{arm_name(g, on_reject, score)}-seed{seed}",
                          seed=seed, scenario=sc, gated=g, on_reject=on_reject, **kwargs)
                 for seed in seeds for sc in scenarios for g in arms]
    agg = write_results(summaries, out)
    for key, a in agg.items():
        print(f"clawray demo --gate: {key}: held-out {a['before']['mean']:.1%} → "
              f"{a['after']['mean']:.1%} (change {a['change']['mean']:+.1%} ± "
              f"{a['change']['stderr'] or 0:.1%}); live turns by abandoned versions "
              f"{a['turns_by_abandoned']} of {a['live_turns']}")
    print(f"clawray demo --gate: {out / 'gate.json'}, plot {out / 'gate.png'}")
    return 0


def combine(runs: list[Path], out: Path) -> dict[str, Any]:
    """Runs made one by one (each ``--out`` folder's ``gate.json``, or a run's
    ``summary.json``) into one ``gate.json`` and ``gate.png`` in ``out``: the aggregate over
    seeds per scenario and arm."""
    summaries = []
    for path in runs:
        path = Path(path)
        if path.is_dir():
            path = path / "gate.json"
        data = json.loads(path.read_text())
        summaries += data["runs"] if "runs" in data else [data]
    if not summaries:
        raise ValueError("no runs to combine")
    return write_results(summaries, out)


def write_results(summaries: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """``out/gate.json`` (the aggregate, the paired comparisons and every run) and
    ``out/gate.png``; the aggregate."""
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(summaries)
    (out / "gate.json").write_text(json.dumps(
        {"aggregate": agg, "paired": paired(summaries), "runs": summaries}, indent=2,
        default=str))
    plot(summaries, out / "gate.png")
    return agg


def arm_label(s: dict[str, Any]) -> str:
    """A run's arm as the aggregate names it: "no gate", "gate (restart, feedback)", ..."""
    if not s["gated"]:
        return "no gate"
    scored = ", feedback" if s.get("shadow_score") == "feedback" else ""
    return f"gate ({s.get('on_reject')}{scored})"


def paired(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario, each gated arm's change of the held-out satisfaction against the no-gate
    arm's, paired by seed (``clawray.stats.paired_difference``: mean and standard error of the
    per-seed differences, a paired t-test's p)."""
    from clawray.stats import paired_difference

    out = {}
    for sc in SCENARIOS:
        runs = [s for s in summaries if s["scenario"] == sc]
        nogate = {s["seed"]: s["after"] - s["before"] for s in runs if not s["gated"]}
        for arm in sorted({arm_label(s) for s in runs if s["gated"]}):
            gated = {s["seed"]: s["after"] - s["before"] for s in runs if arm_label(s) == arm}
            if set(gated) & set(nogate):
                out[f"{sc}: {arm} - no gate"] = paired_difference(gated, nogate)
    return out


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    import numpy as np

    def stat(v: list[float]) -> dict[str, Any]:
        a = np.asarray(v, dtype=float)
        return {"mean": float(a.mean()), "values": [float(x) for x in a],
                "stderr": float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else None}

    out = {}
    arms = sorted({arm_label(s) for s in summaries})
    for sc in SCENARIOS:
        for arm in arms:
            runs = [s for s in summaries if s["scenario"] == sc and arm_label(s) == arm]
            if runs:
                out[f"{sc}, {arm}"] = {
                    "seeds": [s["seed"] for s in runs],
                    "before": stat([s["before"] for s in runs]),
                    "after": stat([s["after"] for s in runs]),
                    "change": stat([s["after"] - s["before"] for s in runs]),
                    "turns_by_abandoned": sum(s["turns_by_abandoned"] for s in runs),
                    "live_turns": sum(s["live_turns"] for s in runs)}
    return out


def curve_of(summary: dict[str, Any], grid: list[int]) -> list[float | None]:
    """The live satisfaction of the version serving everyone, at each number of rows trained in
    ``grid`` (the version serving at the last step at or before it; None before the first)."""
    live = summary["live_by_version"]
    out: list[float | None] = []
    for x in grid:
        at = [p for p in summary["curve"] if p["rows_trained"] <= x]
        v = at[-1]["serving"] if at else 0
        out.append(live.get(str(v), {}).get("rate"))
    return out


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    """Per scenario: the live satisfaction of the version serving everyone against rows
    trained, per arm the mean over seeds with its standard error (seeds faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    budget = max((s["budget"] for s in summaries), default=BUDGET)
    grid = list(range(0, budget + 1, 32))
    colors = {"nogate": "tab:red", "gate-restart": "tab:green", "gate-keep_line": "tab:blue",
              "gate-restart-feedback": "tab:olive", "gate-keep_line-feedback": "tab:cyan"}
    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(12, 4.5), squeeze=False)
    for ax, sc in zip(axes[0], SCENARIOS):
        arms = sorted({arm_of(s) for s in summaries if s["scenario"] == sc})
        for arm in arms:
            runs = [s for s in summaries if s["scenario"] == sc and arm_of(s) == arm]
            ys = np.array([[np.nan if y is None else y for y in curve_of(s, grid)]
                           for s in runs], dtype=float)
            color = colors.get(arm, "tab:gray")
            for row in ys:
                ax.plot(grid, row, color=color, alpha=0.2, lw=0.8)
            n = np.sum(~np.isnan(ys), axis=0)
            mean = np.nanmean(np.where(n > 0, ys, 0.0), axis=0)
            se = np.where(n > 1, np.nanstd(ys, axis=0, ddof=1) / np.sqrt(np.maximum(n, 1)), 0.0)
            ax.plot(grid, mean, color=color, lw=2, label=f"{arm} (mean of {len(runs)} seeds "
                    "± s.e.)")
            ax.fill_between(grid, mean - se, mean + se, color=color, alpha=0.15)
        ax.set(title=f"{sc} run", xlabel="rows trained",
               ylabel="live users satisfied by the version serving everyone", ylim=(0, 1))
        if arms:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
