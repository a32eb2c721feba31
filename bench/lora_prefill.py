"""What serving through a LoRA adapter costs on vLLM (CPU), with vLLM's own LoRA ops and with
clawray's (``clawray/inference/vllm/cpu_lora.py``), side by side in one run.

Two engines on the same model, alive together (prefix caching off, so every prompt is
computed): ``vllm-ops`` (``CLAWRAY_VLLM_CPU_LORA_OPS=0``) and ``clawray-ops``. Rounds
alternate between them; each request is a fresh prompt of ``--prompt-tokens`` random ids:

- ``base``: prefill (``max_tokens`` 1) with no adapter anywhere in the engine (measured first:
  once an adapter is loaded every request of this engine runs through it);
- ``new_adapter``: the first prefill after ``load_lora`` of a new policy version (a random
  rank-``--rank`` adapter on every linear projection: what the trainer's LoRA sync sends);
- ``adapter``: the next prefill on that adapter;
- ``decode_base`` / ``decode_adapter``: ``--streams`` concurrent requests of a 64-token
  prompt and ``--decode-tokens`` new tokens each, without and then with the adapter.

Reported: each arm's median seconds per engine, each adapter arm over the same engine's base,
and clawray-ops over vllm-ops.

    .venv/bin/python bench/lora_prefill.py --model bundled:smollm2 --rank 16 \\
        --prompt-tokens 592 --out bench/results/lora_prefill-smollm2.json

(Until 2026-12-07 this script loaded named adapters before its base arm, so its "base" ran
through clawray's zero adapter, paying the same LoRA ops: its ratios of ~1.0 were wrong.)
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

ENGINES = {"vllm-ops": "0", "clawray-ops": "1"}  # CLAWRAY_VLLM_CPU_LORA_OPS
ARMS = ("base", "new_adapter", "adapter", "decode_base", "decode_adapter", "load_lora")


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


def start(path: Path, ops: str, rank: int):
    from clawray.inference.vllm.engine import VLLMEngine

    os.environ["CLAWRAY_VLLM_CPU_LORA_OPS"] = ops  # read where vLLM's engine core starts
    return VLLMEngine.from_config(str(path), dtype="float32", max_model_len=4096,
                                  max_num_seqs=8, kv_cache_memory_bytes=512 << 20,
                                  enable_lora=True, max_lora_rank=rank, max_loras=2,
                                  enable_prefix_caching=False)


async def measure(path: Path, args: argparse.Namespace) -> dict:
    from clawray.inference import SamplingParams

    engines = {name: start(path, ops, args.rank) for name, ops in ENGINES.items()}
    rng = random.Random(args.seed)
    times = {name: {arm: [] for arm in ARMS} for name in engines}

    async def prefill(engine) -> float:
        prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_tokens)]
        t0 = time.perf_counter()
        await engine.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        return time.perf_counter() - t0

    async def decode(engine) -> float:
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=1.0,
                                ignore_eos=True)
        prompts = [[rng.randrange(100, 40000) for _ in range(64)] for _ in range(args.streams)]
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return time.perf_counter() - t0

    try:
        for k in range(args.repeats + 1):  # round 0 warms up, unmeasured
            for name, engine in engines.items():
                base, dbase = await prefill(engine), await decode(engine)
                if k:
                    times[name]["base"].append(base)
                    times[name]["decode_base"].append(dbase)
        for k in range(args.repeats + 1):
            payload = random_adapter(path, args.rank, k)
            for name, engine in engines.items():
                t0 = time.perf_counter()
                await engine.load_lora(payload, k + 1)
                loaded = time.perf_counter() - t0
                first, again, dec = await prefill(engine), await prefill(engine), await decode(engine)
                if k:
                    for arm, v in (("load_lora", loaded), ("new_adapter", first),
                                   ("adapter", again), ("decode_adapter", dec)):
                        times[name][arm].append(v)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    med = {name: {arm: statistics.median(v) for arm, v in t.items()} for name, t in times.items()}
    over_base = {name: {"new_adapter": m["new_adapter"] / m["base"],
                        "adapter": m["adapter"] / m["base"],
                        "decode_adapter": m["decode_adapter"] / m["decode_base"]}
                 for name, m in med.items()}
    clawray_over_vllm = {arm: med["clawray-ops"][arm] / med["vllm-ops"][arm] for arm in ARMS}
    return {"seconds": times, "median_s": med, "over_base": over_base,
            "clawray_over_vllm": clawray_over_vllm}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bundled:smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=592)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from clawray.models.loader import resolve_model_path

    path = Path(resolve_model_path(args.model))
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "model": args.model, "prompt_tokens": args.prompt_tokens, "rank": args.rank,
              "repeats": args.repeats, "streams": args.streams,
              "decode_tokens": args.decode_tokens, "machine": platform.machine(),
              "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0],
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              **asyncio.run(measure(path, args))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for name, m in result["median_s"].items():
        r = result["over_base"][name]
        print(f"{name:12s} prefill of {args.prompt_tokens}: base {m['base']:.2f} s, new adapter "
              f"{m['new_adapter']:.2f} s ({r['new_adapter']:.2f}x), adapter {m['adapter']:.2f} s "
              f"({r['adapter']:.2f}x); {args.streams} x {args.decode_tokens} tokens: base "
              f"{m['decode_base']:.2f} s, adapter {m['decode_adapter']:.2f} s "
              f"({r['decode_adapter']:.2f}x); load_lora {m['load_lora']:.3f} s")
    c = result["clawray_over_vllm"]
    print("clawray-ops / vllm-ops: " + ", ".join(f"{a} {c[a]:.2f}x" for a in ARMS))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
