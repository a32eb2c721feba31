"""Run as a script by test_multinode_on_cpu.py: one simulated 2-node cluster
(``ray.cluster_utils.Cluster``, 2 CPUs per node) for the two multi-node checks, one JSON line each:

- ``learner``: one learner rank per node (STRICT_SPREAD) gives the same update as one rank on the
  same data;
- ``envs``: a Serve app on the embedded tiny model and an ``EnvRunnerGroup`` of 2 runners
  (SPREAD), each playing one GRPO group; the nodes of the cluster and of the runners, groups,
  episodes, steps and rows (counted by the runners and read back from the env buffer's WAL).

Arguments: a timeout in seconds for the groups (default 180) and ``runner_num_cpus`` (default
0.25; with 0, Ray places zero-resource actors on a random node, SPREAD or not, so the runners
often share one). A separate process, because a test session shares one Ray cluster and this
one needs its own; one cluster for both checks, because starting one costs ~15 s of the suite.
"""

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


def check_learner(model_path: str) -> dict:
    import ray

    from clawray.config import TrainingConfig
    from clawray.learner.group import LearnerGroup
    from tests.support.learner_data import sampled_rows
    from tests.support.weights_compare import update_distance

    table = sampled_rows(model_path, 8, seed=5, max_new=10)
    payloads, nodes = {}, {}
    for n, strategy in ((1, "PACK"), (2, "STRICT_SPREAD")):
        cfg = TrainingConfig(lr=1e-3, zero_stage=1, num_learners=n, learner_num_cpus=1,
                             placement_strategy=strategy)
        group = LearnerGroup(model_path, cfg, setup_timeout_s=120)
        try:
            nodes[n] = sorted(set(ray.get([w.node_id.remote() for w in group.workers])))
            group.update(table)
            payloads[n] = group.sync_payload()[1]
        finally:
            group.shutdown()
    return {"check": "learner", "nodes": len(ray.nodes()), "rank_nodes": len(nodes[2]),
            **update_distance(model_path, payloads[1], payloads[2])}


def check_envs(tmp: str, timeout_s: float, runner_num_cpus: float) -> dict:
    import pyarrow.dataset as ds
    import ray
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.rollout.runner import EnvRunnerGroup
    from clawray.serve.app import build_app

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
    try:
        group.start(max_groups=1)
        deadline = time.time() + timeout_s
        while group.runs and time.time() < deadline:
            group.poll()
            time.sleep(0.2)
        unfinished = len(group.runs)
        stats = group.stats()
        ray.get(group.buffer.flush.remote())
        wal_rows = ds.dataset(f"{tmp}/samples-env", format="parquet").count_rows()
    finally:
        try:
            group.shutdown()
        except Exception as e:  # noqa: BLE001 - cleanup goes on
            print(f"group shutdown failed: {e!r}", file=sys.stderr)
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return {"check": "envs", "nodes": len(nodes), "runner_nodes": stats["nodes"],
            "runners": stats["runners"], "unfinished": unfinished, "groups": stats["groups"],
            "episodes": stats["episodes"], "steps": stats["steps"], "rows": stats["rows"],
            "wal_rows": wal_rows, "reported": stats["curriculum"]["reported"],
            "runner_restarts": stats["runner_restarts"], "expected_groups": RUNNERS,
            "group_size": GROUP_SIZE, "seconds": round(time.perf_counter() - started, 1)}


def main(model_path: str, timeout_s: float, runner_num_cpus: float) -> None:
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    tmp = tempfile.mkdtemp(prefix="clawray-multinode-")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", namespace="clawray-multinode")
        # Each check prints its line as soon as it is done, so one failing leaves the other.
        for check in (lambda: check_learner(model_path),
                      lambda: check_envs(tmp, timeout_s, runner_num_cpus)):
            try:
                print(json.dumps(check()), flush=True)
            except Exception as e:  # noqa: BLE001 - reported, then the next check runs
                print(f"check failed: {e!r}", file=sys.stderr, flush=True)
    finally:
        # ray.shutdown() ends Serve's actors with the cluster (serve.shutdown() would first
        # drain for ~30 s); the Cluster then stops both nodes' raylets and the GCS.
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 180.0,
         float(sys.argv[3]) if len(sys.argv) > 3 else 0.25)
