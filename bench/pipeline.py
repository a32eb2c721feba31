"""Sample pipeline throughput: SampleBuffer (Arrow batches + refs + Parquet WAL) vs a Ray queue
of Python dicts, producer actor → store → consumer actor that builds packed tensors.

    .venv/bin/python bench/pipeline.py --quick        # ~1-2 min on 2 cores
    .venv/bin/python bench/pipeline.py --rows 8192

Rows look like live turns: a ~2k-id prompt (a 1.5k-id system prompt shared by every row, as
agent apps send, then ~500 ids of session history), a ~200-id response with log-probs and a
loss mask, votes, a next-state text. The producer holds a pool of distinct rows and sends
copies with fresh sample ids; generating them is not timed. Setups (rows of the table):

    buffer-arrow   producer converts to Arrow (``rows_to_batch``, validated) and ``add``s the
                   batch; the SampleBuffer seals, fsyncs a Parquet segment, ``ray.put``s once;
                   the consumer ``take``s N rows, fetches the slices and runs ``pack_sequences``
    buffer-dicts   the same, but the producer sends dicts and the buffer converts them
    queue-dicts    the baseline: ``ray.util.queue.Queue`` of dicts (``put_nowait_batch`` /
                   ``get_nowait_batch``), no durability; the consumer packs the ids from lists

Throughput is rows over the wall time from the producer's start to the consumer's last packed
batch. The WAL's cost comes from the buffer's own counters (``wal_write_s``: write + fsync +
rename per segment) and, in-process, from ``SampleBufferCore`` with and without writing
(``wal-inproc`` rows). Writes ``bench/results/pipeline.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

VOCAB = 151_000
SYSTEM_IDS = 1_500


def make_pool(n: int, seed: int = 0, prompt_ids: int = 2_000,
              response_ids: int = 200) -> list[dict[str, Any]]:
    """``n`` distinct realistic live-turn rows (see the module doc)."""
    from clawray.samples import make_row

    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, SYSTEM_IDS).tolist()
    pool = []
    for i in range(n):
        n_history = max(1, prompt_ids - SYSTEM_IDS + int(rng.integers(-100, 100)))
        history = rng.integers(0, VOCAB, n_history)
        n_resp = max(1, response_ids + int(rng.integers(-50, 50)))
        pool.append(make_row(
            sample_id=f"pool-{i}", kind="rl", source="live", session_id=f"sess-{i % 16}",
            turn=i // 16, prompt_ids=system + history.tolist(),
            response_ids=rng.integers(0, VOCAB, n_resp).tolist(),
            rollout_logprobs=(-rng.exponential(0.7, n_resp)).astype(np.float32).tolist(),
            policy_version=3, loss_mask=[1] * n_resp, reward=float(rng.choice([-1.0, 0.0, 1.0])),
            votes=[1, 1, -1], vote_parse_failures=0, judge_status="judged",
            next_state=json.dumps([{"role": "user", "content": "thanks, now run the tests " * 8}]),
            finish_reason="stop", created_at=time.time(), judged_at=time.time()))
    return pool


def _actors(ray):
    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self, pool_size: int, seed: int) -> None:
            self.pool = make_pool(pool_size, seed)

        def ready(self) -> bool:
            from clawray.samples import rows_to_batch

            rows_to_batch(self.pool[:8])  # warm up outside the timed run
            return True

        async def run(self, mode: str, target: Any, rows: int, chunk: int,
                      inflight: int) -> dict[str, float]:
            import asyncio

            from clawray.samples import rows_to_batch

            t0, c0 = time.time(), time.process_time()
            pending: set = set()
            for start in range(0, rows, chunk):
                batch = [dict(self.pool[(start + k) % len(self.pool)], sample_id=f"r-{start + k}")
                         for k in range(min(chunk, rows - start))]
                if mode == "queue-dicts":
                    await target.actor.put_nowait_batch.remote(batch)
                    continue
                payload = rows_to_batch(batch) if mode == "buffer-arrow" else batch
                pending.add(asyncio.ensure_future(target.add.remote(payload)))
                if len(pending) >= inflight:
                    done, pending = await asyncio.wait(pending, return_when="FIRST_COMPLETED")
                    for d in done:
                        d.result()
            if pending:
                await asyncio.gather(*pending)
            return {"start": t0, "end": time.time(), "cpu_s": time.process_time() - c0}

    @ray.remote(num_cpus=0)
    class Consumer:
        def ready(self) -> bool:
            import torch  # noqa: F401 - imports (seconds) stay outside the timed run

            from clawray.samples import pack_sequences, rows_to_batch

            pack_sequences(rows_to_batch(make_pool(2)))
            return True

        def run(self, mode: str, source: Any, rows: int, take: int) -> dict[str, float]:
            import torch

            from clawray.buffer.core import fetch
            from clawray.samples import pack_column, pack_sequences

            got, tokens, c0 = 0, 0, time.process_time()
            first = None
            while got < rows:
                n = min(take, rows - got)
                if mode == "queue-dicts":
                    from ray.util.queue import Empty

                    try:
                        items = source.get_nowait_batch(n)
                    except Empty:
                        time.sleep(0.002)
                        continue
                    ids, resp, cu = [], [], [0]
                    for r in items:
                        ids += r["prompt_ids"]
                        ids += r["response_ids"]
                        resp += [False] * len(r["prompt_ids"]) + [True] * len(r["response_ids"])
                        cu.append(len(ids))
                    input_ids = torch.tensor(ids, dtype=torch.int32)
                    torch.tensor(resp)
                    torch.tensor(cu, dtype=torch.int32)
                    torch.tensor([lp for r in items for lp in r["rollout_logprobs"]],
                                 dtype=torch.float32)
                else:
                    slices = ray.get(source.take.remote(n, 5.0))
                    if not slices:
                        continue
                    table = fetch(slices, get=ray.get)
                    source.ack.remote(sorted({s.lease for s in slices if s.lease}))
                    input_ids = pack_sequences(table).input_ids
                    pack_column(table, "rollout_logprobs")
                first = first or time.time()
                got += n
                tokens += int(input_ids.numel())
            return {"end": time.time(), "first": first or time.time(), "tokens": tokens,
                    "cpu_s": time.process_time() - c0}

    return Producer, Consumer


def run_setup(ray, mode: str, args: argparse.Namespace, wal_dir: Path) -> dict[str, Any]:
    from clawray.buffer.actor import start_sample_buffer
    from clawray.config import BufferConfig

    Producer, Consumer = _actors(ray)
    producer, consumer = Producer.remote(args.pool, 1), Consumer.remote()
    ray.get([producer.ready.remote(), consumer.ready.remote()])
    if mode == "queue-dicts":
        from ray.util.queue import Queue

        store = Queue()
        target, source = store, store
    else:
        cfg = BufferConfig(path=str(wal_dir / mode), seal_rows=args.seal_rows, seal_age_s=0.1)
        store = start_sample_buffer(cfg, name=f"bench-{mode}-{os.getpid()}", namespace="bench")
        ray.get(store.ping.remote())
        target = source = store
    cpu0 = _busy_s()
    done = consumer.run.remote(mode, source, args.rows, args.take)
    p = ray.get(producer.run.remote(mode, target, args.rows, args.chunk, args.inflight))
    c = ray.get(done)
    busy = _busy_s() - cpu0
    wall = c["end"] - p["start"]
    out: dict[str, Any] = {
        "setup": mode, "rows": args.rows, "wall_s": round(wall, 3),
        "samples_per_s": round(args.rows / wall, 1),
        "tokens_per_s": round(c["tokens"] / wall, 0),
        "producer_cpu_ms_per_row": round(1000 * p["cpu_s"] / args.rows, 3),
        "consumer_cpu_ms_per_row": round(1000 * c["cpu_s"] / args.rows, 3),
        "machine_cpu_ms_per_row": round(1000 * busy / args.rows, 3),
    }
    if mode == "queue-dicts":
        store.shutdown()
    else:
        stats = ray.get(store.stats.remote())
        out["wal"] = {
            "bytes": stats["wal_bytes"], "segments": stats["segments"],
            "write_s": stats["wal_write_s"],
            "s_per_1k_rows": round(1000 * stats["wal_write_s"] / max(1, stats["rows_sealed"]), 4),
            "mb_per_s": round(stats["wal_bytes"] / 2**20 / max(stats["wal_write_s"], 1e-9), 1),
            "bytes_per_row": round(stats["wal_bytes"] / max(1, stats["rows_sealed"]), 1),
            "share_of_wall": round(stats["wal_write_s"] / wall, 3),
        }
        ray.kill(store, no_restart=True)
    ray.kill(producer)
    ray.kill(consumer)
    return out


def _busy_s() -> float:
    import psutil

    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0)


def wal_inproc(args: argparse.Namespace, wal_dir: Path) -> list[dict[str, Any]]:
    """SampleBufferCore in one process: add + seal of every row, with each compression and
    with a no-op WAL (same core, ``write_segment`` does nothing), to isolate the WAL's cost."""
    from clawray.buffer.core import SampleBufferCore
    from clawray.samples import rows_to_batch

    pool = make_pool(args.pool, 2)
    batches = []
    for start in range(0, args.rows, args.seal_rows):
        rows = [dict(pool[(start + k) % len(pool)], sample_id=f"w-{start + k}")
                for k in range(min(args.seal_rows, args.rows - start))]
        batches.append(rows_to_batch(rows))

    class NoWal(SampleBufferCore):
        def write_segment(self, job):  # type: ignore[override]
            job.nbytes, job.write_s = 0, 0.0

    out = []
    for name, cls, compression in (("no-wal", NoWal, "none"),
                                   ("wal-zstd", SampleBufferCore, "zstd"),
                                   ("wal-snappy", SampleBufferCore, "snappy"),
                                   ("wal-none", SampleBufferCore, "none")):
        core = cls(wal_dir / f"inproc-{name}", seal_rows=args.seal_rows,
                   max_queued_rows=args.rows + 1, compression=compression)
        t0 = time.perf_counter()
        for b in batches:
            core.add(b)
            core.seal()
        wall = time.perf_counter() - t0
        s = core.stats()
        out.append({"setup": f"inproc-{name}", "rows": args.rows, "wall_s": round(wall, 4),
                    "s_per_1k_rows": round(1000 * wall / args.rows, 4),
                    "wal_write_s": s["wal_write_s"], "wal_bytes": s["wal_bytes"],
                    "mb_per_s": round(s["wal_bytes"] / 2**20 / s["wal_write_s"], 1)
                    if s["wal_write_s"] else None,
                    "bytes_per_row": round(s["wal_bytes"] / args.rows, 1)})
    return out


def print_table(report: dict[str, Any]) -> None:
    rows = report["pipeline"]
    base = next((r for r in rows if r["setup"] == "queue-dicts"), None)
    print(f"\n{'setup':<14}{'samples/s':>11}{'vs queue':>10}{'tok/s':>12}{'prod ms/row':>13}"
          f"{'cons ms/row':>13}{'cpu ms/row':>12}{'WAL share':>11}")
    for r in rows:
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        share = f"{r['wal']['share_of_wall']:.0%}" if "wal" in r else "-"
        print(f"{r['setup']:<14}{r['samples_per_s']:>11.1f}{ratio:>10}{r['tokens_per_s']:>12.0f}"
              f"{r['producer_cpu_ms_per_row']:>13.3f}{r['consumer_cpu_ms_per_row']:>13.3f}"
              f"{r['machine_cpu_ms_per_row']:>12.3f}{share:>11}")
    inproc = report["wal_inproc"]
    nowal = next(r for r in inproc if r["setup"] == "inproc-no-wal")
    print(f"\n{'in-process':<20}{'s/1k rows':>11}{'vs no WAL':>11}{'write MB/s':>12}"
          f"{'bytes/row':>11}")
    for r in inproc:
        mbs = f"{r['mb_per_s']:.1f}" if r["mb_per_s"] else "-"
        print(f"{r['setup']:<20}{r['s_per_1k_rows']:>11.4f}"
              f"{r['s_per_1k_rows'] / nowal['s_per_1k_rows']:>10.2f}x{mbs:>12}"
              f"{r['bytes_per_row']:>11.0f}")


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from _report import machine_info

    machine = machine_info()
    import importlib.metadata as md

    machine["versions"] = {p: md.version(p) for p in ("ray", "pyarrow", "torch", "numpy")}
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="clawray-bench-") as tmp:
        wal_dir = Path(tmp)
        report: dict[str, Any] = {
            "benchmark": "pipeline", "machine": machine,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "wal_inproc": wal_inproc(args, wal_dir),
        }
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", namespace="bench")
        try:
            report["pipeline"] = []
            for mode in setups:
                r = run_setup(ray, mode, args, wal_dir)
                print(f"{mode}: {r['samples_per_s']} samples/s", flush=True)
                report["pipeline"].append(r)
        finally:
            ray.shutdown()
        report["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small run (1024 rows)")
    p.add_argument("--rows", type=int, default=None, help="rows per setup (default 4096)")
    p.add_argument("--setups", default="buffer-arrow,buffer-dicts,queue-dicts")
    p.add_argument("--take", type=int, default=256, help="rows per consumer take")
    p.add_argument("--chunk", type=int, default=32, help="rows per producer add/put")
    p.add_argument("--inflight", type=int, default=16, help="producer adds in flight")
    p.add_argument("--seal-rows", type=int, default=256)
    p.add_argument("--pool", type=int, default=128, help="distinct rows the producer cycles")
    p.add_argument("--out", type=Path, default=RESULTS / "pipeline.json")
    args = p.parse_args(argv)
    if args.rows is None:
        args.rows = 1024 if args.quick else 4096
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from _report import write_results

    return write_results(run_benchmark(args), args.out, print_table)


if __name__ == "__main__":
    raise SystemExit(main())
