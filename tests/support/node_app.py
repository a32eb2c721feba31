"""Run as a script by test_engine_dies_with_its_node_on_cpu.py: a Ray node of its own (started
by ``ray.init``, so its raylet and GCS are this process's children) serving the embedded
default (built already) with vLLM as a clawray Serve app. Once one chat turn is answered it prints one JSON
line, ``{"port", "engines", "watchdogs", "ray"}`` (the pids of the replica's vLLM processes, of
their watchdogs and of the node's raylet and GCS), and then waits to be killed.

A separate process because the test session shares one Ray cluster, and this node is to be
killed under the app."""

from __future__ import annotations

import json
import tempfile
import time


def title(p) -> str:
    import psutil

    try:
        return " ".join([p.name(), *p.cmdline()])
    except psutil.Error:
        return ""


def main() -> None:
    import openai
    import psutil
    import ray
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.serve.app import build_app
    from tests.support.common import free_port

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    tmp = tempfile.mkdtemp(prefix="clawray-node-app-")
    cfg = (ClawRayConfig()  # the embedded default, served as "clawray-tiny"
           .inference(engine="vllm", kv_cache_gib=0.25, max_running=4)
           .serving(record_sink=["jsonl"], records_path=f"{tmp}/turns.jsonl")
           .sessions(num_hubs=1))
    serve.run(build_app(cfg), name="node-app", route_prefix="/")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="clawray-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert reply.choices[0].message is not None
    tree = psutil.Process().children(recursive=True)
    print(json.dumps({
        "port": port,
        "engines": [p.pid for p in tree if "VLLM::" in title(p)],
        "watchdogs": [p.pid for p in tree if "clawray.inference.watchdog" in title(p)],
        "ray": [p.pid for p in tree if any(n in title(p) for n in ("raylet", "gcs_server"))],
    }), flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
