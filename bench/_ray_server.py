"""Hosts clawray's Serve application on a fresh local Ray cluster for ``bench/serving.py``.

Run as its own process so every Ray setting (``RAY_SERVE_ENABLE_DIRECT_INGRESS``,
``RAY_SERVE_THROUGHPUT_OPTIMIZED``), which Ray reads from the environment when its processes
start, applies to a cluster of its own and the benchmark process never runs Ray itself:

    RAY_SERVE_ENABLE_DIRECT_INGRESS=1 python bench/_ray_server.py --port 8123 --config '{...}'

With ``--actor`` it runs no Serve at all: one plain Ray actor (the replica's CPUs) hosts
clawray's ``IngressCore`` and its engine behind uvicorn on ``--port`` (the engine server of
``_baseline_servers.py``), to tell what running in a Ray worker costs from what Serve's
replica costs.

Once the app is running it prints one JSON line (proxy URL, the ingress replicas' own HTTP
URLs when direct ingress is on, replica pids) and serves until its stdin closes, then stops
its Ray cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

APP_NAME = "clawray"
QUIET_LOGGING = {"log_level": "WARNING", "enable_access_log": False}


def replica_info(details: dict[str, Any]) -> dict[str, list[int]]:
    """Pids of the running replicas of each deployment of the app."""
    deployments = details["applications"][APP_NAME]["deployments"]
    return {name: [r["pid"] for r in d.get("replicas", [])
                   if r.get("state") == "RUNNING" and r.get("pid")]
            for name, d in deployments.items()}


def direct_ingress_urls(details: dict[str, Any], proxy_port: int) -> list[str]:
    """The ingress replicas' own HTTP endpoints (empty when requests go through the proxy).

    Replicas bind the Serve HTTP host (loopback here) while the target lists the node's IP,
    so the URL uses loopback with the published port.
    """
    urls = []
    for group in details.get("target_groups", []):
        if group.get("protocol") != "HTTP" or group.get("app_name") != APP_NAME:
            continue
        for t in group.get("targets", []):
            if t["port"] != proxy_port:
                urls.append(f"http://127.0.0.1:{t['port']}")
    return urls


def serve_in_actor(config: dict[str, Any], port: int,
                   num_cpus: float) -> tuple[dict[str, Any], Any]:
    """``_baseline_servers.engine_app(config)`` served by uvicorn on ``port`` from inside a
    plain Ray actor given ``num_cpus``; returns what ``main`` prints, and the actor (which
    serves as long as its handle is held)."""
    import os

    import ray

    bench = os.path.dirname(os.path.abspath(__file__))

    @ray.remote
    class EngineServer:
        async def start(self) -> int:
            import asyncio
            import sys

            import uvicorn

            sys.path.insert(0, bench)
            from _baseline_servers import engine_app

            server = uvicorn.Server(uvicorn.Config(engine_app(config), host="127.0.0.1",
                                                   port=port, log_level="warning",
                                                   access_log=False))
            self.task = asyncio.get_running_loop().create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.1)
            return os.getpid()

    actor = EngineServer.options(num_cpus=num_cpus).remote()
    pid = ray.get(actor.start.remote())
    return {"proxy_url": f"http://127.0.0.1:{port}", "direct_urls": [],
            "replica_pids": {"EngineServer": [pid]}, "ray_version": ray.__version__}, actor


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="Serve proxy HTTP port")
    p.add_argument("--config", default="{}", help="clawray config as JSON")
    p.add_argument("--num-cpus", type=int, default=4, help="logical CPUs of the Ray node")
    p.add_argument("--expect-direct", action="store_true",
                   help="wait until the ingress replica's own HTTP port is published")
    p.add_argument("--actor", action="store_true",
                   help="no Serve: a plain Ray actor serves clawray's code on --port")
    args = p.parse_args(argv)

    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from clawray.config import ClawRayConfig
    from clawray.serve.app import build_app

    from clawray.apps.launch import init_local_ray

    init_local_ray(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                   logging_level=logging.WARNING)
    try:
        if args.actor:
            config = json.loads(args.config)
            info, _actor = serve_in_actor(config, args.port, config["serving"]["replica_num_cpus"])
            print(json.dumps(info), flush=True)
            sys.stdin.read()  # the actor serves while _actor is held
            return
        serve.start(http_options={"host": "127.0.0.1", "port": args.port},
                    logging_config=QUIET_LOGGING)
        serve.run(build_app(ClawRayConfig.from_dict(json.loads(args.config))), name=APP_NAME,
                  route_prefix="/", logging_config=QUIET_LOGGING)
        client = _get_global_client()
        deadline = time.time() + 120
        while True:
            details = client.get_serve_details()
            direct = direct_ingress_urls(details, args.port)
            if direct or not args.expect_direct or time.time() > deadline:
                break
            time.sleep(0.5)
        info = {"proxy_url": f"http://127.0.0.1:{args.port}", "direct_urls": direct,
                "replica_pids": replica_info(details),
                "ray_version": ray.__version__}
        print(json.dumps(info), flush=True)
        sys.stdin.read()  # serve until the benchmark closes our stdin
    finally:
        # The cluster is ours alone: stopping Ray stops every replica at once, without the
        # 30 s drain that serve.shutdown() grants direct-ingress replicas.
        ray.shutdown()


if __name__ == "__main__":
    main()
