"""What a LoRA adapter costs a prompt's prefill on vLLM: through an adapter already in use, and
the first request on an adapter just loaded, against the base model.

One engine (prefix caching off, so every prompt is computed), a random rank-``--rank`` adapter
on every linear projection; prompts of ``--prompt-tokens`` random ids with ``max_tokens`` 1,
interleaved, ``--repeats`` rounds (a first round unmeasured):

- ``base``: no adapter;
- ``adapter``: the adapter of the previous round (in use, in vLLM's slots);
- ``new_adapter``: the first request after ``load_adapter`` of a new version (what a user
  meets right after a weight sync: vLLM reads the adapter's folder and fills a slot).

Reported: the median seconds of each and their ratios to ``base``, and of ``load_adapter``
itself (clawray writes the PEFT folder and registers it with vLLM).

    .venv/bin/python bench/lora_prefill.py --model bundled:smollm2 \\
        --out bench/results/lora_prefill-smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def random_adapter(path: Path, rank: int, seed: int) -> dict:
    """A PEFT payload with random A and B on every linear projection of the model."""
    import torch
    from safetensors import safe_open

    from clawray.models.lora import PEFT_FORMAT, PREFIX, lora_config

    g = torch.Generator().manual_seed(seed)
    state, targets = {}, set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                short = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
                if short.endswith("_proj"):
                    out_f, in_f = f.get_slice(name).get_shape()
                    stem = name[:-len(".weight")]
                    state[f"{PREFIX}{stem}.lora_A.weight"] = torch.randn(
                        rank, in_f, generator=g) * 0.02
                    state[f"{PREFIX}{stem}.lora_B.weight"] = torch.randn(
                        out_f, rank, generator=g) * 0.02
                    targets.add(short)
    return {"format": PEFT_FORMAT, "config": lora_config(rank, 2.0 * rank, targets),
            "state": state}


async def measure(path: Path, args: argparse.Namespace) -> dict:
    from clawray.inference import SamplingParams
    from clawray.inference.vllm.engine import VLLMEngine

    engine = VLLMEngine.from_config(str(path), dtype="float32", max_model_len=4096,
                                    max_num_seqs=2, kv_cache_memory_bytes=512 << 20,
                                    enable_lora=True, max_lora_rank=args.rank, max_loras=2,
                                    enable_prefix_caching=False)
    rng = random.Random(args.seed)
    times: dict[str, list[float]] = {"base": [], "adapter": [], "new_adapter": [],
                                     "load_adapter": []}

    async def prefill(adapter: str | None) -> float:
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        t0 = time.perf_counter()
        await engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                     adapter=adapter))
        return time.perf_counter() - t0

    try:
        for k in range(args.repeats + 1):  # round 0 warms up, unmeasured
            payload = random_adapter(path, args.rank, k)
            t0 = time.perf_counter()
            await engine.load_adapter("bench", payload, version=k + 1)
            loaded = time.perf_counter() - t0
            first = await prefill("bench")
            again = await prefill("bench")
            base = await prefill(None)
            if k:
                times["load_adapter"].append(loaded)
                times["new_adapter"].append(first)
                times["adapter"].append(again)
                times["base"].append(base)
    finally:
        await engine.shutdown()
    med = {arm: statistics.median(v) for arm, v in times.items()}
    return {"seconds": times, "median_s": med,
            "over_base": {arm: med[arm] / med["base"] for arm in ("adapter", "new_adapter")},
            "load_adapter_median_s": med["load_adapter"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from clawray.models.loader import resolve_model_path

    path = Path(resolve_model_path(args.model))
    result = {"model": args.model, "prompt_tokens": args.prompt_tokens, "rank": args.rank,
              "repeats": args.repeats, "machine": platform.machine(), "cpus": os.cpu_count(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **asyncio.run(measure(path, args))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    m, r = result["median_s"], result["over_base"]
    print(f"prefill of {args.prompt_tokens} tokens, median: base {m['base']:.3f} s, adapter in "
          f"use {m['adapter']:.3f} s ({r['adapter']:.2f}x), first request on a new adapter "
          f"{m['new_adapter']:.3f} s ({r['new_adapter']:.2f}x); load_adapter "
          f"{m['load_adapter']:.3f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
