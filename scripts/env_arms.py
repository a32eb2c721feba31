"""Compare `clawray env-demo` runs that differ in one setting (e.g. the GRPO advantage).

    .venv/bin/python scripts/env_arms.py --out docs/results/env_grpo/validation \
        plain=OUT/plain gigpo=OUT/gigpo steponly=OUT/steponly

Each ``NAME=DIR`` is one env-demo output folder (its ``env_summary.json``). Writes
``OUT.json`` (per arm: the held-out curve with binomial standard errors, the rise, and the
training-side means of ``env_success``, ``conflict_share`` and ``anchored_share``) and
``OUT.png`` (the held-out curves side by side).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def arm(summary: dict[str, Any]) -> dict[str, Any]:
    def mean(key: str) -> float | None:
        v = [t[key] for t in summary["train"] if t.get(key) is not None]
        return sum(v) / len(v) if v else None

    curve = [{k: e[k] for k in ("iteration", "success", "stderr", "n")}
             for e in summary["evals"]]
    return {"seed": summary.get("seed"), "eval_pool": summary.get("eval_pool"),
            "sets": summary.get("sets"), "curve": curve,
            "rise": curve[-1]["success"] - curve[0]["success"],
            "train_success_mean": mean("env_success"),
            "conflict_share_mean": mean("conflict_share"),
            "anchored_share_mean": mean("anchored_share")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=DIR (an env-demo output folder)")
    ap.add_argument("--out", required=True, help="output prefix (.json and .png are added)")
    args = ap.parse_args()
    arms = {}
    for spec in args.runs:
        name, _, folder = spec.partition("=")
        if not folder:
            ap.error(f"expected NAME=DIR, got {spec!r}")
        arms[name] = arm(json.loads((Path(folder) / "env_summary.json").read_text()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(arms, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (name, a) in enumerate(arms.items()):
        its = [c["iteration"] + 0.25 * (i - (len(arms) - 1) / 2) for c in a["curve"]]
        ax.errorbar(its, [c["success"] for c in a["curve"]],
                    yerr=[c["stderr"] for c in a["curve"]], marker="o", capsize=3,
                    label=f"{name} ({a['rise']:+.1%})")
    pool = next(iter(arms.values()))["eval_pool"]
    ax.set(title=f"held-out success ({pool} pool), ± binomial s.e.", xlabel="iteration",
           ylabel="success rate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)
    for name, a in arms.items():
        print(f"{name}: {a['curve'][0]['success']:.1%} -> {a['curve'][-1]['success']:.1%} "
              f"(rise {a['rise']:+.1%}); conflict share {a['conflict_share_mean']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
