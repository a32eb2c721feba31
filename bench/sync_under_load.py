"""Streaming latency while new weights arrive every few seconds, against steady state, on
clawray's vLLM engine (one process, no Serve): what a user streaming a reply feels when the
trainer pushes a new policy.

```bash
.venv/bin/python bench/sync_under_load.py --model bundled:smollm2     # ~6 min on 2 cores
```

One ``VLLMEngine`` (LoRA on, rank 16) streams the agent turn of ``bench/_bodies.py``, 32 new
tokens, temperature 1, at ``--concurrency`` streams in a closed loop, through three phases of
``--phase-s`` seconds each:

- ``steady``: nothing else happens;
- ``lora``: every ``--lora-every-s`` a new rank-16 LoRA adapter on every linear layer arrives
  (``engine.load_lora``: the trainer's LoRA sync; requests in flight finish on the adapter
  they started with);
- ``full``: every ``--full-every-s`` the whole state dict arrives (``engine.load_weights``:
  written to files while generation goes on, then vLLM pauses, reloads and resumes).

Per phase: requests, p50/p99 of latency and TTFT, the p99 of the longest gap between two
tokens of a request (a pause shows there), and each p99 over steady's. The goal is a p99
latency at most 1.5x steady's. Writes ``bench/results/sync_under_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import machine_info  # noqa: E402

BENCH = Path(__file__).resolve().parent
RANK = 16


def adapter_payload(model: Any, seed: int) -> dict[str, Any]:
    """A rank-16 LoRA adapter on every linear layer of ``model`` with random (nonzero) B, as
    the learner's LoRA sync sends it."""
    import torch
    from peft import LoraConfig, get_peft_model

    from clawray.models.lora import from_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=2 * RANK,
                                            target_modules="all-linear"))
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=1e-3)
    payload = from_peft_model(peft)
    peft.unload()  # the base model back, unchanged
    return payload


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from clawray.inference.engine import SamplingParams

    import engines

    path, ids, engine = engines.inproc_engine(args.model, args.max_tokens, enable_lora=True,
                                              max_lora_rank=RANK, max_loras=args.max_loras)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    payloads = [adapter_payload(model, seed) for seed in range(2)]
    del model
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    version = [0]

    async def one(records: list[dict[str, float]]) -> None:
        t0 = time.perf_counter()
        stamps = []
        async for delta in engine.generate_stream(ids, params):
            now = time.perf_counter()
            stamps.extend([now] * len(delta.token_ids))
        gaps = np.diff([t0, *stamps])
        records.append({"latency_s": time.perf_counter() - t0,
                        "ttft_s": float(gaps[0]) if len(gaps) else float("nan"),
                        "max_gap_s": float(gaps[1:].max()) if len(gaps) > 1 else 0.0,
                        "tokens": len(stamps)})

    async def syncer(phase: str, stop_at: float, log: list[dict[str, Any]]) -> None:
        every = args.lora_every_s if phase == "lora" else args.full_every_s
        while time.perf_counter() + every < stop_at:
            await asyncio.sleep(every)
            version[0] += 1
            t0 = time.perf_counter()
            if phase == "lora":
                await engine.load_lora(payloads[version[0] % 2], version[0])
            else:
                await engine.load_weights(state, version[0])
            log.append({"version": version[0], "seconds": time.perf_counter() - t0})

    async def phase(name: str) -> dict[str, Any]:
        records: list[dict[str, float]] = []
        syncs: list[dict[str, Any]] = []
        stop_at = time.perf_counter() + args.phase_s

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                await one(records)

        tasks = [worker() for _ in range(args.concurrency)]
        if name != "steady":
            tasks.append(syncer(name, stop_at, syncs))
        await asyncio.gather(*tasks)
        lat = [r["latency_s"] * 1e3 for r in records]
        ttft = [r["ttft_s"] * 1e3 for r in records]
        gap = [r["max_gap_s"] * 1e3 for r in records]
        out = {"phase": name, "requests": len(records), "syncs": syncs,
               "latency_p50_ms": pct(lat, 50), "latency_p99_ms": pct(lat, 99),
               "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
               "max_gap_p99_ms": pct(gap, 99),
               "tokens_mean": float(np.mean([r["tokens"] for r in records]))}
        print(f"[{name}] {out['requests']} requests, {len(syncs)} syncs: latency p50/p99 "
              f"{out['latency_p50_ms']:.0f}/{out['latency_p99_ms']:.0f} ms, TTFT p50/p99 "
              f"{out['ttft_p50_ms']:.0f}/{out['ttft_p99_ms']:.0f} ms, longest gap p99 "
              f"{out['max_gap_p99_ms']:.0f} ms", flush=True)
        return out

    async def measure() -> list[dict[str, Any]]:
        warm: list[dict[str, float]] = []
        await asyncio.gather(*(one(warm) for _ in range(args.concurrency)))
        await engine.load_lora(payloads[0], 0)  # steady serves through an adapter as well
        phases = [await phase(name) for name in ["steady", *args.phases.split(",")]]
        await engine.shutdown()
        return phases

    phases = asyncio.run(measure())
    steady = phases[0]
    for p in phases[1:]:
        for key in ("latency_p99_ms", "ttft_p99_ms", "max_gap_p99_ms"):
            p[f"{key}_over_steady"] = (p[key] / steady[key]) if steady[key] else None
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine_info(), "model": path, "prompt_tokens": len(ids),
            "settings": {k: getattr(args, k) for k in ("concurrency", "phase_s", "lora_every_s",
                                                        "full_every_s", "max_tokens",
                                                        "max_loras")},
            "phases": phases}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled:smollm2")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--lora-every-s", type=float, default=3.0)
    p.add_argument("--full-every-s", type=float, default=8.0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-loras", type=int, default=2,
                   help="adapters vLLM batches at once (clawray's vLLM default: 2)")
    p.add_argument("--phases", default="lora,full", help="after steady: lora, full or both")
    p.add_argument("--out", default=str(BENCH / "results" / "sync_under_load.json"))
    args = p.parse_args(argv)
    if unknown := set(args.phases.split(",")) - {"lora", "full"}:
        p.error(f"--phases: unknown {', '.join(sorted(unknown))} (lora, full)")
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for ph in report["phases"][1:]:
        print(f"{ph['phase']}: p99 latency x{ph['latency_p99_ms_over_steady']:.2f} steady's, "
              f"TTFT p99 x{ph['ttft_p99_ms_over_steady']:.2f}, longest-gap p99 "
              f"x{ph['max_gap_p99_ms_over_steady']:.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
