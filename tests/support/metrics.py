"""The Prometheus series of the test's Ray cluster (its node's metrics endpoint) and the
series the operator's Grafana dashboard (deployments/grafana/clawray.json) queries."""

from __future__ import annotations

import json
import re
import time
import urllib.request

from tests.support.common import REPO

DASHBOARD = REPO / "deployments" / "grafana" / "clawray.json"
SERIES = re.compile(r"\bray_clawray_\w+")


def dashboard_series() -> set[str]:
    """Every ``ray_clawray_*`` series a panel's query reads."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return {name for p in panels for t in p.get("targets", [])
            for name in SERIES.findall(t["expr"])}


def scrape() -> set[str]:
    """The series names the local Ray node exports now."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split("{", 1)[0].split(" ", 1)[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def wait_for_series(wanted: set[str], timeout_s: float = 60.0) -> set[str]:
    """The wanted series still missing once they all appear or ``timeout_s`` passes (Ray
    exports metrics every few seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = wanted - scrape()
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(2.0)
