"""Session-affine routing, measured: two vLLM replicas (split layout: two PolicyServer replicas
behind one ingress; colocated layout: two ingress replicas behind the Serve proxy), OpenClaw
sessions replayed turn by turn, with ``serving.session_affinity`` on (the default,
``clawray/serve/routing.py``) and off (Serve's default power-of-two routing).

```bash
.venv/bin/python bench/affinity.py           # ~12 min on 2 cores; bench/results/affinity.json
.venv/bin/python bench/affinity.py --layouts colocated   # one layout, ~6 min
```

Each setup replays ``--sessions`` copies of OpenClaw's session ``s1`` (4 requests of ~18k
prompt tokens, each the previous one plus a turn), every copy under its own session id
(``X-Session-Id``) and with its own tag at the start of the system prompt (so no two
sessions share a prefix), the copies interleaved turn by turn, one request at a time. Reported per
request: TTFT and the prompt tokens served from the prefix cache; per setup, the share of
prompt tokens of the later turns served from cache and their median TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bodies import fixtures_dir  # noqa: E402
from _servers import BENCH, start_ray, stop  # noqa: E402
from engines import SERVED_NAME, SESSION, stream_one  # noqa: E402


async def replay(url: str, copies: int, max_tokens: int) -> list[dict]:
    bodies = [json.loads((fixtures_dir() / f"{n}.json").read_text())["body"] for n in SESSION]
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for turn, body in enumerate(bodies):
            for c in range(copies):
                sid = f"bench-affinity-{c}"
                # Sessions must differ from their first token on, as real ones do: the
                # copies' system prompts start with their own tag.
                messages = [dict(m) for m in body["messages"]]
                messages[0]["content"] = f"[workspace {c}] " + str(messages[0]["content"])
                req = {**body, "messages": messages,
                       "model": SERVED_NAME, "max_completion_tokens": max_tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                client.headers["X-Session-Id"] = sid
                res = await stream_one(client, url, req)
                usage = res["usage"] or {}
                out.append({"session": sid, "turn": turn, "ttft_ms": res["ttft_s"] * 1e3,
                            "prompt_tokens": usage.get("prompt_tokens"),
                            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                                "cached_tokens") or 0})
    return out


def summarize(rows: list[dict]) -> dict:
    later = [r for r in rows if r["turn"] > 0]
    return {"later_cached_share": sum(r["cached_tokens"] for r in later)
            / max(1, sum(r["prompt_tokens"] or 0 for r in later)),
            # a later turn that found less than half its prompt cached: a cold replica
            "later_misses": sum(r["cached_tokens"] < 0.5 * (r["prompt_tokens"] or 1)
                                for r in later),
            "later_requests": len(later),
            "later_ttft_p50_ms": statistics.median(r["ttft_ms"] for r in later),
            "later_ttft_mean_ms": statistics.fmean(r["ttft_ms"] for r in later),
            "first_ttft_p50_ms": statistics.median(r["ttft_ms"] for r in rows if r["turn"] == 0)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--layouts", default="split,colocated",
                   help="split: two PolicyServer replicas behind one ingress; colocated: two "
                   "ingress replicas (each with its engine) behind the Serve proxy")
    p.add_argument("--out", default=str(BENCH / "results" / "affinity.json"))
    args = p.parse_args(argv)
    from clawray.config import ClawRayConfig
    from clawray.models.loader import policy_model_info

    model = str(policy_model_info(ClawRayConfig()).path)
    logdir = Path(tempfile.mkdtemp(prefix="clawray-bench-affinity-"))
    report = {"command": " ".join(["python", *sys.argv]), "sessions": args.sessions,
              "setups": {}}
    for layout, affinity in [(lay, on) for lay in args.layouts.split(",")
                             for on in (True, False)]:
        name = f"affinity-{'on' if affinity else 'off'}"
        if layout != "split":
            name = f"{layout}-{name}"
        replicas = ({"policy_replicas": 2} if layout == "split"
                    else {"ingress_replicas": 2})
        config = {"model": {"path": model, "served_name": SERVED_NAME},
                  "inference": {"engine": "vllm", "max_running": 8, "kv_cache_gib": 0.5},
                  "serving": {"layout": layout, **replicas, "replica_num_cpus": 1,
                              "session_affinity": affinity, "record_sink": ["jsonl"],
                              "records_path": str(logdir / f"{name}.jsonl")}}
        print(f"[{name}] starting", flush=True)
        started = time.perf_counter()
        # split: the one ingress replica's own port; colocated: through the Serve proxy,
        # which routes between the two ingress replicas by the X-Session-Id header.
        env = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"} if layout == "split" else {}
        servers = start_ray(name, env, config, logdir)
        try:
            url = servers.urls.get("direct", servers.urls["proxy"])
            print(f"[{name}] serving after {time.perf_counter() - started:.0f} s", flush=True)
            rows = asyncio.run(replay(url, args.sessions, args.max_tokens))
        finally:
            stop(servers)
        summary = summarize(rows)
        report["setups"][name] = {"requests": rows, **summary}
        print(f"[{name}] later turns: {summary['later_cached_share']:.1%} of prompt tokens "
              f"from cache, {summary['later_misses']} of {summary['later_requests']} on a cold "
              f"replica, TTFT p50 {summary['later_ttft_p50_ms']:.0f} ms, mean "
              f"{summary['later_ttft_mean_ms']:.0f} ms (first turns "
              f"{summary['first_ttft_p50_ms']:.0f} ms)", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
