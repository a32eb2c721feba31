"""The household policy warm start's checkpoint selection, seed by seed.

    .venv/bin/python scripts/warm_start_curves.py --seeds 0 1 2 3 4 \
        --out docs/results/warm_start_selection

Builds (or finds cached) the warm start of ``clawray env-demo`` / ``clawray rla-table`` for each
warm-start seed (``clawray/apps/env_demo.py``'s recipe: 600 NLL steps, every 50 the policy
plays 100 validation-pool tasks at the runners' temperature and the best checkpoint is kept),
then writes ``OUT/curves.json`` (per seed: the cache folder, the validation success at each
scoring, the step kept and its score; the mean and standard error of the kept scores and of
the scores at step 200, the step count the recipe had before) and ``OUT/curves.png``.
About 6.5 min per seed on 2 cores; a cached seed is read back at once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from clawray.apps.env_demo import env_demo_config
from clawray.config import load_config
from clawray.experiments.rla_table import measured_engine
from clawray.stats import seed_stats
from clawray.training.sft import run_sft

FORMER_STEPS = 200  # the recipe's step count before selection (2.5% / 0.5% / 24.0%, seeds 0-2)


def curve(seed: int) -> dict[str, Any]:
    cfg = env_demo_config(measured_engine(load_config(None)), Path("."), seed)
    result = run_sft(cfg, progress=False)
    sel = result.info["selection"]
    scores = {c["step"]: c["score"] for c in sel}
    return {"seed": seed, "path": str(result.path), "cached": result.cached,
            "curve": sel, "selected_step": result.info["selected_step"],
            "selected_score": scores[result.info["selected_step"]],
            f"score_at_{FORMER_STEPS}": scores.get(FORMER_STEPS)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for seed in args.seeds:
        rows.append(curve(seed))
        print(f"seed {seed}: kept step {rows[-1]['selected_step']} "
              f"({rows[-1]['selected_score']:.0%} of the validation tasks)", flush=True)
    summary = {"seeds": rows,
               "selected": seed_stats([r["selected_score"] for r in rows]),
               f"at_{FORMER_STEPS}": seed_stats([r[f"score_at_{FORMER_STEPS}"] for r in rows])}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curves.json").write_text(json.dumps(summary, indent=2))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for r in rows:
        steps = [c["step"] for c in r["curve"]]
        line, = ax.plot(steps, [100 * c["score"] for c in r["curve"]], marker=".",
                        label=f"warm-start seed {r['seed']}")
        ax.plot([r["selected_step"]], [100 * r["selected_score"]], marker="o", ms=9,
                mfc="none", color=line.get_color())
    ax.axvline(FORMER_STEPS, color="grey", ls=":", label=f"the former recipe's end ({FORMER_STEPS})")
    ax.set_xlabel("SFT step")
    ax.set_ylabel("success on 100 validation tasks (%)")
    ax.set_title("household policy warm start: validation success while it trains\n"
                 "(circles: the checkpoint kept)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "curves.png", dpi=120)
    print(f"{args.out}/curves.json, curves.png")


if __name__ == "__main__":
    main()
