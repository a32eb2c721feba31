"""The ledger: every evaluation on a held-out pool, one JSON line each, written by the tool that
ran it, so a reported figure can be traced to its run and no rerun silently replaces one.

A line holds the time, the commit (with ``+dirty`` when the checkout had changes), the
experiment (``live-demo``, ...), the arm (the judge and the control: what is compared), the
seed, the pool (``test`` or ``validation``), the metric, its value, the number of requests it
was measured on, and the command that ran it. The file is ``$CLAWRAY_LEDGER``, else
``docs/results/ledger.jsonl`` of the checkout clawray runs from, else
``~/.cache/clawray/ledger.jsonl`` (an installed package). Lines are only appended (one
``write`` of a whole line on a file opened for appending, under an exclusive lock).

What is reported from it (``first_runs``, ``clawray ledger``): per experiment, arm, metric and
seed the FIRST registered run; every later run of the same cell is listed next to it, never in
its place.

Pure Python, no Ray.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

from clawray.stats import paired_difference, seed_stats

LEDGER_ENV = "CLAWRAY_LEDGER"
_REPO = Path(__file__).resolve().parents[1]


def ledger_path() -> Path:
    """Where lines go (the module doc)."""
    if os.environ.get(LEDGER_ENV):
        return Path(os.environ[LEDGER_ENV]).expanduser()
    if (_REPO / ".git").exists() and (_REPO / "docs" / "results").is_dir():
        return _REPO / "docs" / "results" / "ledger.jsonl"
    return Path("~/.cache/clawray/ledger.jsonl").expanduser()


def current_commit() -> str | None:
    """The checkout's commit, ``+dirty`` if it has uncommitted changes; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True).stdout
        changed = subprocess.run(["git", "-C", str(_REPO), "status", "--porcelain",
                                  "--untracked-files=no"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    # the ledger's own lines do not make the checkout dirty
    dirty = [line for line in changed if not line.endswith("docs/results/ledger.jsonl")]
    return head.strip() + ("+dirty" if dirty else "")


def record(experiment: str, arm: str, seed: int, pool: str, metric: str, value: float, *,
           n: int | None = None, command: str | None = None, path: Path | None = None,
           **extra: Any) -> dict[str, Any]:
    """Append one evaluation to the ledger; the line written."""
    for name, v in (("experiment", experiment), ("arm", arm), ("pool", pool),
                    ("metric", metric)):
        if not isinstance(v, str) or not v:
            raise ValueError(f"ledger: {name} must be a non-empty string, not {v!r}")
    line = {"time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": current_commit(), "experiment": experiment, "arm": arm, "seed": int(seed),
            "pool": pool, "metric": metric, "value": float(value), "n": n,
            "command": command if command is not None else " ".join(sys.argv), **extra}
    target = path or ledger_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(line) + "\n")
        f.flush()
    return line


def before_after(metric: str, before: float | None, after: float | None, *,
                 record_before: bool = True, **fields: Any) -> list[dict[str, Any]]:
    """The lines of one measure taken before and after training: ``<metric>_before``,
    ``<metric>_after`` and ``<metric>_change``, each with ``fields`` (experiment, arm, seed,
    pool, n, extra fields). Only what was measured: no line for a None value (a change needs
    both); ``record_before=False`` when this arm's "before" was measured in another's run (its
    change is still paired against it)."""
    lines = []
    if before is not None and record_before:
        lines.append({**fields, "metric": f"{metric}_before", "value": before})
    if after is not None:
        lines.append({**fields, "metric": f"{metric}_after", "value": after})
    if before is not None and after is not None:
        lines.append({**fields, "metric": f"{metric}_change", "value": after - before})
    return lines


def record_lines(lines: Iterable[dict[str, Any]], *, path: Path | None = None,
                 command: str | None = None) -> list[dict[str, Any]]:
    """``record`` each line (a dict of ``record``'s arguments and extra fields, as a tool's
    ``ledger_lines`` makes them); the lines written."""
    return [record(**line, command=command, path=path) for line in lines]


def read(path: Path | None = None) -> list[dict[str, Any]]:
    """Every line of the ledger, in the order written (an absent ledger: none)."""
    target = path or ledger_path()
    if not target.is_file():
        return []
    return [json.loads(line) for line in target.read_text().splitlines() if line.strip()]


def first_runs(lines: Iterable[dict[str, Any]], pool: str = "test") -> dict[tuple, Any]:
    """Per (experiment, arm, metric): the first registered value of each seed on ``pool``, the
    later runs of those seeds, and over the first runs their mean and standard error. A line
    marked ``invalid`` (with the reason: the run did not measure what its arm says) stays in
    the file and counts nowhere."""
    cells: dict[tuple, dict[str, Any]] = {}
    for line in lines:
        if line["pool"] != pool or line.get("invalid"):
            continue
        cell = cells.setdefault((line["experiment"], line["arm"], line["metric"]),
                                {"first": {}, "later": []})
        if line["seed"] in cell["first"]:
            cell["later"].append(line)
        else:
            cell["first"][line["seed"]] = line
    for cell in cells.values():
        cell["seeds"] = sorted(cell["first"])
        cell["stats"] = seed_stats(cell["first"][s]["value"] for s in cell["seeds"])
    return cells


def table(lines: Iterable[dict[str, Any]], pool: str = "test") -> str:
    """``first_runs`` as a Markdown table: experiment, arm, metric, seeds, mean ± s.e., the
    first run's commit range, and how many later runs are not in the figure."""
    rows = ["| experiment | arm | metric | seeds | mean ± s.e. (min – max) | later runs |",
            "|---|---|---|---|---|---|"]
    for (experiment, arm, metric), cell in sorted(first_runs(lines, pool).items()):
        st = cell["stats"]
        se = "" if st["stderr"] is None else f" ± {st['stderr']:.3f}"
        rows.append(f"| {experiment} | {arm} | {metric} | {len(cell['seeds'])} | "
                    f"{st['mean']:.3f}{se} ({st['min']:.3f} – {st['max']:.3f}) | "
                    f"{len(cell['later'])} |")
    return "\n".join(rows)


# The README's table of results (``headline``): the live demo on the embedded model and on
# SmolLM2 (KL 0.1); per-user adapters on SmolLM2 (two groups of users who want opposite
# things); what each experiment claims is in its docs. SmolLM2's first setting (no KL,
# ``demo-lockstep-concise-smollm2-135m-instruct``) is not a headline: it has no training-off
# arm, and its trained arm was not shown apart from its shuffled control (docs/models.md).
HEADLINE = {
    "demo-lockstep": "live demo, embedded model (docs/training.md)",
    "demo-lockstep-concise-smollm2-135m-instruct-kl0.1":
        "live demo, SmolLM2, KL 0.1 (docs/models.md)",
    "per-user-demo-smollm2-135m-instruct": "per-user adapters, SmolLM2 (docs/models.md)",
    "per-user-demo-judge-model-smollm2-135m-instruct":
        "per-user adapters, SmolLM2, judged by the SmolLM2 judge (docs/models.md)",
}
TRAINED_ARM = "/none"  # an arm name ending so is the trained arm; the others are its controls
# Experiments whose arms are "<mode>/<group>" (users who want different things): per group,
# the trained arm is this mode's, and the other modes of the group are its comparisons.
TRAINED_MODE = {"per-user-demo-smollm2-135m-instruct": "per_user",
                "per-user-demo-judge-model-smollm2-135m-instruct": "per_user"}


def headline(lines: Iterable[dict[str, Any]], experiments: dict[str, str] | None = None,
             metric: str = "satisfaction", pool: str = "test") -> str:
    """A Markdown table of ``experiments`` (name: description; default ``HEADLINE``) from
    ``first_runs``: per arm the seeds, ``<metric>_before`` and ``_after`` (means), the change
    (mean ± s.e.), and for each control the trained arm's change minus the control's, paired
    by seed (mean ± s.e., ``scipy.stats.ttest_rel``'s p; "shown" where p < 0.05). The trained
    arm is the one ending ``TRAINED_ARM``, or for an experiment of ``TRAINED_MODE`` the mode's
    arm of each group (its arms grouped by their group)."""
    experiments = HEADLINE if experiments is None else experiments
    cells = first_runs(lines, pool)
    rows = ["| experiment | arm | seeds | before | after | change, points | trained − this "
            "arm, paired |", "|---|---|---|---|---|---|---|"]

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    def points(st: dict[str, Any]) -> str:
        se = "" if st["stderr"] is None else f" ± {100 * st['stderr']:.1f}"
        return f"{100 * st['mean']:+.1f}{se}"

    for name, description in experiments.items():
        def values(arm: str) -> dict[int, float]:  # the change of each seed's first run
            return {k: line["value"]
                    for k, line in cells[(name, arm, f"{metric}_change")]["first"].items()}

        mode = TRAINED_MODE.get(name)

        known = {arm for (e, arm, m) in cells if e == name and m == f"{metric}_change"}
        arms = sorted(known)
        plain = next((a for a in arms if a.endswith(TRAINED_ARM)), None)

        def trained_of(arm: str) -> str | None:
            if mode is not None:
                return f"{mode}/{arm.rpartition('/')[2]}"
            # "<judge>/<control>": its own judge's trained arm where that ran
            own = arm.rpartition("/")[0] + TRAINED_ARM
            return own if own in known else plain

        arms.sort(key=lambda a: (a.rpartition("/")[2] if mode else a.rpartition("/")[0],
                                 a != trained_of(a), a))
        for arm in arms:
            trained = trained_of(arm)
            change = cells[(name, arm, f"{metric}_change")]
            before = cells.get((name, arm, f"{metric}_before"))
            after = cells.get((name, arm, f"{metric}_after"))
            paired = "—"
            if trained is not None and arm != trained and (
                    name, trained, f"{metric}_change") in cells:
                c = paired_difference(values(trained), values(arm))
                if c["p_value"] is not None:
                    paired = (f"{points(c['difference'])} (p = {c['p_value']:.3g}, "
                              f"{'shown' if c['shown'] else 'not shown'})")
            rows.append(f"| {description} | {arm} | {len(change['seeds'])} | "
                        f"{pct(before['stats']['mean']) if before else '—'} | "
                        f"{pct(after['stats']['mean']) if after else '—'} | "
                        f"{points(change['stats'])} | {paired} |")
    return "\n".join(rows)
