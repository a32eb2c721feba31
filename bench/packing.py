"""Learner step time by pack size: ``LearnerCore.update`` on the same batches of judge rows
(``clawray judge-sft``'s examples, ~720-token prompts) with ``training.max_pack_tokens`` at the
default 2048 (the baseline: two rows per forward pass, one block-causal mask over both) and at
smaller sizes (one row per pass).

    .venv/bin/python bench/packing.py --quick        # ~2 min on 2 cores
    .venv/bin/python bench/packing.py --sizes 2048 1024 512 --rounds 6

Without flash attention a pack of T tokens costs T² in attention whatever its mask, so two
rows of L tokens packed cost (2L)² against 2L² alone; fewer passes cost per-call overhead. One
learner per size, all from the same weights on one torch thread (as judge-sft builds), fed the
same seeded batches; rounds are interleaved (round i runs every size once on batch i, the order
rotated by i) so machine noise hits them alike. Reports each size's median step time and its
ratio to the baseline's, median over rounds; writes ``bench/results/packing.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH.parent))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import pyarrow as pa
    import torch

    from clawray.config import ClawRayConfig
    from clawray.learner.group import free_port
    from clawray.learner.learner import LearnerCore, init_distributed
    from clawray.models.loader import load_tokenizer, policy_model_info
    from clawray.samples import rows_to_batch
    from clawray.sim.judge_sft import judge_examples, judge_sft_rows

    torch.set_num_threads(1)
    cfg = ClawRayConfig()
    base = policy_model_info(cfg).path
    rows = judge_sft_rows(judge_examples(args.pool, "train", args.seed), load_tokenizer(base))
    table = pa.Table.from_batches([rows_to_batch(rows)])
    rng = np.random.default_rng(args.seed)
    batches = [table.take(pa.array(np.sort(rng.choice(table.num_rows, args.batch_size,
                                                       replace=False))))
               for _ in range(args.warmup + args.rounds)]
    init_distributed(0, 1, "127.0.0.1", free_port("127.0.0.1"))
    learners = {}
    for size in args.sizes:
        t = cfg.training_cfg.model_copy(update={
            "lr": 1e-3, "mini_batches": 1, "micro_batches": 1, "num_learners": 1,
            "lora_rank": 0, "max_pack_tokens": size,
            "loss": cfg.training_cfg.loss.model_copy(update={"kl_coef": 0.0})})
        learners[size] = LearnerCore(base, t)
    times: dict[int, list[float]] = {s: [] for s in args.sizes}
    for i, batch in enumerate(batches):
        order = args.sizes[i % len(args.sizes):] + args.sizes[:i % len(args.sizes)]
        for size in order:
            t0 = time.perf_counter()
            learners[size].update(batch)
            if i >= args.warmup:
                times[size].append(time.perf_counter() - t0)
        print(f"round {i + 1}/{len(batches)}", flush=True)
    baseline = args.sizes[0]
    lengths = [len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows]
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "row_tokens": {"mean": float(np.mean(lengths)), "min": min(lengths),
                       "max": max(lengths)},
        "baseline": baseline,
        "sizes": {str(s): {"median_step_s": statistics.median(times[s]),
                           "ratio_to_baseline": statistics.median(
                               a / b for a, b in zip(times[s], times[baseline])),
                           "step_s": times[s]} for s in args.sizes}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 timed rounds of 16 rows")
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 1024],
                   help="max_pack_tokens values; the first is the baseline")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--pool", type=int, default=256, help="distinct judge rows")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "packing.json")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.batch_size, args.pool = 3, 16, 64
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"rows of {report['row_tokens']['mean']:.0f} tokens, {args.batch_size} per step, "
          f"one torch thread:")
    for size, row in report["sizes"].items():
        print(f"  max_pack_tokens {size:>5}: {row['median_step_s']:.2f} s per step, "
              f"{row['ratio_to_baseline']:.2f}x the baseline's ({report['baseline']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
