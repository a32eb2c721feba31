"""Env-runner throughput: episodes/s and tokens/s of 1, 2 and 4 ``EnvRunner`` actors playing
the household family against the served tiny policy, next to the limit they play against: the
policy deployment's own generation rate.

    .venv/bin/python bench/envs.py --quick        # smoke run (2 runners), ~1 min on 2 cores
    .venv/bin/python bench/envs.py                # 3 interleaved rounds, 25 s windows, ~14 min
    .venv/bin/python bench/envs.py --runners 1,2,4,8 --limit-concurrency 8,16,32

One local Ray cluster (``ray.init(address="local")``), one Serve app (colocated layout: the HF
engine inside the ingress replica, ``replica_num_cpus`` 1, records off), one env buffer and one
uniform curriculum shared by every configuration. Settings are the ones a small-model run
uses: ``history_window`` 0 (household observations are Markov), ``max_tokens`` 8, ``group_size``
4, ``concurrency`` 2 groups per runner, ``runner_num_cpus`` 0 (so 4 runners fit on 2 cores),
the env buffer's default ``seal_age_s`` (a group's ``add`` returns once its rows are durable).

Configurations (rows of the table):

    generate c=N   the limit: an async actor calls the app's policy handle (``policy_handle``,
                   the same ``generate(prompt_ids, params)`` the runners call) with N calls in
                   flight, no environment, no tokenizer; prompts are real household
                   observations rendered with ``rollout.render_prompt`` (random tasks of the
                   whole difficulty box, a mix of first observations and later ones after an
                   invalid or an expert move, as an untrained policy sees them), the same
                   ``max_tokens``, temperature and top-p
    N runner(s)    an ``EnvRunnerGroup`` of N runners playing GRPO groups: start, warm up,
                   counter deltas of ``stats()`` over the window, stop, shut down

N runners keep at most ``N x concurrency x group_size`` calls in flight (8, 16, 32 here).
Tokens are generated tokens (the response ids; an end-of-sequence id counts), calls are
``generate`` calls (one per env step). Runner counters move when a group is written, so a
window counts whole groups; the warm-up (first groups written) and windows of many groups keep
that edge small. Configurations are interleaved: round ``i`` runs each once in an order rotated
by ``i``. Before each window the benchmark waits for a quiet machine (``wait_for_quiet``) and
during it measures, per process, the CPU of its own process tree (the driver and the whole
local Ray cluster), of other processes at normal priority (the noise indicator) and of other
processes at nice >= 10 (background jobs: they yield the CPU to this benchmark, so the wait
allows for them and they do not count as noise, but they still slow it down somewhat and are
reported as ``niced_pct``); a window where others at normal priority took more than
``--max-foreign-pct`` of the machine is run again (``--retries``), keeping the least
disturbed.

Writes ``bench/results/envs.json`` and ``bench/results/envs.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from _report import apply_profile, machine_info, wait_for_quiet, write_results  # noqa: E402

APP = "bench-envs"
NAMESPACE = "bench-envs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- prompts

def sample_prompts(tokenizer: Any, family_name: str, n: int, seed: int,
                   history_window: int | None, expert_share: float = 0.2,
                   max_steps: int = 8) -> list[list[int]]:
    """``n`` prompts as runners render them: random tasks of the whole box (the uniform
    curriculum's distribution), each played for up to ``max_steps`` steps with an invalid move
    (``expert_share`` of the time the expert's), every step's prompt rendered with
    ``render_prompt`` of the ``history_window`` context."""
    from clawray.envs import make_family
    from clawray.envs.rollout import context_messages, render_prompt

    family = make_family(family_name)
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    while len(prompts) < n:
        task = family.sample(rng)
        env = family.make_env()
        messages = env.reset(task)
        tools = getattr(env, "tools", None) or family.tools
        for _ in range(rng.randint(1, max_steps)):
            prompts.append(render_prompt(tokenizer, context_messages(messages, history_window),
                                         tools))
            action = (env.expert_action() if rng.random() < expert_share
                      else env.as_action("look around"))
            result = env.step(action)
            messages = messages + [action.message()] + result.messages
            if result.done or len(prompts) >= n:
                break
    return prompts


# ---------------------------------------------------------------------------- CPU accounting

NICED = 10  # processes at this nice value or higher yield to ours: background, not noise


def own_pids() -> set[int]:
    """This process and all its descendants (the local Ray cluster's GCS, raylet and workers
    are children of the driver that started it)."""
    import psutil

    me = psutil.Process()
    return {me.pid} | {p.pid for p in me.children(recursive=True)}


def process_cpu() -> dict[int, tuple[float, int]]:
    """CPU seconds and nice value of every process."""
    import psutil

    out = {}
    for p in psutil.process_iter():
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[p.pid] = (t.user + t.system, p.nice())
        except psutil.Error:
            pass
    return out


class CpuWindow:
    """CPU over a window, as shares of the whole machine: ``own_pct`` (this benchmark's process
    tree, the Ray cluster included), ``foreign_pct`` (other processes at normal priority: the
    noise indicator) and ``niced_pct`` (other processes at nice >= 10, background jobs that
    yield to ours)."""

    def __init__(self) -> None:
        self.cpu0, self.t0 = process_cpu(), time.perf_counter()

    def end(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        cpu1, mine = process_cpu(), own_pids()
        own = foreign = niced = 0.0
        for pid, (cpu, nice) in cpu1.items():
            delta = cpu - self.cpu0.get(pid, (0.0, nice))[0]
            if pid in mine:
                own += delta
            elif nice >= NICED:
                niced += delta
            else:
                foreign += delta
        cap = 100.0 / (wall * (os.cpu_count() or 1))
        return {"own_pct": round(own * cap, 1), "foreign_pct": round(foreign * cap, 1),
                "niced_pct": round(niced * cap, 1)}


def wait_for_quiet_machine(max_wait_s: float, busy_pct: float,
                           log: Callable[[str], None]) -> float:
    """``wait_for_quiet`` for processes at normal priority: niced background jobs (which yield
    to ours) are added to the allowance. Returns the busy CPU % last seen."""
    if max_wait_s <= 0:
        return wait_for_quiet(0, log)
    probe = CpuWindow()
    time.sleep(1.0)
    niced = probe.end()["niced_pct"]
    return wait_for_quiet(max_wait_s, log, busy_pct=busy_pct + niced)


# ---------------------------------------------------------------------------- the limit

def generation_load_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class GenerationLoad:
        """Calls the app's policy handle like a runner does, minus the environment."""

        def __init__(self, config: dict[str, Any], app: str) -> None:
            from clawray.config import ClawRayConfig
            from clawray.rollout.runner import policy_handle
            from clawray.inference.engine import SamplingParams

            cfg = ClawRayConfig.from_dict(config)
            e = cfg.environments_cfg
            self.handle = policy_handle(app, cfg)
            self.params = SamplingParams(max_tokens=e.max_tokens, temperature=e.temperature,
                                         top_p=e.top_p)

        async def run(self, prompts: list[list[int]], concurrency: int, warmup_s: float,
                      window_s: float) -> dict[str, Any]:
            """``concurrency`` callers back to back; counts the calls that complete inside
            ``[warmup_s, warmup_s + window_s]``."""
            loop = asyncio.get_running_loop()
            start = loop.time()
            t0, t1 = start + warmup_s, start + warmup_s + window_s
            calls, tokens, latencies, errors = 0, 0, [], 0
            prompt_tokens = 0

            async def caller(k: int) -> None:
                nonlocal calls, tokens, errors, prompt_tokens
                i = k
                while loop.time() < t1:
                    prompt = prompts[i % len(prompts)]
                    i += concurrency
                    sent = loop.time()
                    try:
                        out = (await self.handle.generate.remote(prompt, self.params))[0]
                    except Exception:  # noqa: BLE001 - counted, not fatal
                        errors += 1
                        await asyncio.sleep(0.05)
                        continue
                    done = loop.time()
                    if t0 <= done <= t1:
                        calls += 1
                        tokens += len(out.token_ids)
                        prompt_tokens += len(prompt)
                        latencies.append(done - sent)

            await asyncio.gather(*(caller(k) for k in range(concurrency)))
            return {"calls": calls, "tokens": tokens, "prompt_tokens": prompt_tokens,
                    "errors": errors, "window_s": window_s,
                    "latency_p50_ms": round(1000 * float(np.median(latencies)), 1)
                    if latencies else None}

        def ping(self) -> bool:
            return True

    return GenerationLoad


def measure_limit(load: Any, prompts: list[list[int]], concurrency: int,
                  args: argparse.Namespace) -> dict[str, Any]:
    import ray

    ref = load.run.remote(prompts, concurrency, args.warmup_s, args.window_s)
    time.sleep(args.warmup_s)
    cpu = CpuWindow()
    time.sleep(args.window_s)
    usage = cpu.end()
    raw = ray.get(ref)
    w = raw["window_s"]
    return {"calls": raw["calls"], "tokens": raw["tokens"], "episodes": None,
            "window_s": w, "errors": raw["errors"], "latency_p50_ms": raw["latency_p50_ms"],
            "prompt_tokens_mean": round(raw["prompt_tokens"] / max(raw["calls"], 1), 1),
            "calls_per_s": raw["calls"] / w, "tokens_per_s": raw["tokens"] / w,
            "episodes_per_s": None, "nodes": 1, **usage}


# ---------------------------------------------------------------------------- runners

def runner_config(base: Any, n: int) -> Any:
    from clawray.config import ClawRayConfig

    return ClawRayConfig.from_dict(base.to_dict()).environments(num_runners=n)


def measure_runners(cfg: Any, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start ``n`` runners, warm up (every runner up, ``warmup_s`` of play), counter deltas of
    ``stats()`` over the window, stop and shut down."""
    import ray

    from clawray.rollout.runner import EnvRunnerGroup

    t_setup = time.perf_counter()
    group = EnvRunnerGroup(runner_config(cfg, n), APP)
    try:
        ray.get([r.stats.remote() for r in group.runners.values()], timeout=120)
        setup_s = time.perf_counter() - t_setup
        group.start()
        time.sleep(args.warmup_s)
        before = group.stats()
        cpu = CpuWindow()
        t0 = time.perf_counter()
        time.sleep(args.window_s)
        after = group.stats()
        # A window spans at least one whole group (a loaded machine can be slower than that):
        # it is extended, up to 60 s, until one finished.
        while after["groups"] == before["groups"] and time.perf_counter() - t0 < \
                args.window_s + 60:
            time.sleep(0.5)
            after = group.stats()
        window = time.perf_counter() - t0
        usage = cpu.end()
        changed = group.poll()
        if changed["replaced"]:
            raise RuntimeError(f"a runner died during the window: {changed}")
    finally:
        t_stop = time.perf_counter()
        group.shutdown()
        stop_s = time.perf_counter() - t_stop
    d = {k: after[k] - before[k] for k in ("groups", "episodes", "successes", "steps", "tokens",
                                          "rows", "group_retries")}
    return {**d, "calls": d["steps"], "window_s": window,
            "calls_per_s": d["steps"] / window, "tokens_per_s": d["tokens"] / window,
            "episodes_per_s": d["episodes"] / window, "groups_per_s": d["groups"] / window,
            "nodes": after["nodes"], "setup_s": round(setup_s, 2), "stop_s": round(stop_s, 2),
            **usage}


# ---------------------------------------------------------------------------- rounds

def config_names(args: argparse.Namespace) -> list[str]:
    return ([f"generate c={c}" for c in args.limit_concurrency]
            + [f"{n} runner{'s' if n > 1 else ''}" for n in args.runners])


def measure(cfg: Any, load: Any, prompts: list[list[int]], args: argparse.Namespace,
            log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every configuration once per round, rotated; disturbed windows run again."""
    names = config_names(args)
    runs = {**{f"generate c={c}": ("limit", c) for c in args.limit_concurrency},
            **{f"{n} runner{'s' if n > 1 else ''}": ("runners", n) for n in args.runners}}
    rounds = []
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        results: dict[str, Any] = {}
        for name in order:
            kind, value = runs[name]
            best = None
            for attempt in range(1 + args.retries):
                busy = wait_for_quiet_machine(args.quiet_wait_s, args.quiet_busy_pct, log)
                r = (measure_limit(load, prompts, value, args) if kind == "limit"
                     else measure_runners(cfg, value, args))
                r.update({"busy_before_pct": round(busy, 1), "attempt": attempt + 1})
                if best is None or r["foreign_pct"] < best["foreign_pct"]:
                    best = r
                if r["foreign_pct"] <= args.max_foreign_pct:
                    break
                if attempt < args.retries:
                    log(f"    {name}: others took {r['foreign_pct']:.0f}% of the CPU: again")
            best["attempts"] = attempt + 1
            results[name] = best
            eps = (f"{best['episodes_per_s']:6.2f} episodes/s  " if best["episodes_per_s"]
                   is not None else " " * 21)
            log(f"  round {i + 1}/{args.rounds} {name:<14} {eps}{best['calls_per_s']:7.1f} "
                f"calls/s {best['tokens_per_s']:8.1f} tokens/s  (CPU: ours {best['own_pct']:.0f}%,"
                f" others {best['foreign_pct']:.0f}%, niced {best['niced_pct']:.0f}%)")
        rounds.append(results)
    return rounds


def summarize(rounds: list[dict[str, Any]], names: list[str],
              limit_names: list[str]) -> dict[str, Any]:
    """Pooled rates (counts over total window time), per-round spread, ratio to the limit (the
    highest pooled generation rate) and paired (per round) ratios."""
    rows = []
    for name in names:
        runs = [r[name] for r in rounds]
        total_s = sum(r["window_s"] for r in runs)
        tps = [r["tokens_per_s"] for r in runs]
        row = {"config": name, "kind": "limit" if name in limit_names else "runners",
               "rounds": len(runs), "window_s_total": round(total_s, 2),
               "calls": sum(r["calls"] for r in runs), "tokens": sum(r["tokens"] for r in runs),
               "calls_per_s": round(sum(r["calls"] for r in runs) / total_s, 2),
               "tokens_per_s": round(sum(r["tokens"] for r in runs) / total_s, 1),
               "tokens_per_s_min": round(min(tps), 1), "tokens_per_s_max": round(max(tps), 1),
               "tokens_per_call": round(sum(r["tokens"] for r in runs)
                                        / max(1, sum(r["calls"] for r in runs)), 2),
               "own_cpu_pct_mean": round(float(np.mean([r["own_pct"] for r in runs])), 1),
               "foreign_cpu_pct_max": round(max(r["foreign_pct"] for r in runs), 1),
               "niced_cpu_pct_mean": round(float(np.mean([r["niced_pct"] for r in runs])), 1),
               "nodes": max(r["nodes"] for r in runs)}
        if row["kind"] == "runners":
            eps = sum(r["episodes"] for r in runs)
            row.update({"runners": int(name.split()[0]), "episodes": eps,
                        "groups": sum(r["groups"] for r in runs),
                        "episodes_per_s": round(eps / total_s, 2),
                        "success_rate": round(sum(r["successes"] for r in runs) / max(eps, 1), 3),
                        "steps_per_episode": round(sum(r["steps"] for r in runs) / max(eps, 1), 2),
                        "group_retries": sum(r["group_retries"] for r in runs)})
        else:
            row.update({"concurrency": int(name.split("=")[1]),
                        "latency_p50_ms": float(np.median([r["latency_p50_ms"] for r in runs
                                                           if r["latency_p50_ms"] is not None]
                                                          or [np.nan])),
                        "errors": sum(r["errors"] for r in runs),
                        "prompt_tokens_mean": round(float(np.mean(
                            [r["prompt_tokens_mean"] for r in runs])), 1)})
        rows.append(row)
    limits = [r for r in rows if r["kind"] == "limit"]
    best = max(limits, key=lambda r: r["tokens_per_s"]) if limits else None
    for row in rows:
        if best is None:
            break
        row["vs_limit_tokens"] = round(row["tokens_per_s"] / best["tokens_per_s"], 3)
        row["vs_limit_calls"] = round(row["calls_per_s"] / best["calls_per_s"], 3)
        # Paired: this config's rate over the limit's in the same round.
        row["vs_limit_paired_median"] = round(float(np.median(
            [r[row["config"]]["tokens_per_s"] / r[best["config"]]["tokens_per_s"]
             for r in rounds])), 3)
    return {"results": rows, "limit": best["config"] if best else None,
            "limit_tokens_per_s": best["tokens_per_s"] if best else None,
            "limit_calls_per_s": best["calls_per_s"] if best else None}


# ---------------------------------------------------------------------------- report

def print_table(report: dict[str, Any]) -> None:
    s = report["settings"]
    summary = report["summary"]
    print(f"\n{s['model_name']}, {s['family']} (history_window {s['history_window']}), "
          f"max_tokens {s['max_tokens']}, group_size {s['group_size']}, concurrency "
          f"{s['concurrency']}/runner; {s['rounds']} round(s) x {s['window_s']:.0f} s windows; "
          f"prompts {report['prompts']['limit_tokens_mean']:.0f} tokens (limit) / "
          f"{report['prompts']['runner_rows_tokens_mean'] or 0:.0f} (runner rows) on average")
    head = (f"{'config':<15}{'episodes/s':>11}{'calls/s':>9}{'tokens/s':>10}{'min-max':>14}"
            f"{'vs limit':>10}{'paired':>8}{'ours CPU':>10}{'nodes':>7}")
    print(head)
    print("-" * len(head))
    for r in summary["results"]:
        eps = "-" if r.get("episodes_per_s") is None else f"{r['episodes_per_s']:.2f}"
        rng = f"{r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f}"
        ratio = r.get("vs_limit_tokens")
        paired = r.get("vs_limit_paired_median")
        print(f"{r['config']:<15}{eps:>11}{r['calls_per_s']:>9.1f}{r['tokens_per_s']:>10.1f}"
              f"{rng:>14}{'-' if ratio is None else f'{ratio:.2f}x':>10}"
              f"{'-' if paired is None else f'{paired:.2f}x':>8}"
              f"{r['own_cpu_pct_mean']:>9.0f}%{r['nodes']:>7}")
    print(f"limit = {summary['limit']} ({summary['limit_tokens_per_s']:.1f} tokens/s, "
          f"{summary['limit_calls_per_s']:.1f} calls/s); 'paired' is the median of per-round "
          f"ratios; 'ours CPU' is this benchmark's process tree (driver + Ray cluster) as a "
          f"share of all {report['machine']['logical_cpus']} CPUs; others at normal priority "
          f"took at most {max(r['foreign_cpu_pct_max'] for r in summary['results']):.0f}% in a "
          f"window, niced background jobs "
          f"{max(r['niced_cpu_pct_mean'] for r in summary['results']):.0f}% at most on average; "
          f"{report['wall_s']:.0f} s from Ray's start to the end")


def save_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["summary"]["results"]
    runners = [r for r in rows if r["kind"] == "runners"]
    limits = [r for r in rows if r["kind"] == "limit"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    for ax, key, label in ((axes[0], "tokens_per_s", "generated tokens/s"),
                           (axes[1], "calls_per_s", "generate calls/s (env steps/s)")):
        names = [r["config"] for r in runners]
        values = [r[key] for r in runners]
        bars = ax.bar(names, values, color="tab:blue")
        if key == "tokens_per_s":
            ax.errorbar(range(len(runners)), values,
                        yerr=[[r[key] - r["tokens_per_s_min"] for r in runners],
                              [r["tokens_per_s_max"] - r[key] for r in runners]],
                        fmt="none", ecolor="black", capsize=3, lw=0.8)
            ax.bar_label(bars, labels=[f"{r[key]:.0f}\n{r.get('vs_limit_tokens', 0):.2f}x limit"
                                       f"\n{r['episodes_per_s']:.2f} ep/s" for r in runners],
                         label_type="center", color="white", fontsize=8, fontweight="bold")
        else:
            ax.bar_label(bars, labels=[f"{v:.1f}" for v in values], label_type="center",
                         color="white", fontsize=9, fontweight="bold")
        styles = ["--", ":", "-.", (0, (5, 1))]
        for i, lim in enumerate(limits):
            ax.axhline(lim[key], color="tab:red", ls=styles[i % len(styles)], lw=1.0,
                       label=f"limit: {lim['config']} ({lim[key]:.0f})")
        top = max(values + [r[key] for r in limits] + [1e-9])
        if key == "tokens_per_s":
            top = max(top, max(r["tokens_per_s_max"] for r in runners))
        ax.set_ylim(0, 1.2 * top)
        ax.set_ylabel(label)
        ax.set_title(f"env runners: {label}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    s = report["settings"]
    m = report["machine"]
    fig.suptitle(f"clawray env runners - {s['model_name']}, {s['family']}, max_tokens "
                 f"{s['max_tokens']}, G={s['group_size']}, {s['concurrency']} groups/runner - "
                 f"{m['logical_cpus']} CPUs, Ray {m['versions']['ray']}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- main

def build_config(model_path: Path, tmp: str, args: argparse.Namespace) -> Any:
    from clawray.config import ClawRayConfig

    buffer = {"path": f"{tmp}/samples"}
    envs = {}
    if args.seal_age_s is not None:  # the env buffer seals at the smaller of the two
        buffer["seal_age_s"] = args.seal_age_s
        envs["buffer_seal_age_s"] = args.seal_age_s
    return (ClawRayConfig().model(path=str(model_path))
            .inference(engine="hf")  # the engine bench/results/envs*.json were measured on
            .serving(record_sink=["none"], replica_num_cpus=args.replica_num_cpus)
            .buffer(**buffer)
            .environments(family=args.family, num_runners=1, runner_num_cpus=args.runner_num_cpus,
                          concurrency=args.concurrency, group_size=args.group_size,
                          max_tokens=args.max_tokens, seed=args.seed,
                          history_window=args.history_window, **envs)
            .curriculum(sampler="uniform"))


def runner_prompt_lengths(cfg: Any, buffer: Any) -> list[int]:
    """Prompt lengths of every row the runners wrote (from the env buffer's WAL)."""
    import pyarrow.compute as pc
    import pyarrow.dataset as ds
    import ray

    ray.get(buffer.flush.remote())
    table = ds.dataset(cfg.buffer_cfg.path + "-env", format="parquet").to_table(
        columns=["prompt_ids"])
    return pc.list_value_length(table.column("prompt_ids")).to_pylist()


def run_benchmark(args: argparse.Namespace, log: Callable[[str], None] = print
                  ) -> dict[str, Any]:
    import ray
    from ray import serve

    from clawray.models.loader import load_tokenizer
    from clawray.serve.app import build_app

    machine = machine_info()
    if args.model:
        model_path = Path(args.model).expanduser().resolve()
    else:
        from clawray.models.tiny import build_embedded_default

        model_path = build_embedded_default()
    tokenizer = load_tokenizer(model_path)
    prompts = sample_prompts(tokenizer, args.family, args.prompts, args.seed,
                             args.history_window)
    lengths = [len(p) for p in prompts]
    log(f"{len(prompts)} {args.family} prompts, {np.mean(lengths):.0f} tokens on average "
        f"({min(lengths)}-{max(lengths)})")
    tmp = tempfile.mkdtemp(prefix="clawray-bench-envs-")
    cfg = build_config(model_path, tmp, args)
    report: dict[str, Any] = {
        "benchmark": "envs", "machine": machine,
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"},
                     "model_path": str(model_path), "model_name": model_path.name,
                     "seal_age_s": cfg.buffer_cfg.seal_age_s,
                     "max_running": cfg.inference_cfg.max_running,
                     "configs": config_names(args)},
    }
    started = time.perf_counter()
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    from clawray.apps.launch import init_local_ray

    init_local_ray(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                   logging_level="WARNING", namespace=NAMESPACE)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
        load = generation_load_class().remote(cfg.to_dict(), APP)
        ray.get(load.ping.remote())
        # One untimed call per prompt length class wakes the engine and the handle's router.
        ray.get(load.run.remote(prompts[:8], 4, 0.0, 1.0))
        log(f"Serve app up in {time.perf_counter() - started:.1f} s")
        machine["load_avg_start"] = [round(x, 2) for x in os.getloadavg()]
        rounds = measure(cfg, load, prompts, args, log)
        machine["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
        from clawray.names import NAMESPACE as ENV_NAMESPACE
        from clawray.rollout.runner import env_names

        buffer = ray.get_actor(env_names(APP, cfg)["buffer"], namespace=ENV_NAMESPACE)
        row_lengths = runner_prompt_lengths(cfg, buffer)
    finally:
        ray.shutdown()  # ends Serve with the cluster (serve.shutdown() would drain ~30 s)
        shutil.rmtree(tmp, ignore_errors=True)
    names = config_names(args)
    report["rounds"] = [{name: {k: (round(v, 3) if isinstance(v, float) else v)
                                for k, v in r[name].items()} for name in names} for r in rounds]
    report["summary"] = summarize(rounds, names, [n for n in names if n.startswith("generate")])
    report["prompts"] = {
        "limit_count": len(prompts), "limit_tokens_mean": round(float(np.mean(lengths)), 1),
        "limit_tokens_min": min(lengths), "limit_tokens_max": max(lengths),
        "runner_rows": len(row_lengths),
        "runner_rows_tokens_mean": round(float(np.mean(row_lengths)), 1) if row_lengths else None,
        "runner_rows_tokens_min": min(row_lengths) if row_lengths else None,
        "runner_rows_tokens_max": max(row_lengths) if row_lengths else None}
    report["wall_s"] = round(time.perf_counter() - started, 1)
    return report


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 runners and the limit at c=16 only, 1 round, 1.5 s "
                   "warm-up, 4 s windows")
    p.add_argument("--model", default=None,
                   help="a local HF model folder (default: the embedded tiny model)")
    p.add_argument("--runners", type=parse_list, default=None,
                   help="runner counts to measure (default 1,2,4; 2 with --quick)")
    p.add_argument("--limit-concurrency", type=parse_list, default=None,
                   help="calls in flight for the generation limit (default 8,16,32; 16 with "
                   "--quick)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3)")
    p.add_argument("--window-s", type=float, default=None, help="measured window (default 25)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="play before each window (default 5)")
    p.add_argument("--family", default="household")
    p.add_argument("--history-window", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=2, help="groups in flight per runner")
    p.add_argument("--runner-num-cpus", type=float, default=0.0)
    p.add_argument("--replica-num-cpus", type=float, default=1.0)
    p.add_argument("--seal-age-s", type=float, default=None,
                   help="env buffer seal age (default: the config's, 0.1 s)")
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the Ray cluster")
    p.add_argument("--prompts", type=int, default=256, help="distinct prompts for the limit")
    p.add_argument("--max-foreign-pct", type=float, default=15.0,
                   help="a window where others (at normal priority) took more of the CPU is run "
                   "again")
    p.add_argument("--quiet-busy-pct", type=float, default=30.0,
                   help="before a window, wait while the machine is busier than this (plus "
                   "what niced background jobs take)")
    p.add_argument("--retries", type=int, default=None,
                   help="repeats of a disturbed window (default 1; 0 with --quick)")
    p.add_argument("--quiet-wait-s", type=float, default=None,
                   help="longest wait for a quiet machine before a window (default 60; 0 with "
                   "--quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "envs.json")
    args = p.parse_args(argv)
    quick = {"runners": [2], "limit_concurrency": [16], "rounds": 1, "window_s": 4.0,
             "warmup_s": 1.5, "retries": 0, "quiet_wait_s": 0.0}
    full = {"runners": [1, 2, 4], "limit_concurrency": [8, 16, 32], "rounds": 3,
            "window_s": 25.0, "warmup_s": 5.0, "retries": 1, "quiet_wait_s": 60.0}
    apply_profile(args, args.quick, quick, full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return write_results(run_benchmark(args), args.out, print_table, save_plot)


if __name__ == "__main__":
    raise SystemExit(main())
