"""``clawray demo --per-user``: users who want opposite things, one shared policy against a
policy per user.

Two groups of simulated users (``clawray.sim``) talk to one clawray through its HTTP API,
each user with an API key of their own: the "brief" group wants replies of at most 8 words,
the "detailed" group at least 10 (``BriefReplies`` / ``DetailedReplies``; on the embedded
model their base rates are ~0.4 and ~0.6 and a reply that pleases one group displeases the
other). Both groups send requests of the same prompt pool and say what they think in the
heuristic judge's keywords (the live demo's default judge). Each seed runs twice on a fresh
cluster, with the same sample budget and the same LoRA settings:

- ``shared``: one LoRA policy trained on everyone's turns (what OpenClaw-RL and every other
  system of the field does);
- ``per_user``: ``training.per_user``, one LoRA adapter per user trained on that user's turns
  only and served to that user only (``docs/per_user.md``);
- ``per_user_shuffled``, the control: ``per_user`` with ``judge.control: shuffled_feedback``
  (each turn judged by what a user said about another turn): adapters of their own that must
  not move toward their users' preference, since what the users said no longer reaches them;
- ``per_user_hidden``, the second control: ``per_user`` with ``judge.control: reply_hidden``
  (the judge sees the user's reaction but not the reply): what the users' words alone carry;
- ``per_user_frozen``, the third: ``per_user``'s settings with training off: the held-out
  evaluation run twice with nothing trained between (no users play: without training what
  they say changes nothing), the drift of the measurement itself.

``aggregate`` pairs the arms by seed, per group: ``per_user`` against ``shared`` and against
its control (``scipy.stats.ttest_rel`` through ``clawray.stats.paired_difference``).

Before and after training every user's satisfaction is measured on the held-out ``test``
prompt pool (``--eval-pool validation`` for choosing settings), with that user's key (so
their own adapter serves them) and seeded sampling. Per group: the mean over its users; over
seeds: mean and standard error. Writes ``per_user.json`` and ``per_user.png`` (held-out
before/after per group and mode, and the live satisfaction of each group against the rows
trained) into ``--out``, and each run's per-group before, after and change to the ledger
(``clawray.ledger``: experiment ``per-user-demo``, arm ``<mode>/<group>``; ``ledger_lines``).
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
from clawray.apps.demo import (UserPool, demo_config, is_real_model, judge_description,
                               run_defaults, users_phrasing, with_judge)
from clawray.config import ClawRayConfig
from clawray.sim.preferences import BriefReplies, DetailedReplies, Preference
from clawray.sim.users import evaluate

GROUPS: dict[str, type] = {"brief": BriefReplies, "detailed": DetailedReplies}
# Greetings and questions, half each, for both groups. Requests are left out: the embedded
# model answers 97-99% of them with its 3-word canned reply and almost never with 10 words or
# more, so a user who wants detail there gives RL nothing to reinforce (measured: a run with
# requests moved the "detailed" users' request rate 0.07 -> 0.13 and 0.0 -> 0.08 in 1536
# rows; docs/per_user.md). On greetings and questions each group's missing reply is the
# other's usual one (3-5% of samples), so both groups can learn.
TYPE_WEIGHTS = {"greeting": 0.5, "question": 0.5}
MODES = ("shared", "per_user", "per_user_shuffled", "per_user_hidden", "per_user_frozen")
# mode -> judge.control
CONTROL = {"per_user_shuffled": "shuffled_feedback", "per_user_hidden": "reply_hidden"}
USERS_PER_GROUP = 2
BUDGET = 1536  # rows trained per run, in both modes
EVAL_N = 60  # held-out requests per user
LORA = {"lora_rank": 8, "lora_alpha": 16.0}
USER_ROWS = (8, 16)  # per-user mode: a user is trained once this many rows wait; at most
# LoRA learning rate, chosen on the validation prompt pool (docs/per_user.md)
LR = 3e-3
# k3 KL weight to the base (the live demo's), chosen on the validation pool (docs/per_user.md)
KL = 1.0


def per_user_demo_config(cfg: ClawRayConfig, out: Path, seed: int, mode: str,
                         keys: list[str], lr: float = LR, kl: float = KL) -> ClawRayConfig:
    """The live demo's settings (``demo_config``) with LoRA, one key per user, and for
    ``per_user`` the trainer's per-user mode. Both modes read the buffer the same way (leases,
    no staleness limit: per-user rows carry their adapter's version)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {MODES}")
    per_user = trains_per_user(mode)
    n = len(keys)
    return demo_config(cfg, out, seed).copy_with(
        judge={"control": CONTROL.get(mode, "none")},
        serving={"api_keys": keys},
        inference={"max_loras": n, "max_lora_rank": LORA["lora_rank"]},
        buffer={"max_staleness": None, "lease_s": 120.0},
        training={**LORA, "lr": lr, "loss": {"kl_coef": kl}, "zero_stage": 0,
                  "per_user": per_user,
                  "per_user_min_rows": USER_ROWS[0], "per_user_max_rows": USER_ROWS[1],
                  "per_user_max_users": 2, "user_adapters_dir": str(out / "users")})


def trains_per_user(mode: str) -> bool:
    return mode.startswith("per_user")


def make_members(seed: int, users_per_group: int) -> list[tuple[str, str, str]]:
    """(group, user name, API key) of every simulated user; keys are fresh random secrets
    (never printed, never written)."""
    return [(group, f"{group}-{i}", f"sk-demo-{seed}-{secrets.token_urlsafe(16)}")
            for group in GROUPS for i in range(users_per_group)]


async def evaluate_users(base_url: str, model: str, members: list[tuple[str, str, str]],
                         preferences: dict[str, Preference], *, n: int, seed: int,
                         pool: str, **sampling: Any) -> dict[str, Any]:
    """Each user's satisfaction on ``n`` requests of prompt pool ``pool`` (user ``i`` its own
    seeded set, ``seed * 1000 + i``: a group is measured on its users' requests together),
    asked with their own key; per group the mean of its users' rates."""
    users: dict[str, Any] = {}
    for i, (group, name, key) in enumerate(members):
        r = await evaluate(base_url, key, model, n=n, seed=seed * 1000 + i,
                           preference=preferences[group], pool=pool,
                           type_weights=TYPE_WEIGHTS, **sampling)
        users[name] = {"group": group, "rate": r.rate, "n": r.n, "errors": r.errors,
                       "per_type": r.per_type, "policy_versions": r.policy_versions}
    groups = {g: sum(u["rate"] for u in users.values() if u["group"] == g)
              / sum(u["group"] == g for u in users.values()) for g in GROUPS}
    return {"users": users, "groups": groups,
            "errors": sum(u["errors"] for u in users.values())}


def run_once(cfg: ClawRayConfig, out: Path, *, seed: int, mode: str,
             users_per_group: int = USERS_PER_GROUP, budget: int = BUDGET,
             eval_n: int = EVAL_N, eval_pool: str = "test", lr: float = LR,
             kl: float = KL, judge: str = "heuristic", log: Any = print) -> dict[str, Any]:
    """One seed of one mode on a fresh local cluster: evaluate, train until ``budget`` rows
    are trained, evaluate again. Returns (and writes to ``out/summary.json``) the summary."""
    import ray

    from clawray.apps.launch import start_serving
    from clawray.models.loader import policy_model_info
    from clawray.training.trainer import Trainer

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    members = make_members(seed, users_per_group)
    cfg = with_judge(per_user_demo_config(cfg, out, seed, mode, [k for _, _, k in members],
                                          lr, kl), judge, log=log)
    assert cfg.judge_cfg.control == CONTROL.get(mode, "none")  # with_judge keeps the control
    phrasing = users_phrasing(cfg)
    preferences = {g: cls(phrasing=phrasing) for g, cls in GROUPS.items()}
    # the model's sampling: the embedded model's, or a real model's (shorter replies, cooler)
    sampling = {k: run_defaults(cfg)[k] for k in ("temperature", "max_tokens")}
    started = time.monotonic()
    try:
        base_url = start_serving(cfg, blocking=False)
        model = policy_model_info(cfg).name
        log(f"clawray demo --per-user: seed {seed}, {mode}: serving at {base_url} "
            f"({time.monotonic() - started:.0f} s); {len(members)} users with keys of their "
            f"own: {', '.join(n for _, n, _ in members)}")
        before = asyncio.run(evaluate_users(base_url, model, members, preferences, n=eval_n,
                                            seed=seed, pool=eval_pool, **sampling))
        log("  before: " + _groups_line(before))
        curve: list[dict[str, Any]] = []
        trained, seen, steps, interactions = 0, 0, 0, []
        trains = mode != "per_user_frozen"  # training off: measure again at once
        trainer = Trainer(config=cfg.to_dict()) if trains else None
        index = {i: g for i, (g, _, _) in enumerate(members)}
        pool = UserPool(base_url, model, [(k, preferences[g]) for g, _, k in members], seed,
                        out / "interactions.jsonl", TYPE_WEIGHTS, **sampling
                        ).start() if trains else None
        try:
            while trainer is not None and trained < budget and steps < 4 * budget // 16:
                r = trainer.train()
                steps += 1
                trained += int(r.get("user_rows", 0) if trains_per_user(mode)
                               else r.get("samples", 0))
                now = list(pool.interactions)
                window, seen = now[seen:], len(now)
                live = {g: _rate([x.satisfied for x in window if index.get(x.user) == g])
                        for g in GROUPS}
                curve.append({"step": steps, "rows_trained": trained, "live": live})
                log(f"  step {steps:>3}  rows trained {trained:>4}/{budget}  live: "
                    + "  ".join(f"{g} {v:.0%}" if v is not None else f"{g} -"
                                for g, v in live.items()))
        finally:
            if pool is not None:
                pool.stop()
                interactions = list(pool.interactions)
            if trainer is not None:
                trainer.stop()
        after = asyncio.run(evaluate_users(base_url, model, members, preferences, n=eval_n,
                                           seed=seed, pool=eval_pool, **sampling))
        log("  after:  " + _groups_line(after))
    finally:
        ray.shutdown()
    summary = {"seed": seed, "mode": mode, "model": model, "real_model": is_real_model(cfg),
               "budget": budget, "rows_trained": trained,
               "steps": steps, "eval_pool": eval_pool, "eval_n_per_user": eval_n,
               "users_per_group": users_per_group, "lr": lr, "kl_coef": kl, **LORA,
               "type_weights": TYPE_WEIGHTS, "sampling": sampling,
               "judge": judge_description(cfg), "users_phrasing": phrasing,
               "before": before, "after": after, "curve": curve,
               "user_errors": sum(x.error is not None for x in interactions),
               "seconds": round(time.monotonic() - started, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    ledger.record_lines(ledger_lines(summary))
    return summary


def ledger_lines(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One run's lines for the ledger: per user group its satisfaction before, after and the
    change on the held-out pool (the mean of its users' rates; n: its users' requests).
    Experiment ``per-user-demo`` (``-judge-model`` with the judge model; ``-<model>`` on a
    real model), arm ``<mode>/<group>``."""
    keyword = str(summary["judge"]).startswith("function")
    experiment = "per-user-demo" + ("" if keyword else "-judge-model") + (
        f"-{summary['model']}" if summary.get("real_model") else "")
    lines = []
    for group in GROUPS:
        n = sum(u["n"] for u in summary["after"]["users"].values() if u["group"] == group)
        lines += ledger.before_after(
            "satisfaction", summary["before"]["groups"][group],
            summary["after"]["groups"][group], experiment=experiment,
            arm=f"{summary['mode']}/{group}", seed=summary["seed"], pool=summary["eval_pool"],
            n=n or None, budget=summary["budget"], rows_trained=summary["rows_trained"],
            lr=summary["lr"], kl_coef=summary["kl_coef"])
    return lines


def _rate(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _groups_line(ev: dict[str, Any]) -> str:
    return "  ".join(f"{g} {r:.1%}" for g, r in ev["groups"].items())


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode and group: before, after and the rise over seeds (mean, standard error with
    n - 1, per-seed values)."""
    import numpy as np

    def stat(v: list[float]) -> dict[str, Any]:
        a = np.asarray(v, dtype=float)
        return {"mean": float(a.mean()), "values": [float(x) for x in a],
                "stderr": float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else None}

    out: dict[str, Any] = {"modes": {}}
    for mode in MODES:
        runs = [s for s in summaries if s["mode"] == mode]
        if not runs:
            continue
        groups = {}
        for g in GROUPS:
            b = [s["before"]["groups"][g] for s in runs]
            a = [s["after"]["groups"][g] for s in runs]
            groups[g] = {"before": stat(b), "after": stat(a),
                         "rise": stat([y - x for x, y in zip(b, a)])}
        out["modes"][mode] = {"seeds": [s["seed"] for s in runs], "groups": groups,
                              "rows_trained": [s["rows_trained"] for s in runs],
                              "user_errors": sum(s["user_errors"] for s in runs)}
    out["paired"] = paired(summaries)
    first = summaries[0]
    out.update({k: first[k] for k in ("budget", "eval_pool", "eval_n_per_user",
                                      "users_per_group", "lr", "lora_rank", "judge")})
    return out


def paired(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Per group, ``per_user``'s rise against each other arm's, paired by seed: "per_user −
    shared" (adapters of their own against one policy) and "per_user − per_user_shuffled"
    (what the users said against feedback of other turns)."""
    from clawray.stats import paired_difference

    def rises(mode: str, group: str) -> dict[int, float]:
        return {s["seed"]: s["after"]["groups"][group] - s["before"]["groups"][group]
                for s in summaries if s["mode"] == mode}

    out = {}
    for other in ("shared", "per_user_shuffled", "per_user_hidden", "per_user_frozen"):
        if any(s["mode"] == other for s in summaries) and any(
                s["mode"] == "per_user" for s in summaries):
            out[f"per_user - {other}"] = {g: paired_difference(rises("per_user", g),
                                                               rises(other, g)) for g in GROUPS}
    return out


def plot(agg: dict[str, Any], summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    colors = {"brief": "tab:blue", "detailed": "tab:orange"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = {"shared": 0, "per_user": 1, "per_user_shuffled": 2, "per_user_hidden": 3,
          "per_user_frozen": 4}
    labelled: set[str] = set()
    for mode, m in agg["modes"].items():
        for j, (g, st) in enumerate(m["groups"].items()):
            x = xs[mode] + (j - 0.5) * 0.3
            a.errorbar([x - 0.05, x + 0.05], [st["before"]["mean"], st["after"]["mean"]],
                       yerr=[st["before"]["stderr"] or 0, st["after"]["stderr"] or 0],
                       fmt="o-", color=colors[g], capsize=3,
                       label=None if g in labelled else f"{g} users")
            labelled.add(g)
            a.annotate(f"{st['before']['mean']:.0%}→{st['after']['mean']:.0%}",
                       (x, st["after"]["mean"]), textcoords="offset points", xytext=(0, 8),
                       ha="center", fontsize=8, color=colors[g])
    names = {"shared": "one shared policy", "per_user": "a policy per user",
             "per_user_shuffled": "per user, shuffled\nfeedback (control)",
             "per_user_hidden": "per user, reply\nhidden (control)",
             "per_user_frozen": "training off\n(control)"}
    seeds = {m: len(v["seeds"]) for m, v in agg["modes"].items()}
    shown = [m for m in MODES if m in agg["modes"] or m in ("shared", "per_user")]
    a.set(xticks=[xs[m] for m in shown], xticklabels=[f"{names[m]}\n({seeds.get(m, 0)} seeds)"
                                                      for m in shown],
          ylim=(0, 1.08), ylabel=f"satisfied, held-out '{agg['eval_pool']}' prompts",
          title=f"Before → after {agg['budget']} rows (mean ± s.e. over seeds)")
    a.legend(loc="lower center")
    edges = np.linspace(0, agg["budget"], 9)
    for mode in agg["modes"]:
        for g in GROUPS:
            pts = [(c["rows_trained"], c["live"][g]) for s in summaries if s["mode"] == mode
                   for c in s["curve"] if c["live"][g] is not None]
            if not pts:
                continue
            rows, rates = np.asarray(pts, dtype=float).T
            where = np.clip(np.digitize(rows, edges[1:-1]), 0, len(edges) - 2)
            xs_, ys_ = zip(*[((edges[k] + edges[k + 1]) / 2, rates[where == k].mean())
                             for k in range(len(edges) - 1) if (where == k).any()])
            b.plot(xs_, ys_, {"per_user": "o-", "shared": "s--", "per_user_hidden": "v-."
                              }.get(mode, "^:"),
                   color=colors[g])
    b.plot([], [], "--", color="grey", label="shared policy")
    b.plot([], [], "-", color="grey", label="policy per user")
    if "per_user_shuffled" in agg["modes"]:
        b.plot([], [], ":", color="grey", label="per user, shuffled feedback")
    if "per_user_hidden" in agg["modes"]:
        b.plot([], [], "-.", color="grey", label="per user, reply hidden")
    b.set(xlabel="rows trained", ylabel="live satisfaction", ylim=(0, 1.02),
          title="Live users while training (mean over seeds, by eighth of the budget)")
    b.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(summaries: list[dict[str, Any]], out: Path) -> dict[str, Any]:
    """``out/per_user.json`` (the aggregate) and ``out/per_user.png``; the aggregate."""
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(summaries)
    (out / "per_user.json").write_text(json.dumps(agg, indent=2))
    plot(agg, summaries, out / "per_user.png")
    return agg


def combine(runs: list[Path], out: Path) -> dict[str, Any]:
    """Runs made one by one (each ``--out`` folder, whose ``<mode>-seed<k>/summary.json`` are
    its runs) into one ``per_user.json`` and ``per_user.png`` in ``out``. A seed and mode met
    twice is refused: the first registered run is the one reported (the ledger lists both)."""
    summaries, seen = [], {}
    for folder in runs:
        for path in sorted(Path(folder).glob("*-seed*/summary.json")):
            s = json.loads(path.read_text())
            key = (s["mode"], s["seed"])
            if key in seen:
                raise ValueError(f"{path}: {s['mode']} seed {s['seed']} is also {seen[key]}; "
                                 "combine one run per seed and mode")
            seen[key] = path
            summaries.append(s)
    if not summaries:
        raise ValueError(f"no runs (<mode>-seed<k>/summary.json) under {runs}")
    return write_results(summaries, out)


def run_per_user_demo(cfg: ClawRayConfig, out: Path, seeds: list[int],
                      modes: tuple[str, ...] = MODES, **kwargs: Any) -> int:
    """Every mode for every seed (``out/<mode>-seed<k>``), then ``per_user.json`` and
    ``per_user.png``. 1 when per-user adapters (if they ran) did not raise both groups in
    every seed, else 0."""
    summaries = [run_once(cfg, out / f"{mode}-seed{seed}", seed=seed, mode=mode, **kwargs)
                 for seed in seeds for mode in modes]
    agg = write_results(summaries, out)
    for mode, m in agg["modes"].items():
        print(f"clawray demo --per-user: {mode}: " + "; ".join(
            f"{g} {st['before']['mean']:.1%} → {st['after']['mean']:.1%} (rise "
            f"{st['rise']['mean']:+.1%} ± {st['rise']['stderr'] or 0:.1%})"
            for g, st in m["groups"].items()))
    print(f"clawray demo --per-user: {out / 'per_user.json'}, plot {out / 'per_user.png'}")
    per_user = agg["modes"].get("per_user")
    if per_user is None:  # only the other arms ran: nothing to check
        return 0
    ok = all(all(v > 0 for v in st["rise"]["values"]) for st in per_user["groups"].values())
    return 0 if ok else 1
