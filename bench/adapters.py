"""What per-user adapters cost to serve: the base policy only against 1, 8 and 64 active LoRA
adapters, on each engine, in the same run (ratios to the base), and the memory per adapter.

```bash
.venv/bin/python bench/adapters.py                        # both engines, ~6 min on 2 cores
.venv/bin/python bench/adapters.py --engines hf --adapters 0,1,8
```

Each engine is built once on the embedded model (float32, rank-8 adapters on q/k/v/o and the
MLP projections, what ``training.lora_targets`` trains by default) and driven in-process,
without HTTP, so the figures are the engine's own: ``--concurrency`` workers in a closed
loop, each request a 24-token prompt and 16 greedy new tokens (``ignore_eos``). With N active
adapters request i samples from adapter i mod N, so every batch mixes N users (N = 0: the
base policy). Per level: warm-up requests, then ``--requests`` timed ones; requests/s, p50 and
p90 latency, and the ratio of requests/s to the base's.

Memory: the payload bytes of one adapter (what the store and the weight sync move), and the
resident-memory growth of the serving process (transformers) or of vLLM's engine-core process
after the 64 adapters were loaded and used, divided by 64.

Writes ``bench/results/adapters.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RANK = 8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(model: Any, seed: int) -> dict:
    import torch

    from clawray.models.lora import PEFT_FORMAT, PREFIX, lora_config

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            state[f"{PREFIX}{name}.lora_A.weight"] = torch.randn(RANK, m.in_features,
                                                                 generator=g) * 0.05
            state[f"{PREFIX}{name}.lora_B.weight"] = torch.randn(m.out_features, RANK,
                                                                 generator=g) * 0.05
    return {"format": PEFT_FORMAT, "config": lora_config(RANK, 2.0 * RANK, TARGETS),
            "state": state}


def payload_bytes(payload: dict) -> int:
    from clawray.models.lora import nbytes

    return nbytes(payload)


def build(name: str, path: str, max_adapters: int, concurrency: int) -> Any:
    if name == "hf":
        from clawray.inference.hf_engine import HFEngine

        return HFEngine.from_path(path, dtype="float32", max_model_len=4096,
                                  max_running=concurrency, max_waiting=4 * concurrency,
                                  max_loras=max_adapters, max_lora_rank=RANK)
    from clawray.inference.vllm.engine import VLLMEngine

    return VLLMEngine.from_config(path, dtype="float32", max_model_len=4096,
                                  max_num_seqs=concurrency, max_waiting=4 * concurrency,
                                  kv_cache_memory_bytes=256 << 20, enable_lora=True,
                                  max_lora_rank=RANK, max_loras=min(8, max_adapters),
                                  extra={"max_cpu_loras": max_adapters})


def engine_rss(name: str) -> int:
    """Resident bytes of the process that holds the adapters: this one (transformers) or
    vLLM's engine core."""
    me = psutil.Process()
    if name == "hf":
        return me.memory_info().rss
    cores = [p for p in me.children(recursive=True)
             if "EngineCore" in " ".join(p.cmdline() + [p.name()])]
    return sum(p.memory_info().rss for p in cores)


async def level(engine: Any, adapters: list[str | None], concurrency: int, requests: int,
                warmup: int, seed: int) -> dict[str, Any]:
    from clawray.inference import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 2000) for _ in range(24)] for _ in range(64)]
    counter = iter(range(10**9))
    lat: list[float] = []

    async def worker(until: int, timed: bool) -> None:
        while (i := next(counter)) < until:
            params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                                    adapter=adapters[i % len(adapters)])
            t0 = time.perf_counter()
            out = await engine.generate(prompts[i % len(prompts)], params)
            assert len(out[0].token_ids) == 16
            if timed:
                lat.append(time.perf_counter() - t0)

    await asyncio.gather(*(worker(warmup, False) for _ in range(concurrency)))
    counter = iter(range(10**9))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(requests, True) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat.sort()
    return {"requests": len(lat), "rps": len(lat) / wall,
            "p50_ms": 1000 * statistics.median(lat),
            "p90_ms": 1000 * lat[int(0.9 * (len(lat) - 1))]}


async def run_engine(name: str, path: str, counts: list[int], args: argparse.Namespace,
                     model: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    engine = build(name, path, max(max(counts), 1), args.concurrency)
    print(f"{name}: engine up in {time.monotonic() - t0:.0f} s", flush=True)
    out: dict[str, Any] = {"levels": {}}
    try:
        loaded: list[str] = []
        rss0 = engine_rss(name)
        for n in counts:
            while len(loaded) < n:
                user = f"user-{len(loaded)}"
                await engine.load_adapter(user, random_adapter(model, len(loaded)), version=1)
                loaded.append(user)
            names: list[str | None] = loaded[:n] if n else [None]
            r = await level(engine, names, args.concurrency, args.requests,
                            args.warmup + n, seed=n)
            out["levels"][str(n)] = r
            base = out["levels"]["0"]["rps"] if "0" in out["levels"] else None
            r["rps_vs_base"] = r["rps"] / base if base else None
            label = f"{n} adapters" if n else "base"
            print(f"{name}: {label:>11}  {r['rps']:6.1f} req/s"
                  + (f" ({r['rps_vs_base']:.2f}x base)" if base else "")
                  + f"  p50 {r['p50_ms']:.0f} ms  p90 {r['p90_ms']:.0f} ms", flush=True)
        if loaded:
            out["rss_per_adapter_bytes"] = (engine_rss(name) - rss0) / len(loaded)
            out["adapters_measured_for_memory"] = len(loaded)
    finally:
        await engine.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--adapters", default="0,1,8,64", help="active adapter counts (0: base)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--warmup", type=int, default=32)
    p.add_argument("--out", default=str(RESULTS / "adapters.json"))
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from clawray.models.loader import resolve_model_path

    path = str(resolve_model_path("embedded:tiny"))
    model = AutoModelForCausalLM.from_pretrained(path)
    counts = sorted({int(x) for x in args.adapters.split(",")})
    one = payload_bytes(random_adapter(model, 0))
    results: dict[str, Any] = {
        "machine": machine_info(), "model": path, "rank": RANK, "targets": list(TARGETS),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "adapter_payload_bytes": one, "engines": {}}
    print(f"one rank-{RANK} adapter: {one / 1e6:.2f} MB of tensors", flush=True)
    for name in args.engines.split(","):
        results["engines"][name] = asyncio.run(run_engine(name, path, counts, args, model))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\n| engine | {' | '.join(f'{n} adapters' if n else 'base' for n in counts)} | "
          "resident memory per adapter |")
    print("|---|" + "---|" * (len(counts) + 1))
    for name, r in results["engines"].items():
        cells = []
        for n in counts:
            lv = r["levels"][str(n)]
            ratio = f" ({lv['rps_vs_base']:.2f}x)" if lv.get("rps_vs_base") and n else ""
            cells.append(f"{lv['rps']:.1f} req/s{ratio}, p50 {lv['p50_ms']:.0f} ms")
        mem = r.get("rss_per_adapter_bytes")
        print(f"| {name} | {' | '.join(cells)} | "
              + (f"{mem / 1e6:.2f} MB |" if mem is not None else "- |"))
    print(f"\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
