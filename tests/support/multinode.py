"""Run as a script by test_multinode_on_cpu.py: a simulated cluster
(``ray.cluster_utils.Cluster``) for the node-kill check, one JSON line:

- ``node_kill``: a node joins; a clawray app whose replica is pinned to it
  (``serving.replica_resources``) serves a turn with vLLM; the node is then killed abruptly
  (SIGKILL to the replica's worker and, ``remove_node(allow_graceful=False)``, its raylet). The
  pids of the replica, its engine processes (``VLLM::EngineCore`` and the helpers it started)
  and their watchdog
  (clawray/inference/watchdog.py), and which of them still run 120 s later at most. Before the
  watchdog, the engine processes stayed alive under init, ~3 GB a pair, for as long as the
  machine ran.

``check_learner`` (learner ranks on two nodes update like one) and ``check_envs`` (runners on
two nodes play and write their groups) run on two real hosts instead
(tests/support/twohost.py); they used to run here.

A separate process, because a test session shares one Ray cluster and this one needs its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
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

    table = sampled_rows(model_path, 10, seed=7, max_new=10)
    payloads, nodes, metrics = {}, {}, {}
    for n, strategy in ((1, "PACK"), (2, "STRICT_SPREAD")):
        # ZeRO 2 and two micro-batches per rank: gradients reduced across nodes, accumulated
        # within a rank
        cfg = TrainingConfig(lr=1e-3, zero_stage=2, micro_batches=2, num_learners=n,
                             learner_num_cpus=1, placement_strategy=strategy)
        group = LearnerGroup(model_path, cfg, setup_timeout_s=120)
        try:
            nodes[n] = sorted(set(ray.get([w.node_id.remote() for w in group.workers])))
            metrics[n] = group.update(table)
            payloads[n] = group.sync_payload()[1]
        finally:
            group.shutdown()
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return {"check": "learner", "nodes": len(ray.nodes()), "rank_nodes": len(nodes[2]),
            "rank_addresses": sorted(address.get(n, "?") for n in nodes[2]),
            "rows": table.num_rows, "metrics": {n: {k: metrics[n][k] for k in
                                                    ("loss", "tokens", "rows")} for n in (1, 2)},
            **update_distance(model_path, payloads[1], payloads[2])}


def check_envs(tmp: str, timeout_s: float, runner_num_cpus: float,
               placement: dict | None = None) -> dict:
    import pyarrow.dataset as ds
    import ray
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.rollout.runner import EnvRunnerGroup
    from clawray.serve.app import build_app

    start_serve()
    cfg = (ClawRayConfig().inference(engine="hf")
           .serving(record_sink=["none"], replica_num_cpus=0.5)
           .buffer(path=f"{tmp}/samples", seal_age_s=0.1)
           .environments(family="household", num_runners=RUNNERS,
                         runner_num_cpus=runner_num_cpus, concurrency=1,
                         group_size=GROUP_SIZE, max_tokens=8, seed=3, history_window=0)
           .curriculum(sampler="uniform")
           .placement(**(placement or {})))
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


def start_serve() -> int:
    """Serve on the cluster, its one HTTP proxy on the head (all simulated nodes share
    127.0.0.1); its port."""
    from ray import serve

    if not hasattr(start_serve, "port"):
        start_serve.port = free_port()
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": start_serve.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
    return start_serve.port


def _running(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _family(owner: int) -> list:
    """``owner``'s descendants, and every watchdog that names ``owner`` as its owner with the
    processes it watches and their descendants (found by command line, not by parentage)."""
    import psutil

    found = {}
    try:
        found.update({p.pid: p for p in psutil.Process(owner).children(recursive=True)})
    except psutil.Error:
        pass
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        if "clawray.inference.watchdog" in argv and argv[argv.index("--owner") + 1:][:1] == \
                [str(owner)]:
            found[p.pid] = p
            for pid in argv[argv.index("--owner") + 2:]:
                try:
                    watched = psutil.Process(int(pid))
                    found.update({q.pid: q for q in [watched, *watched.children(recursive=True)]})
                except (psutil.Error, ValueError):
                    pass
    return list(found.values())


def check_node_kill(cluster, tmp: str) -> dict:
    import openai
    import psutil
    from ray import serve
    from ray.util.state import list_actors

    from clawray.config import ClawRayConfig
    from clawray.serve.app import build_app

    node = cluster.add_node(num_cpus=1, resources={"doomed": 1})
    cluster.wait_for_nodes()
    port = start_serve()
    cfg = (ClawRayConfig()  # the embedded default, served as "clawray-tiny"
           .inference(engine="vllm", kv_cache_gib=0.25, max_running=4)
           .serving(record_sink=["jsonl"], records_path=f"{tmp}/kill-turns.jsonl",
                    replica_num_cpus=0.5, replica_resources={"doomed": 1}))
    serve.run(build_app(cfg), name="node-kill", route_prefix="/node-kill")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/node-kill/v1", api_key="none",
                           max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="clawray-tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4)

    def title(p) -> str:
        try:
            return " ".join([p.name(), *p.cmdline()])
        except psutil.Error:
            return ""

    # The replica on the node, its engine processes and their watchdog, once all are up. Not
    # read once: on a loaded machine Serve may replace a replica whose health check timed out
    # (the new one has no engine yet), so this waits for one replica whose engine and watchdog
    # run, and records every replica seen on the node.
    seen, deadline = [], time.monotonic() + 180
    while True:
        doomed = [a for a in list_actors(filters=[("node_id", "=", node.node_id),
                                                  ("state", "=", "ALIVE")])
                  if "ServeReplica" in a.class_name]
        replica = doomed[0].pid if len(doomed) == 1 else None
        seen += [a.pid for a in doomed if a.pid not in seen]
        titles = {p.pid: title(p) for p in _family(replica)} if replica else {}
        # The engine's processes are what the replica started besides the watchdog, found by
        # parentage and by the watchdog's own list, not by title: vLLM names them VLLM::…
        # with setproctitle, and one CI run saw them answer under their spawn command line.
        watchdogs = [pid for pid, t in titles.items() if "clawray.inference.watchdog" in t]
        engines = [pid for pid in titles if pid not in watchdogs]
        if (engines and watchdogs) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    # The node dies as under `kill -9` of its process group (or an OOM kill of the node):
    # the replica's worker and the raylet get SIGKILL at once. (The raylet alone is not
    # enough: its workers then exit on their own and shut their engines down.) vLLM's
    # processes are in a process group of their own, so such a kill never reaches them.
    if replica:
        os.kill(replica, signal.SIGKILL)
    cluster.remove_node(node, allow_graceful=False)
    everything = engines + watchdogs + ([replica] if replica else [])
    started = time.monotonic()
    while _running(everything) and time.monotonic() - started < 120:
        time.sleep(0.5)
    left = {"replica": _running([replica] if replica else []),
            "engines": _running(engines), "watchdogs": _running(watchdogs)}
    for pid in sum(left.values(), []):  # leave nothing behind, whatever the outcome
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    return {"check": "node_kill", "answered": reply.choices[0].message is not None,
            "replicas_on_node": len(doomed), "replica": replica, "replicas_seen": seen,
            "engines": engines, "watchdogs": watchdogs, "left": left,
            "seconds_to_clean": round(time.monotonic() - started, 1), "tree": titles}


def main() -> None:
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    tmp = tempfile.mkdtemp(prefix="clawray-multinode-")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
                 logging_level="WARNING", namespace="clawray-multinode")
        try:
            print(json.dumps(check_node_kill(cluster, tmp)), flush=True)
        except Exception as e:  # noqa: BLE001 - reported; the test names what is missing
            print(f"check failed: {e!r}", file=sys.stderr, flush=True)
    finally:
        # ray.shutdown() ends Serve's actors with the cluster (serve.shutdown() would first
        # drain for ~30 s); the Cluster then stops the nodes' raylets and the GCS.
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
