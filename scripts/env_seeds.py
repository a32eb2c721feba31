"""Two or more `clawray env-demo` arms over the same seeds, compared seed by seed.

    .venv/bin/python scripts/env_seeds.py --out docs/results/env_grpo/test_arms \
        steponly=docs/results/env_grpo/test_seeds.json,OUT/steponly/seed3,OUT/steponly/seed4 \
        plain=OUT/plain/seed0,OUT/plain/seed1,OUT/plain/seed2,OUT/plain/seed3,OUT/plain/seed4

Each ``NAME=SRC[,SRC...]`` is one arm; a source is an env-demo run folder (its
``env_summary.json``) or an ``env_seeds.json`` of ``clawray env-demo --seeds`` (all its seeds).
Writes ``OUT.json`` (per arm: each seed's held-out curve, before, after and rise, and
``aggregate_seeds``' statistics; per later arm, its rise minus the first arm's on the seeds
both ran: per seed, mean, standard error and the paired t-test's p) and ``OUT.png`` (each
seed's rise per arm, a line joining a seed's arms).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from clawray.apps.env_demo import aggregate_seeds
from clawray.stats import paired_difference, seed_stats


def seed_rows(source: Path) -> list[dict[str, Any]]:
    """The per-seed rows (seed, before, after, rise, n, curve) of one source."""
    if source.is_dir():
        return aggregate_seeds([json.loads((source / "env_summary.json").read_text())])["seeds"]
    return json.loads(source.read_text())["seeds"]


def arm(sources: list[Path]) -> dict[str, Any]:
    rows = [row for src in sources for row in seed_rows(src)]
    seeds = [r["seed"] for r in rows]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"a seed appears twice among {', '.join(map(str, sources))}: {seeds}")
    rows.sort(key=lambda r: r["seed"])
    rises = [r["rise"] for r in rows]
    rise = seed_stats(rises)
    return {"sources": [str(s) for s in sources], "seeds": rows,
            "before_mean": float(np.mean([r["before"] for r in rows])),
            "after_mean": float(np.mean([r["after"] for r in rows])),
            "rise_mean": rise["mean"], "rise_stderr": rise["stderr"],
            "rise_ttest_p": float(stats.ttest_1samp(rises, 0.0).pvalue) if len(rises) > 1
            else None,
            "rose_in": sum(r > 0 for r in rises), "runs": len(rows)}


def paired(first: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``other``'s rise minus ``first``'s on the seeds both ran (``paired_difference``)."""
    a = {r["seed"]: r["rise"] for r in other["seeds"]}
    b = {r["seed"]: r["rise"] for r in first["seeds"]}
    c = paired_difference(a, b)
    out: dict[str, Any] = {"seeds": c["seeds"], "differences": [a[k] - b[k] for k in c["seeds"]],
                           "mean": c["difference"]["mean"] if c["difference"] else None}
    if len(c["seeds"]) > 1:
        out["stderr"], out["ttest_p"] = c["difference"]["stderr"], c["p_value"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arms", nargs="+", help="NAME=SRC[,SRC...] (run folders or env_seeds.json)")
    ap.add_argument("--out", required=True, help="output prefix (.json and .png are added)")
    args = ap.parse_args()
    arms = {}
    for spec in args.arms:
        name, _, sources = spec.partition("=")
        if not sources:
            ap.error(f"expected NAME=SRC[,SRC...], got {spec!r}")
        arms[name] = arm([Path(s) for s in sources.split(",")])
    names = list(arms)
    report = {"arms": arms,
              "paired": {f"{n} - {names[0]}": paired(arms[names[0]], arms[n])
                         for n in names[1:]}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    seeds = sorted({r["seed"] for a in arms.values() for r in a["seeds"]})
    for s in seeds:
        xs, ys = zip(*[(i, r["rise"]) for i, a in enumerate(arms.values())
                       for r in a["seeds"] if r["seed"] == s])
        ax.plot(xs, ys, "o-", color="0.6", lw=1)
        ax.annotate(f"{s}", (xs[-1], ys[-1]), xytext=(4, 0), textcoords="offset points",
                    fontsize=8)
    for i, a in enumerate(arms.values()):
        ax.errorbar([i], [a["rise_mean"]], yerr=[a["rise_stderr"] or 0.0], fmt="s",
                    color="C3", capsize=4)
    ax.axhline(0, color="0.3", lw=0.8)
    ax.set_xticks(range(len(names)),
                  [f"{n}\n{a['rise_mean']:+.1%} ± {a['rise_stderr'] or 0:.1%}"
                   for n, a in arms.items()])
    ax.set(title="held-out success rise per seed (grey) and mean ± s.e. (red)",
           ylabel="rise in success rate")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    for name, a in arms.items():
        print(f"{name}: seeds {[r['seed'] for r in a['seeds']]}, {a['before_mean']:.1%} -> "
              f"{a['after_mean']:.1%}, rise {a['rise_mean']:+.1%} ± {a['rise_stderr'] or 0:.1%}"
              f" (p = {a['rise_ttest_p']}), rose in {a['rose_in']} of {a['runs']}")
    for name, p in report["paired"].items():
        print(f"{name}: {p['mean']:+.1%} ± {p.get('stderr', 0):.1%} over seeds {p['seeds']} "
              f"(paired t p = {p.get('ttest_p')})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
