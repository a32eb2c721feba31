"""Statistics, target checks, the printed table and the plot of ``bench/serving.py``."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any, Callable

import numpy as np

# Targets from the issue: clawray vs the peer proxy design (b).
TARGET_RPS_RATIO = {8: 0.70, 32: 1.00}
TARGET_P50_DIFF_MS_AT_1 = 10.0
FLOOR = "engine-inproc"  # plotted, but the y axis is scaled to the other setups
PACKAGES = ("clawray", "ray", "fastapi", "starlette", "uvicorn", "httpx", "uvloop", "httptools",
            "pydantic", "tokenizers", "transformers")


def summarize(raw: dict[str, Any], requests: int, warmup: int,
              server_cpu_s: float | None) -> dict[str, Any]:
    """Latency percentiles, throughput and CPU cost per request of one measured level."""
    lat = np.asarray(raw["latencies_s"]) * 1000.0
    ok = len(lat)

    def pct(q: float) -> float | None:
        return round(float(np.percentile(lat, q)), 2) if ok else None

    return {
        "requests": requests, "ok": ok, "errors": raw["errors"],  # planned, done, failed
        "warmup_errors": raw["warmup_errors"], "error_sample": raw["error_sample"],
        "rps": round(ok / raw["wall_s"], 2) if raw["wall_s"] > 0 else 0.0,
        "p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99),
        "mean_ms": round(float(lat.mean()), 2) if ok else None,
        "min_ms": round(float(lat.min()), 2) if ok else None,
        "max_ms": round(float(lat.max()), 2) if ok else None,
        "wall_s": round(raw["wall_s"], 3),
        # The client's CPU in the timed phase; for in-process rows it is all of the work.
        "client_cpu_ms_per_req": round(1000 * raw["client_cpu_s"] / max(ok, 1), 3),
        # Every server process (for Ray: the whole cluster), warm-up requests included.
        "server_cpu_ms_per_req": (round(1000 * server_cpu_s / (ok + raw["errors"] + warmup), 3)
                                  if server_cpu_s is not None else None),
    }


def _say(message: str) -> None:
    print(message, flush=True)


def wait_for_quiet(max_wait_s: float, log: Callable[[str], None] = _say,
                   busy_pct: float = 30.0) -> float:
    """Wait (up to ``max_wait_s``) until other processes leave the machine mostly idle;
    returns the busy CPU % last seen (the caller is idle meanwhile)."""
    import time

    import psutil

    if max_wait_s <= 0:
        return psutil.cpu_percent(interval=0.2)
    deadline = time.time() + max_wait_s
    while True:
        busy = psutil.cpu_percent(interval=1.0)
        if busy < busy_pct or time.time() > deadline:
            return busy
        log(f"    machine busy ({busy:.0f}% CPU by others), waiting...")
        time.sleep(4)


def apply_profile(args: Any, quick: bool, quick_values: dict[str, Any],
                  full_values: dict[str, Any]) -> None:
    """Fill every option left at None from the ``--quick`` or the full profile."""
    for key, value in (quick_values if quick else full_values).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def write_results(report: dict[str, Any], out: Path, table: Callable[[dict[str, Any]], None],
                  plot: Callable[[dict[str, Any], Path], None] | None = None) -> int:
    """Write ``out`` (JSON) and, with ``plot``, the PNG beside it; print the table."""
    import json

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    written = [str(out)]
    if plot is not None:
        plot(report, out.with_suffix(".png"))
        written.append(str(out.with_suffix(".png")))
    table(report)
    print(f"\nwrote {' and '.join(written)}")
    return 0


def machine_info() -> dict[str, Any]:
    import psutil

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_model": model, "logical_cpus": os.cpu_count(),
            "physical_cpus": psutil.cpu_count(logical=False),
            "memory_gb": round(psutil.virtual_memory().total / 2**30, 1),
            "load_avg": [round(x, 2) for x in os.getloadavg()], "versions": versions}


def _cell(results: list[dict[str, Any]], setup: str, scenario: str, level: int) -> dict | None:
    for r in results:
        if r["setup"] == setup and r["scenario"] == scenario and r["concurrency"] == level:
            return r
    return None


def target_checks(results: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Each setup vs ``baseline``: req/s ratios at 8 and 32, p50 difference at 1, targets met."""
    checks = []
    scenarios = list(dict.fromkeys(r["scenario"] for r in results))
    setups = list(dict.fromkeys(r["setup"] for r in results))
    for scenario in scenarios:
        for setup in setups:
            if setup == baseline:
                continue
            row: dict[str, Any] = {"setup": setup, "scenario": scenario, "vs": baseline}
            met = []
            for level, target in TARGET_RPS_RATIO.items():
                a = _cell(results, setup, scenario, level)
                b = _cell(results, baseline, scenario, level)
                ratio = round(a["rps"] / b["rps"], 3) if a and b and b["rps"] else None
                row[f"rps_ratio_at_{level}"] = ratio
                if ratio is not None:
                    row[f"rps_ratio_at_{level}_met"] = ratio >= target
                    met.append(ratio >= target)
            a, b = _cell(results, setup, scenario, 1), _cell(results, baseline, scenario, 1)
            diff = (round(a["p50_ms"] - b["p50_ms"], 2)
                    if a and b and a["p50_ms"] is not None and b["p50_ms"] is not None else None)
            row["p50_diff_ms_at_1"] = diff
            if diff is not None:
                row["p50_diff_ms_at_1_met"] = diff <= TARGET_P50_DIFF_MS_AT_1
                met.append(diff <= TARGET_P50_DIFF_MS_AT_1)
            # None when a level the targets need (1, 8 or 32) was not measured.
            row["all_targets_met"] = all(met) if len(met) == 3 else None
            checks.append(row)
    return checks


_MET = {True: "yes", False: "NO", None: "n/a"}


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(report: dict[str, Any]) -> None:
    results = report["results"]
    levels = report["settings"]["levels"]
    setups = list(dict.fromkeys(r["setup"] for r in results))
    for scenario, body in report["bodies"].items():
        print(f"\n== scenario {scenario}: {body['bytes']} B body, "
              f"{'streaming' if body['stream'] else 'non-streaming'}, "
              f"max_tokens {body['max_completion_tokens']}, engine "
              f"{1000 * report['settings']['latency_s']:.0f} ms ==")
        head = f"{'setup':<19}" + "".join(f" | {'p50':>6} {'p99':>6} {'req/s':>6} @{c:<3}"
                                          for c in levels) + " | srv CPU ms/req"
        print(head)
        print("-" * len(head))
        for setup in setups:
            line = f"{setup:<19}"
            cpu = None
            for c in levels:
                r = _cell(results, setup, scenario, c)
                if r is None:
                    line += f" | {'':>6} {'':>6} {'':>6}  {'':<3}"
                    continue
                err = "!" if r["errors"] else " "
                line += (f" | {_fmt(r['p50_ms'], '6.1f')} {_fmt(r['p99_ms'], '6.1f')} "
                         f"{r['rps']:6.1f}{err}    ")
                cpu = r["server_cpu_ms_per_req"] if r["server_cpu_ms_per_req"] is not None \
                    else r["client_cpu_ms_per_req"]
            print(line + f" | {_fmt(cpu, '6.2f')}")
    checks = report["targets"]
    if not checks:
        return
    print(f"\n== vs {checks[0]['vs']}: targets req/s ratio >= {TARGET_RPS_RATIO[8]:.2f} @8, "
          f">= {TARGET_RPS_RATIO[32]:.2f} @32, p50 within {TARGET_P50_DIFF_MS_AT_1:.0f} ms @1 ==")
    print(f"{'setup':<19} {'scenario':<16} {'ratio@8':>8} {'ratio@32':>9} {'p50 diff@1':>11}  met")
    for c in checks:
        print(f"{c['setup']:<19} {c['scenario']:<16} {_fmt(c.get('rps_ratio_at_8'), '8.2f')} "
              f"{_fmt(c.get('rps_ratio_at_32'), '9.2f')} {_fmt(c['p50_diff_ms_at_1'], '+10.1f')}"
              f"ms  {_MET[c['all_targets_met']]}")


def save_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    levels = report["settings"]["levels"]
    scenarios = list(report["bodies"])
    setups = list(dict.fromkeys(r["setup"] for r in results))
    fig, axes = plt.subplots(len(scenarios), 2, figsize=(15, 4.2 * len(scenarios)), squeeze=False)
    x = np.arange(len(setups))
    width = 0.8 / len(levels)
    for row, scenario in enumerate(scenarios):
        for col, (key, label) in enumerate([("rps", "requests/s (higher is better)"),
                                            ("p50_ms", "p50 latency, ms (lower is better)")]):
            ax = axes[row][col]
            values = {c: [(_cell(results, s, scenario, c) or {}).get(key) or 0 for s in setups]
                      for c in levels}
            # The engine-only floor can dwarf every real setup: cut the axis above the others.
            others = [v for c in levels for s, v in zip(setups, values[c]) if s != FLOOR]
            top = 1.2 * max(others) if others and max(others) > 0 else None
            for i, c in enumerate(levels):
                xs = x + (i - (len(levels) - 1) / 2) * width
                shown = [min(v, top) if top else v for v in values[c]]
                bars = ax.bar(xs, shown, width, label=f"concurrency {c}")
                clipped = [bool(top) and v > top for v in values[c]]
                ax.bar_label(bars, labels=["" if cut else f"{v:.0f}"
                                           for v, cut in zip(values[c], clipped)],
                             fontsize=6, padding=1)
                for xi, v, cut in zip(xs, values[c], clipped):
                    if cut:  # a cut bar carries its value inside, written upwards
                        ax.text(xi, top * 0.98, f"{v:.0f}", rotation=90, ha="center",
                                va="top", fontsize=6, color="white")
            if top:
                ax.set_ylim(0, top * 1.08)
            if key == "p50_ms":
                ax.axhline(1000 * report["settings"]["latency_s"], color="grey", ls="--", lw=0.8)
            ax.set_xticks(x, setups, rotation=25, ha="right", fontsize=8)
            ax.set_title(f"{scenario}: {label}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=7)
    m = report["machine"]
    fig.suptitle(f"clawray serving overhead, {1000 * report['settings']['latency_s']:.0f} ms "
                 f"fixed-latency engine - {m['logical_cpus']} CPUs, Ray {m['versions']['ray']}",
                 fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
