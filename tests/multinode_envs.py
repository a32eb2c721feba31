"""Run as a script by test_env_multinode_on_cpu.py: a simulated 2-node cluster
(``ray.cluster_utils.Cluster``, 2 CPUs each), a Serve app on the embedded tiny model and an
``EnvRunnerGroup`` of 2 runners (``SPREAD``), each playing one GRPO group. Prints one JSON line:
the nodes of the cluster and of the runners, groups, episodes, steps and rows (counted by the
runners and read back from the env buffer's WAL). Arguments: a timeout in seconds for the
groups (default 180) and ``runner_num_cpus`` (default 0.25; with 0, Ray places zero-resource
actors on a random node, SPREAD or not, so the runners often share one). A separate process,
because a test session shares one Ray cluster and this one needs its own."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time

APP = "envs-multinode"
RUNNERS = 2
GROUP_SIZE = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(timeout_s: float, runner_num_cpus: float = 0.25) -> None:
    import pyarrow.dataset as ds
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from clawray.config import ClawRayConfig
    from clawray.envs.runner import EnvRunnerGroup
    from clawray.serve.app import build_app

    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    tmp = tempfile.mkdtemp(prefix="clawray-envs-multinode-")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    group = None
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", namespace="clawray-envs-multinode")
        # One HTTP proxy (on the head): both simulated nodes share 127.0.0.1.
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": free_port()},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        cfg = (ClawRayConfig()
               .serving(record_sink=["none"], replica_num_cpus=0.5)
               .buffer(path=f"{tmp}/samples", seal_age_s=0.1)
               .environments(family="household", num_runners=RUNNERS,
                             runner_num_cpus=runner_num_cpus, concurrency=1,
                             group_size=GROUP_SIZE, max_tokens=8, seed=3, history_window=0)
               .curriculum(sampler="uniform"))
        serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
        started = time.perf_counter()
        group = EnvRunnerGroup(cfg, APP)
        group.start(max_groups=1)
        deadline = time.time() + timeout_s
        while group.runs and time.time() < deadline:
            group.poll()
            time.sleep(0.2)
        unfinished = len(group.runs)
        stats = group.stats()
        ray.get(group.buffer.flush.remote())
        wal_rows = ds.dataset(f"{tmp}/samples-env", format="parquet").count_rows()
        nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        print(json.dumps({
            "nodes": len(nodes), "runner_nodes": stats["nodes"], "runners": stats["runners"],
            "unfinished": unfinished, "groups": stats["groups"], "episodes": stats["episodes"],
            "steps": stats["steps"], "rows": stats["rows"], "wal_rows": wal_rows,
            "reported": stats["curriculum"]["reported"],
            "runner_restarts": stats["runner_restarts"],
            "expected_groups": RUNNERS, "group_size": GROUP_SIZE,
            "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    finally:
        if group is not None:
            try:
                group.shutdown()
            except Exception as e:  # noqa: BLE001 - cleanup goes on
                print(f"group shutdown failed: {e!r}", file=sys.stderr)
        # ray.shutdown() ends Serve's actors with the cluster (serve.shutdown() would first
        # drain for ~30 s); the Cluster then stops both nodes' raylets and the GCS.
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 180.0,
         float(sys.argv[2]) if len(sys.argv) > 2 else 0.25)
