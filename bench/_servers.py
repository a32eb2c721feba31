"""Server processes of ``bench/serving.py``: start them, find their URLs, stop them.

Each server runs in a session of its own (``start_new_session``), so that stopping it can end
the whole process group it started (a Ray host's raylet, GCS and workers included) by its id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

BENCH = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Servers:
    """The processes of one group, the URLs they serve, and the pids to account CPU to."""

    procs: list[subprocess.Popen] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)
    profile_pids: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def tree(self) -> list[psutil.Process]:
        out = []
        for p in self.procs:
            try:
                root = psutil.Process(p.pid)
                out += [root] + root.children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        return out


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None,
          stdin: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=subprocess.PIPE if stdin else log.open("ab"),
                            stderr=log.open("ab"), stdin=stdin, start_new_session=True,
                            env={**os.environ, **(env or {})}, cwd=BENCH.parent)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: Path,
                 path: str = "/healthz") -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s; see {log}")


def start_peer(config: dict[str, Any], logdir: Path) -> Servers:
    """(b): the engine server, then the proxy in front of it, each its own process."""
    engine_port, proxy_port = free_port(), free_port()
    script = str(BENCH / "_baseline_servers.py")
    log = logdir / "peer.log"
    engine = spawn([sys.executable, script, "engine", "--port", str(engine_port),
                    "--config", json.dumps(config)], log)
    engine_url = f"http://127.0.0.1:{engine_port}"
    proxy = spawn([sys.executable, script, "proxy", "--port", str(proxy_port),
                   "--upstream", engine_url], log)
    servers = Servers([engine, proxy], {"engine": engine_url,
                                        "proxy": f"http://127.0.0.1:{proxy_port}"},
                      {"engine": engine.pid, "proxy": proxy.pid})
    try:
        wait_healthy(engine_url, engine, 180, log)
        wait_healthy(servers.urls["proxy"], proxy, 60, log)
    except BaseException:
        stop(servers)
        raise
    return servers


def start_ray(name: str, env: dict[str, str], config: dict[str, Any], logdir: Path,
              actor: bool = False) -> Servers:
    """clawray's Serve app on a fresh Ray cluster whose processes start with ``env`` (with
    ``actor``, clawray's code in a plain Ray actor instead, without Serve)."""
    env = {**env, "RAY_SERVE_LOG_TO_STDERR": "0"}
    direct = any(env.get(k) == "1" for k in ("RAY_SERVE_ENABLE_DIRECT_INGRESS",
                                             "RAY_SERVE_THROUGHPUT_OPTIMIZED"))
    cmd = [sys.executable, str(BENCH / "_ray_server.py"), "--port", str(free_port()),
           "--config", json.dumps(config)] + (["--expect-direct"] if direct else []) + (
               ["--actor"] if actor else [])
    log = logdir / f"{name}.log"
    proc = spawn(cmd, log, env, stdin=subprocess.PIPE)
    servers = Servers([proc])
    try:
        line = proc.stdout.readline() if proc.stdout else b""
        if not line:
            raise RuntimeError(f"Ray server for {name} exited before serving; see {log}")
        info = json.loads(line)
        servers.urls["proxy"] = info["proxy_url"]
        if info["direct_urls"]:
            servers.urls["direct"] = info["direct_urls"][0]
        elif direct:
            raise RuntimeError(f"{name}: direct ingress was asked for but no replica port "
                               f"appeared; see {log}")
        servers.profile_pids = {deployment.lower(): pids[0]
                                for deployment, pids in info["replica_pids"].items() if pids}
        for p in servers.tree():  # the Serve proxy actor (its pid is not in Serve's details)
            try:
                if p.cmdline()[:1] == ["ray::ProxyActor"]:
                    servers.profile_pids["serve-proxy"] = p.pid
            except psutil.Error:
                pass
        servers.info = {"ray_env": env, "layout": config["serving"]["layout"], **info}
        wait_healthy(servers.urls.get("direct", servers.urls["proxy"]), proc, 60, log)
    except BaseException:
        stop(servers)
        raise
    return servers


def stop(servers: Servers) -> None:
    """Stop every process of ``servers``; a Ray host stops its cluster when its stdin closes."""
    for p in servers.procs:
        if p.stdin:
            p.stdin.close()
        else:
            p.terminate()
    for p in servers.procs:
        try:
            p.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the session we started for this server
            p.wait()
