"""Weight-sync time into each engine against a memory copy of the same bytes.

    .venv/bin/python bench/weight_sync.py                  # both engines, tiny + medium, ~6 min
    .venv/bin/python bench/weight_sync.py --engines hf --sizes tiny --rounds 3   # smoke

For each model size and engine, the engine is started in this process and given ``--rounds``
full state dicts (every tensor of the model, perturbed, fp32) through ``engine.load_weights``:
the step a serving replica runs once the learner's tensors have arrived (the object-store hop
before it is the same for both engines). Baselines on the same tensors in the same run:

* ``memcpy``: ``dst.copy_(src)`` of every tensor into preallocated ones (the floor: the bytes
  have to move once);
* ``file``: ``safetensors.torch.save_file`` of the same tensors (the vLLM path writes one
  checkpoint that vLLM's ``reload_weights`` then reads back).

Sizes: ``tiny``, the embedded default (2.6 MB); ``medium``, the same architecture at width 512,
8 layers (~117 MB, random weights, the embedded tokenizer). Reported per cell: median seconds
with the standard error of the mean over the rounds, GB/s and the ratio to memcpy. Writes
``bench/results/weight_sync.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MEDIUM = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
              head_dim=64, intermediate_size=1536)


def model_folder(size: str, workdir: Path) -> Path:
    from clawray.models.tiny import build_embedded_default

    tiny = Path(build_embedded_default())
    if size == "tiny":
        return tiny
    if size != "medium":
        raise SystemExit(f"unknown size {size!r}: tiny or medium")
    from transformers import AutoConfig, AutoModelForCausalLM

    out = workdir / "medium"
    if (out / "model.safetensors").exists():
        return out
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors"))
    config = AutoConfig.from_pretrained(tiny)
    for k, v in MEDIUM.items():
        setattr(config, k, v)
    config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    return out


def perturbed_state(path: Path, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        state[name] = (t + torch.randn(t.shape, generator=g) * 0.01).contiguous()
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def summary(xs: list[float], nb: int) -> dict[str, float]:
    med = statistics.median(xs)
    sem = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
    return {"median_s": med, "sem_s": sem, "gb_per_s": nb / med / 1e9, "rounds": xs}


def baselines(state: dict[str, torch.Tensor], rounds: int, workdir: Path) -> dict[str, list]:
    from safetensors.torch import save_file

    dst = {k: torch.empty_like(v) for k, v in state.items()}
    memcpy, file = [], []
    # a tied lm_head shares the embedding's storage: save it once, as the vLLM path does
    unique = {k: v for k, v in state.items() if k != "lm_head.weight"}
    for _ in range(rounds):
        t = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        memcpy.append(time.perf_counter() - t)
        t = time.perf_counter()
        save_file(unique, str(workdir / "baseline.safetensors"))
        file.append(time.perf_counter() - t)
    return {"memcpy": memcpy, "file": file}


async def engine_rounds(engine_name: str, path: Path, states: list[dict]) -> dict:
    started = time.perf_counter()
    if engine_name == "hf":
        from clawray.inference.hf_engine import HFEngine

        engine = HFEngine.from_path(path, max_model_len=2048)
    else:
        from clawray.inference.vllm.engine import VLLMEngine

        engine = VLLMEngine.from_config(str(path), max_model_len=2048,
                                        kv_cache_memory_bytes=256 << 20, dtype="float32")
    start_s = time.perf_counter() - started
    from clawray.inference.engine import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0)
    await engine.generate([5, 6, 7, 8], params)  # warm
    times = []
    try:
        for i, state in enumerate(states):
            t = time.perf_counter()
            await engine.load_weights(state, i + 1)
            times.append(time.perf_counter() - t)
            out = await engine.generate([5, 6, 7, 8], params)  # it still serves, on the new one
            assert out[0].policy_version == i + 1, out[0]
    finally:
        await engine.shutdown()
    return {"start_s": start_s, "load_weights": times}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--sizes", default="tiny,medium")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/weight_sync.json"))
    args = ap.parse_args()
    engines = args.engines.split(",")
    if "vllm" in engines:
        from clawray.inference.vllm import VLLMUnavailableError, check_vllm_available

        try:
            check_vllm_available()
        except VLLMUnavailableError as e:
            print(f"weight_sync: leaving vllm out: {e}", file=sys.stderr)
            engines.remove("vllm")
    workdir = Path(tempfile.mkdtemp(prefix="clawray-bench-weights-"))
    cells = []
    try:
        for size in args.sizes.split(","):
            path = model_folder(size, workdir)
            states = [perturbed_state(path, seed) for seed in range(args.rounds)]
            nb = nbytes({k: v for k, v in states[0].items() if k != "lm_head.weight"})
            print(f"== {size}: {len(states[0])} tensors, {nb / 1e6:.1f} MB", flush=True)
            base = baselines(states[0], args.rounds, workdir)
            for name, xs in base.items():
                cells.append({"size": size, "setup": name, "bytes": nb, **summary(xs, nb)})
            for engine in engines:
                print(f"   {engine}: starting", flush=True)
                res = asyncio.run(engine_rounds(engine, path, states))
                cells.append({"size": size, "setup": f"{engine}.load_weights", "bytes": nb,
                              "engine_start_s": res["start_s"],
                              **summary(res["load_weights"], nb)})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for c in cells:
        floor = next(x for x in cells if x["size"] == c["size"] and x["setup"] == "memcpy")
        c["vs_memcpy"] = c["median_s"] / floor["median_s"]
    print(f"\n{'size':8} {'setup':18} {'median s':>10} {'± sem':>8} {'GB/s':>7} {'x memcpy':>9}")
    for c in cells:
        print(f"{c['size']:8} {c['setup']:18} {c['median_s']:10.4f} {c['sem_s']:8.4f} "
              f"{c['gb_per_s']:7.2f} {c['vs_memcpy']:9.1f}")
    report = {"machine": {"python": platform.python_version(), "cpus": torch.get_num_threads(),
                          "torch": torch.__version__},
              "command": " ".join(["bench/weight_sync.py", *sys.argv[1:]]),
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cells": cells}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
