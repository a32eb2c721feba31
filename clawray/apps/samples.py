"""``clawray samples stats|head PATH``: look into a sample WAL folder (or one Parquet file).

    clawray samples stats ~/.cache/clawray/samples
    clawray samples head ~/.cache/clawray/samples -n 3 --columns sample_id,reward,response_ids
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds

from clawray.buffer.core import CHECKPOINT
from clawray.samples import SCHEMA

_MAX_LIST = 6  # lists longer than this print as "[N ids]" / "[N values]"
_MAX_TEXT = 60


def _dataset(path: str) -> ds.Dataset:
    # the current schema: older logs' files read their newer columns as null
    return ds.dataset(Path(path).expanduser(), format="parquet", schema=SCHEMA)


def _counts(column: Any) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for item in pc.value_counts(column).to_pylist():
        counts[str(item["values"])] += item["counts"]
    return dict(counts.most_common())


def reward_histogram(rewards: np.ndarray, bins: int = 10) -> list[tuple[str, int]]:
    """Counts per distinct value when rewards are discrete (few values), else per bin."""
    if len(rewards) == 0:
        return []
    values, counts = np.unique(rewards, return_counts=True)
    if len(values) <= 12:
        return [(f"{v:g}", int(c)) for v, c in zip(values, counts)]
    counts, edges = np.histogram(rewards, bins=bins)
    return [(f"[{lo:.3g}, {hi:.3g})", int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)]


def collect_stats(path: str) -> dict[str, Any]:
    """Row counts, kinds, judge statuses, reward summary and the consumed position."""
    table = _dataset(path).to_table(columns=["kind", "judge_status", "reward"])
    rewards = table.column("reward").to_numpy()
    out: dict[str, Any] = {
        "rows": table.num_rows,
        "by_kind": _counts(table.column("kind")),
        "by_judge_status": _counts(table.column("judge_status")),
        "reward": {"count": int(len(rewards)),
                   "mean": float(rewards.mean()) if len(rewards) else None,
                   "min": float(rewards.min()) if len(rewards) else None,
                   "max": float(rewards.max()) if len(rewards) else None,
                   "histogram": reward_histogram(rewards)},
    }
    ckpt = Path(path).expanduser() / CHECKPOINT
    if ckpt.is_file():
        out["consumed"] = json.loads(ckpt.read_text())
    return out


def _short(name: str, value: Any) -> str:
    if isinstance(value, list):
        if len(value) > _MAX_LIST:
            return f"[{len(value)} {'ids' if name.endswith('_ids') else 'values'}]"
        return "[" + ", ".join(f"{v:.3g}" if isinstance(v, float) else str(v)
                               for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.3f}" if name.endswith("_at") else f"{value:.4g}"
    if isinstance(value, str) and len(value) > _MAX_TEXT:
        return repr(value[:_MAX_TEXT] + "…")
    return repr(value) if isinstance(value, str) else str(value)


def print_stats(stats: dict[str, Any], out: TextIO) -> None:
    print(f"rows: {stats['rows']}", file=out)
    for key in ("by_kind", "by_judge_status"):
        parts = ", ".join(f"{k}={v}" for k, v in stats[key].items()) or "-"
        print(f"{key.replace('_', ' ')}: {parts}", file=out)
    r = stats["reward"]
    if r["count"]:
        print(f"reward: count={r['count']} mean={r['mean']:.4g} min={r['min']:.4g} "
              f"max={r['max']:.4g}", file=out)
        top = max(c for _, c in r["histogram"])
        for label, count in r["histogram"]:
            bar = "#" * max(1 if count else 0, round(30 * count / top))
            print(f"  {label:>18} {count:8d} {bar}", file=out)
    if "consumed" in stats:
        c = stats["consumed"]
        print(f"consumed: up to segment {c['seq']} row {c['offset']}", file=out)


def print_head(path: str, n: int, columns: list[str] | None, out: TextIO) -> None:
    dataset = _dataset(path)
    if columns:
        unknown = sorted(set(columns) - set(dataset.schema.names))
        if unknown:
            raise SystemExit(f"unknown column(s) {unknown}; columns: {dataset.schema.names}")
    rows = dataset.head(n, columns=columns).to_pylist()
    for row in rows:
        print("  ".join(f"{k}={_short(k, v)}" for k, v in row.items() if v is not None),
              file=out)


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="clawray samples", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_stats = sub.add_parser("stats", help="row counts, kinds, judge statuses, rewards")
    p_stats.add_argument("path")
    p_stats.add_argument("--json", action="store_true", help="print the stats as JSON")
    p_head = sub.add_parser("head", help="print the first rows compactly")
    p_head.add_argument("path")
    p_head.add_argument("-n", type=int, default=5)
    p_head.add_argument("--columns", default=None, help="comma list of columns")
    args = parser.parse_args(argv)
    if not Path(args.path).expanduser().exists():
        print(f"no such path: {args.path}", file=sys.stderr)
        return 2
    if args.command == "stats":
        stats = collect_stats(args.path)
        if args.json:
            print(json.dumps(stats, indent=2), file=out)
        else:
            print_stats(stats, out)
    else:
        columns = [c.strip() for c in args.columns.split(",")] if args.columns else None
        print_head(args.path, args.n, columns, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
