"""clawray's vLLM engine wrapper against vLLM's own ``AsyncLLM.generate``, in one process, on
one engine: what the wrapper itself costs, with Ray Serve, HTTP and the ingress left out.

```bash
.venv/bin/python bench/engine_wrapper.py --model bundled:smollm2     # ~3 min on 2 cores
```

One ``VLLMEngine`` (the engine settings of ``bench/engines.py``) serves the agent turn of
``bench/_bodies.py`` (rendered with the model's template, tools included), greedy, 16 new
tokens, streamed, in closed loops at c = 1 and 8:

- ``clawray``: ``VLLMEngine.generate_stream`` (admission, sampling settings with log-probs of
  the sampled tokens, per-token policy versions, the deltas clawray's ingress consumes);
- ``raw``: ``engine._llm.generate`` with the settings ``vllm serve`` would pass (DELTA outputs,
  no log-probs);
- ``raw-logprobs``: the same with the sampled token's log-prob at every position
  (``logprobs=0``, no detokenization), which clawray asks for to record each turn;
- ``ingress`` (``--ingress``): clawray's whole serving code on that engine, in this process:
  ``IngressCore.chat_completions`` on the request body built in memory (parsing, the chat
  template, tokenization, detokenization, tool-call parsing, SSE, the record), no HTTP and no
  Ray. Between it and clawray over Ray Serve (``engines.py``) lie Serve's replica and Ray's
  processes.

The two alternate within each round (the order reversed every other round): one paired ratio
per round and level. Writes ``bench/results/engine_wrapper.json``. Where clawray over Serve
is slower than ``vllm serve`` (``engines.py``) and this ratio is 1, the difference is outside
the engine wrapper.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import machine_info  # noqa: E402

BENCH = Path(__file__).resolve().parent


async def closed_loop(one: Callable[[], Awaitable[tuple[float, float, int]]], concurrency: int,
                      requests: int) -> dict[str, float]:
    results: list[tuple[float, float, int]] = []
    left = [requests]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            results.append(await one())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"req_per_s": len(results) / wall,
            "latency_p50_ms": statistics.median(r[0] for r in results) * 1e3,
            "ttft_p50_ms": statistics.median(r[1] for r in results) * 1e3,
            "tokens_mean": statistics.fmean(r[2] for r in results)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from clawray.inference.engine import SamplingParams

    import engines

    path, ids, engine = engines.inproc_engine(args.model, args.max_tokens)
    ingress = ingress_sender(path, engine, args.max_tokens) if args.ingress else None
    ours = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    theirs = VLLMSamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                output_kind=RequestOutputKind.DELTA)
    # what clawray asks of vLLM beyond that: the sampled token's log-prob at every position
    # (the record RL trains from), with the raw log-prob mode clawray starts vLLM in
    theirs_lp = VLLMSamplingParams(max_tokens=args.max_tokens, temperature=0.0, logprobs=0,
                                   detokenize=False, output_kind=RequestOutputKind.DELTA)

    async def clawray_one() -> tuple[float, float, int]:
        t0, ttft, n = time.perf_counter(), None, 0
        async for delta in engine.generate_stream(ids, ours):
            if ttft is None and delta.token_ids:
                ttft = time.perf_counter() - t0
            n += len(delta.token_ids)
        return time.perf_counter() - t0, ttft or 0.0, n

    async def raw(params: VLLMSamplingParams) -> tuple[float, float, int]:
        t0, ttft, n = time.perf_counter(), None, 0
        async for out in engine._llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                              f"raw-{uuid.uuid4().hex}"):
            for c in out.outputs:
                if ttft is None and c.token_ids:
                    ttft = time.perf_counter() - t0
                n += len(c.token_ids)
        return time.perf_counter() - t0, ttft or 0.0, n

    async def ingress_one() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        ttft, n = await ingress()
        return time.perf_counter() - t0, ttft - t0, n

    setups = {"clawray": clawray_one, "raw": lambda: raw(theirs),
              "raw-logprobs": lambda: raw(theirs_lp)}
    if ingress is not None:
        setups["ingress"] = ingress_one
    levels = [int(c) for c in args.concurrency.split(",")]

    async def measure() -> list[dict[str, Any]]:
        for one in setups.values():  # warm: the first requests pay one-time costs
            await closed_loop(one, 4, 8)
        cells = []
        for r in range(args.rounds):
            order = list(setups) if r % 2 == 0 else list(setups)[::-1]
            for c in levels:
                for name in order:
                    cell = await closed_loop(setups[name], c, args.requests * c)
                    cell.update(round=r, setup=name, concurrency=c)
                    cells.append(cell)
                    print(f"[round {r}] {name} c={c}: {cell['req_per_s']:.2f} req/s, TTFT p50 "
                          f"{cell['ttft_p50_ms']:.0f} ms", flush=True)
        await engine.shutdown()
        return cells

    cells = asyncio.run(measure())
    summary = []
    for c in levels:
        by = {(x["round"], x["setup"]): x for x in cells if x["concurrency"] == c}
        for name in [n for n in setups if n != "raw"]:
            ratios = [by[(r, name)]["req_per_s"] / by[(r, "raw")]["req_per_s"]
                      for r in range(args.rounds)]
            summary.append({"setup": name, "baseline": "raw", "concurrency": c,
                            "req_per_s_ratio_mean": statistics.fmean(ratios),
                            "req_per_s_ratio_sem": (statistics.stdev(ratios) / len(ratios) ** 0.5
                                                    if len(ratios) > 1 else None),
                            "req_per_s_ratios": ratios})
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine_info(), "model": path, "prompt_tokens": len(ids),
            "settings": {"rounds": args.rounds, "concurrency": levels,
                         "requests_per_stream": args.requests, "max_tokens": args.max_tokens,
                         "vllm_args": engines.VLLM_ARGS},
            "cells": cells, "summary": summary}


def ingress_sender(path: str, engine: Any, max_tokens: int
                   ) -> Callable[[], Awaitable[tuple[float, int]]]:
    """One streamed agent turn through clawray's ``IngressCore`` on ``engine``, in this
    process: ``() -> (time of the first content chunk, chunks)``."""
    import tempfile
    from unittest import mock

    from _inproc import asgi_request

    from clawray.config import ClawRayConfig
    from clawray.models.loader import policy_model_info
    from clawray.serve.ingress import IngressCore

    import engines

    cfg = ClawRayConfig.from_dict({
        "model": {"path": path, "served_name": engines.SERVED_NAME, "device": "cpu",
                  "max_model_len": engines.VLLM_ARGS["max_model_len"]},
        "serving": {"record_sink": ["jsonl"], "max_tokens_limit": 4096,
                    "records_path": str(Path(tempfile.mkdtemp()) / "turns.jsonl")}})
    # the replica's core, on this process's engine rather than a second one
    with mock.patch("clawray.serve.policy_server.load_policy_engine",
                    return_value=(engine, policy_model_info(cfg))):
        core = IngressCore(cfg)
    body = json.dumps({**engines.agent_turn(engines.SERVED_NAME, max_tokens, stream=True),
                       "temperature": 0}).encode()

    async def send() -> tuple[float, int]:
        response = await core.chat_completions(asgi_request(body))
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {bytes(response.body)[:300]!r}")
        first, n = None, 0
        async for chunk in response.body_iterator:
            n += 1
            if first is None and b'"content"' in (chunk if isinstance(chunk, bytes)
                                                 else chunk.encode()):
                first = time.perf_counter()
        return first or time.perf_counter(), n

    return send


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled:smollm2")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=12, help="requests per stream per level")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ingress", action="store_true",
                   help="also clawray's whole serving code in this process (IngressCore)")
    p.add_argument("--out", default=str(BENCH / "results" / "engine_wrapper.json"))
    args = p.parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for s in report["summary"]:
        print(f"{s['setup']} / raw AsyncLLM @ c={s['concurrency']}: req/s x"
              f"{s['req_per_s_ratio_mean']:.3f} ± {s['req_per_s_ratio_sem'] or 0:.3f} (rounds "
              f"{', '.join(f'{x:.2f}' for x in s['req_per_s_ratios'])})")
    print(f"wrote {out}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
