"""Starting the Serve app on local (or joined) Ray, used by ``clawray serve`` and the demo."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from typing import Any

import httpx
import ray
from ray import serve

from clawray.config import ClawRayConfig
from clawray.serve.app import build_app


# What ray.init raises when the node it starts never registers: on a busy machine the raylet
# exits at start-up when its dashboard agent writes its port files late (a fixed wait inside
# the raylet, ray-project/ray#65983; raylet.err says "Timed out waiting for file
# .../metrics_agent_port_..."). Seen once in the suite, a notebook's cluster starting while
# another test's vLLM engine shut down.
_NODE_START_TIMEOUT = "timed out during startup"


def init_local_ray(attempts: int = 3, **kwargs: Any) -> None:
    """``ray.init(address="local", **kwargs)``: a Ray cluster of this process's own, never
    one that is already running. A node that timed out during start-up (see
    ``_NODE_START_TIMEOUT``) is shut down and started again, up to ``attempts`` times in all;
    any other error is raised at once."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception as e:
            if _NODE_START_TIMEOUT not in str(e) or attempt == attempts:
                raise
            logging.getLogger(__name__).warning(
                "Ray's node timed out during start-up (attempt %d of %d); starting it again",
                attempt, attempts)
            ray.shutdown()


CONTROL_LOOP = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"


def serve_env(s: Any) -> dict[str, str]:
    """The Ray Serve environment variables ``serving`` settings ``s`` ask for (read by Ray's
    processes when they start, so set before ``ray.init``); a variable the user set wins."""
    env = {}
    if s.direct_ingress or s.throughput_optimized:
        env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    if s.throughput_optimized:
        env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    if s.control_loop_interval_s is not None:
        env[CONTROL_LOOP] = f"{s.control_loop_interval_s:g}"
    return env


def start_serving(cfg: ClawRayConfig, *, blocking: bool) -> str:
    """Start (or join) local Ray, run the app, return the base URL."""
    s = cfg.serving_cfg
    if not ray.is_initialized():
        # Direct ingress: the ingress replica also serves HTTP on its own port (30000 and up),
        # skipping the Serve proxy hop that costs about half the throughput on a small machine
        # (bench/README.md). Ray reads it when its processes start, so it is set before init.
        env = serve_env(s)
        added = [k for k in env if k not in os.environ]
        for key, value in env.items():
            os.environ.setdefault(key, value)
        ray.init(include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        # Only Serve's controller reads the control loop's interval, and it inherits the
        # raylet's environment: it does not stay in this process's (nor reach the clusters
        # this process starts later, e.g. a test run's).
        if CONTROL_LOOP in added:
            os.environ.pop(CONTROL_LOOP, None)
    serve.start(
        http_options={"host": s.host, "port": s.port},
        logging_config={"log_level": "WARNING", "enable_access_log": False},
    )
    serve.run(build_app(cfg), name="clawray", route_prefix="/", blocking=False)
    handle = serve.get_app_handle("clawray")

    def instances() -> set[str]:
        return {handle.instance_id.remote().result() for _ in range(4 * s.ingress_replicas)}

    # A blocking handle call is refused inside a running event loop (a Jupyter cell): probe
    # from a worker thread there.
    ours = _off_event_loop(instances)
    own: list[str] = []
    if s.replica_http_port is not None:  # colocated only (config.check)
        # replicas serving HTTP themselves (serving.replica_http_port): they say where
        own = sorted(_off_event_loop(lambda: {
            handle.replica_http_url.remote().result() for _ in range(4 * s.ingress_replicas)}
            ) - {None})
        for url in own:
            print(f"clawray: ingress replica serving HTTP itself at {url}/v1", flush=True)
    direct = direct_ingress_urls(s.host, ours)
    for url in direct:
        print(f"clawray: ingress replica serving directly at {url}/v1"
              + ("" if own else " (fastest)"), flush=True)
    direct = own + direct
    if blocking:
        while True:
            time.sleep(3600)
    return (direct[0] if direct else f"http://{s.host}:{s.port}") + "/v1"


def _off_event_loop(fn: Any) -> Any:
    """``fn()``, in a worker thread when this thread runs an asyncio event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def direct_ingress_urls(host: str, instances: set[str], first_port: int = 30000,
                        span: int = 16) -> list[str]:
    """Ports where this app's ingress replicas listen directly, found by /healthz.

    A port answers for us only if its instance id is one of ours: another Ray cluster on the
    same machine may hold ports in the same range."""
    if os.environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS") != "1":
        return []

    urls = []
    for port in range(first_port, first_port + span):
        url = f"http://{host}:{port}"
        try:
            r = httpx.get(url + "/healthz", timeout=0.5)
            if r.status_code == 200 and r.json().get("instance") in instances:
                urls.append(url)
        except (httpx.HTTPError, ValueError):
            continue
    return urls
