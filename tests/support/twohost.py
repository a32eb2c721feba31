"""Two real hosts on one machine, run by tests/cpu/cluster/test_two_hosts_on_cpu.py.

Two network namespaces joined by a veth pair (addresses assigned inside them only, in
10.213.0.0/16: traffic can go only between the two namespaces the harness made), a Ray head in
one (``ray start --head``, host "a") and a worker in the other (``ray start --address``, host
"b"), each node labelled ``clawray-host=a|b``, with token authentication. Every Ray process of
a host lives in its namespace, so Ray's traffic between the hosts (GCS, object transfers,
gloo) crosses the veth link, and a host can be lost on its own.

``python twohost.py MODEL_PATH [TIMEOUT_S] [--ray-health-defaults] [--resume]`` (the
orchestrator; by default Ray's node health checks are shortened, ``FAST_DETECTION``;
``--resume`` adds ``check_return``, host b coming back, not run by the test) makes the hosts, runs this file again with
``--driver`` inside host a (the driver is a Ray client of the head, as a job would be), prints
the driver's JSON lines (one per check), and then removes everything it made whatever happened:
every process in either namespace, the namespaces (with the link), the Ray temp dir. Each
``ray start`` also runs under ``timeout`` (``BOUND_S``), so nothing outlives a lost harness.

The driver's checks, in order (host b is lost in the last):

- ``hosts``: two alive nodes at the two addresses, labelled a and b; a 16 MB array made on b
  read on a (bytes and seconds);
- ``learner``: one learner rank per host (STRICT_SPREAD, gloo over the link; ZeRO 2, two
  micro-batches) updates like one rank on the same rows (``multinode.check_learner``);
- ``live``: the clawray app (transformers engine, the embedded model) with a replica on each
  host (``placement.policy.max_per_node`` 1), the sample buffer pinned to host a, the learner to
  host b (``placement``): sessions through the Serve proxy, one trainer iteration (rows from the
  buffer on a cross to the rank on b), the weights back to both replicas; the served log-probs
  of a fixed response against the learner's; every row trained once;
- ``envs``: two env runners, one per host (a ``runner_slot`` resource on each), play their
  groups and write every step (``multinode.check_envs``);
- ``host_loss``: streaming requests from 6 clients; host b's link goes down and every process
  of b gets SIGKILL (a host powered off: no connection is closed). Per request: status, error,
  seconds; when Ray declared b dead; what the surviving replica serves; two judged sessions
  after; what the trainer (its rank was on b) says; the turns recorded against the turns
  answered; the buffer's rows once the lost batch's lease ends (added = acknowledged +
  available + leased: none lost).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
BOUND_S = 1500  # no Ray process of the harness runs longer than this
PORT = 6390
API_KEY = "sk-clawray-test"
APP = "twohost"


# Ray's node health checks, for a lost host to be found within the test's time: a check every
# second, failing after 2 s, 10 failures in a row (docs/deploy.md: what users see either way).
FAST_DETECTION = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                  "RAY_health_check_failure_threshold": "10"}


class Hosts:
    """The two namespaces, their link, and a Ray node in each."""

    def __init__(self, fast_detection: bool = True) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns = {"a": f"crh{tag}a", "b": f"crh{tag}b"}
        self.dev = {"a": f"crv{tag}a", "b": f"crv{tag}b"}
        net = 20 + os.getpid() % 200
        self.ip = {"a": f"10.213.{net}.1", "b": f"10.213.{net}.2"}
        self.tmp = tempfile.mkdtemp(prefix="clawray-twohost-")
        self.env = {**os.environ, "RAY_AUTH_MODE": "token",
                    "RAY_AUTH_TOKEN": secrets.token_hex(16),
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                    "RAY_SERVE_LOG_TO_STDERR": "0"}
        self.env.pop("RAY_ADDRESS", None)
        if fast_detection:  # the GCS declared a lost node dead in ~30 s here (Ray's defaults: ~65 s)
            self.env.update(FAST_DETECTION)
        self.ray = str(Path(sys.executable).with_name("ray"))

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def up(self) -> None:
        a, b = self.ns["a"], self.ns["b"]
        self._ip("netns", "add", a)
        self._ip("netns", "add", b)
        self._ip("link", "add", self.dev["a"], "type", "veth", "peer", "name", self.dev["b"])
        for h in ("a", "b"):
            self._ip("link", "set", self.dev[h], "netns", self.ns[h])
            self._ip("-n", self.ns[h], "addr", "add", f"{self.ip[h]}/24", "dev", self.dev[h])
            self._ip("-n", self.ns[h], "link", "set", "lo", "up")
            self._ip("-n", self.ns[h], "link", "set", self.dev[h], "up")

    @property
    def address(self) -> str:
        return f"{self.ip['a']}:{PORT}"

    def start_ray(self, cpus: int = 2) -> None:
        self.cpus = cpus
        head = [self.ray, "start", "--head", f"--node-ip-address={self.ip['a']}",
                f"--port={PORT}", "--include-dashboard=false", "--labels=clawray-host=a",
                '--resources={"host_a": 1, "runner_slot": 1}',
                *node_args(f"{self.tmp}/ray", cpus)]
        worker = worker_argv(self.address, self.ip["b"], f"{self.tmp}/ray", cpus)
        self.logs, self.procs = {}, {}
        for host, argv in (("a", head), ("b", worker)):
            self._start_node(host, argv)

    def _start_node(self, host: str, argv: list[str]) -> None:
        """``ray start`` in ``host``'s namespace until it says it started. On a busy machine
        it can give up waiting for its own node to register (Ray waits 30 s: "timed out
        during startup"): then everything of that host is killed and it starts again, up to
        three times."""
        path = Path(f"{self.tmp}/ray-{host}.log")
        for attempt in range(1, 4):
            started = path.read_text().count("Ray runtime started") if path.exists() else 0
            self.logs[host] = open(path, "a")
            self.procs[host] = self._in(host, argv, self.logs[host])
            deadline = time.monotonic() + 150
            while time.monotonic() < deadline and self.procs[host].poll() is None:
                if path.read_text().count("Ray runtime started") > started:
                    return
                time.sleep(1.0)
            print(f"twohost: host {host}'s `ray start` did not come up (attempt {attempt})",
                  file=sys.stderr, flush=True)
            self._kill_all(host)
        raise RuntimeError(f"host {host} could not start Ray: " + self.log_tail())

    def _in(self, host: str, argv: list[str], log) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.ns[host], "timeout", str(BOUND_S),
                                 *argv], stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                cwd=REPO, start_new_session=True)

    def run_in_a(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """``argv`` in host a under ``timeout``, a driver of this cluster (``RAY_ADDRESS``
        names the head: other Ray instances on the machine are seen too); its stdout goes
        straight to this process's, its stderr is returned."""
        return subprocess.run(["ip", "netns", "exec", self.ns["a"], "timeout",
                               str(int(timeout_s)), *argv],
                              env={**self.env, "RAY_ADDRESS": self.address}, cwd=REPO,
                              stdout=None, stderr=subprocess.PIPE, text=True)

    def driver_argv(self, model_path: str, resume: bool = False) -> list[str]:
        """This file's checks as the driver (``drive``)."""
        return [sys.executable, __file__, "--driver", model_path, self.ns["b"], self.dev["b"],
                self.address, self.tmp, "resume" if resume else ""]

    def _kill_all(self, *hosts: str) -> None:
        """Every process in the namespaces of ``hosts``: SIGTERM, then SIGKILL."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for h in hosts:
                pids = subprocess.run(["ip", "netns", "pids", self.ns[h]], capture_output=True,
                                      text=True).stdout.split()
                for pid in pids:
                    try:
                        os.kill(int(pid), sig)
                    except (ProcessLookupError, ValueError):
                        pass
            time.sleep(3.0 if sig == signal.SIGTERM else 0.5)

    def down(self) -> None:
        """Every process in either namespace, then the namespaces and the link, then the
        temp dir; each step whatever the one before did."""
        self._kill_all("a", "b")
        for p in getattr(self, "procs", {}).values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.dev["a"]], capture_output=True)
        for f in getattr(self, "logs", {}).values():
            f.close()

    def log_tail(self, chars: int = 2000) -> str:
        """The end of each host's ``ray start`` output and of its raylet's log."""
        out = []
        for h in ("a", "b"):
            p = Path(f"{self.tmp}/ray-{h}.log")
            if p.exists():
                out.append(f"--- ray start, host {h}:\n{p.read_text()[-chars:]}")
        for p in sorted(Path(f"{self.tmp}/ray").glob("session_*/logs/raylet*.out")):
            out.append(f"--- {p.name}:\n{p.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)


def node_args(temp_dir: str, cpus: int) -> list[str]:
    """The ``ray start`` options both hosts' nodes share."""
    return ["--block", "--disable-usage-stats", f"--num-cpus={cpus}", f"--temp-dir={temp_dir}",
            "--object-store-memory=400000000"]


def worker_argv(address: str, ip_b: str, temp_dir: str, cpus: int) -> list[str]:
    """``ray start`` of host b's node, joining the head at ``address``."""
    return [str(Path(sys.executable).with_name("ray")), "start", f"--address={address}",
            f"--node-ip-address={ip_b}", "--labels=clawray-host=b",
            '--resources={"host_b": 1, "runner_slot": 1}', *node_args(temp_dir, cpus)]


def lose_host(ns: str, dev: str) -> None:
    """A host powered off: its link goes down, then every process in its namespace gets
    SIGKILL (no connection is closed, nothing is told)."""
    subprocess.run(["ip", "-n", ns, "link", "set", dev, "down"], check=True, timeout=30)
    for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                              text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def rejoin_host(ns: str, dev: str, address: str, temp_dir: str, log_path: str,
                cpus: int = 2) -> subprocess.Popen:
    """Host b back: its link up and ``ray start`` again (under ``timeout``, like the first)."""
    subprocess.run(["ip", "-n", ns, "link", "set", dev, "up"], check=True, timeout=30)
    ip_b = address.split(":")[0].rsplit(".", 1)[0] + ".2"
    log = open(log_path, "a")
    return subprocess.Popen(["ip", "netns", "exec", ns, "timeout", str(BOUND_S),
                             *worker_argv(address, ip_b, temp_dir, cpus)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def actors_on(label: str) -> list[str]:
    """The classes of the alive actors on host ``label`` (read from the GCS: the harness runs
    no dashboard)."""
    import ray
    from ray._private.state import actors

    nodes = {n["NodeID"] for n in ray.nodes() if n["Labels"].get("clawray-host") == label}
    return sorted(a["ActorClassName"] for a in actors().values()
                  if a["State"] == "ALIVE" and a["Address"]["NodeID"] in nodes)


def host_alive(label: str = "b") -> bool:
    """Whether Ray counts a node of host ``label`` alive."""
    import ray

    return any(n["Alive"] and n["Labels"].get("clawray-host") == label for n in ray.nodes())


def run_on_hosts(argv_of: Callable[["Hosts"], list[str]], timeout_s: float,
                 fast_detection: bool = True, cpus: int = 2) -> int:
    """Make the hosts, run ``argv_of(hosts)`` as a driver in host a (``Hosts.run_in_a``), then
    remove everything the hosts were, whatever happened; the driver's exit status."""
    hosts = Hosts(fast_detection)
    # SIGTERM (a stopped test run) ends the harness through its cleanup below
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        hosts.up()
        hosts.start_ray(cpus)
        sys.stdout.flush()
        run = hosts.run_in_a(argv_of(hosts), timeout_s)
        sys.stderr.write(run.stderr[-6000:])
        if run.returncode:
            sys.stderr.write(hosts.log_tail())
        return run.returncode
    finally:
        hosts.down()
        shutil.rmtree(hosts.tmp, ignore_errors=True)


def orchestrate(model_path: str, timeout_s: float, fast_detection: bool = True,
                resume: bool = False) -> int:
    return run_on_hosts(lambda h: h.driver_argv(model_path, resume), timeout_s, fast_detection)


# ------------------------------------------------------------------------- the driver (host a)

def check_hosts() -> dict:
    import numpy as np
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    on_b = [n for n in nodes if n["Labels"].get("clawray-host") == "b"]

    @ray.remote(num_cpus=0)
    def make() -> "np.ndarray":
        return np.arange(4_000_000, dtype=np.float32)

    started = time.perf_counter()
    ref = make.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        on_b[0]["NodeID"], soft=False)).remote()
    arr = ray.get(ref)
    return {"check": "hosts", "nodes": {n["Labels"].get("clawray-host"): n["NodeManagerAddress"]
                                        for n in nodes},
            "array_ok": bool(arr[-1] == 4_000_000 - 1 and arr.size == 4_000_000),
            "bytes": int(arr.nbytes), "seconds": round(time.perf_counter() - started, 3),
            "driver_ip": ray.util.get_node_ip_address()}


def actor_hosts(class_part: str) -> list[str]:
    """The hosts of the alive actors whose class name contains ``class_part`` (read from the
    GCS: the harness runs no dashboard)."""
    import ray
    from ray._private.state import actors

    host_of = {n["NodeID"]: n["Labels"].get("clawray-host") for n in ray.nodes()}
    return sorted(host_of.get(a["Address"]["NodeID"], "?") for a in actors().values()
                  if a["State"] == "ALIVE" and class_part in a["ActorClassName"])


def _session(client, sid: str, good: bool, turns: int = 2, max_tokens: int = 8) -> int:
    msgs = [{"role": "user", "content": "hello there"}]
    for t in range(turns):
        last = t == turns - 1
        r = client.chat.completions.create(
            model="clawray-tiny", messages=msgs, max_tokens=max_tokens,
            extra_headers={"X-Session-Id": sid, **({"X-Session-Done": "1"} if last else {})})
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Thanks, perfect." if good
                  else "That's wrong, try again."}]
    return turns


def live_config(tmp: str):
    from clawray.config import ClawRayConfig

    return (ClawRayConfig()
            .inference(engine="hf")
            .serving(api_keys=[API_KEY], record_sink=["jsonl", "hub"],
                     records_path=f"{tmp}/turns.jsonl", default_max_tokens=8,
                     ingress_replicas=2, replica_num_cpus=0.5)
            .sessions(idle_timeout_s=120, feedback_window_s=0, flush_interval_s=0.1)
            .judge(num_voters=1, timeout_s=30)
            .buffer(path=f"{tmp}/samples", seal_age_s=0.1, lease_s=30)
            .training(app=APP, batch_size=64, min_batch=2, take_timeout_s=8, lr=2e-3,
                      learner_num_cpus=0.5, checkpoint_dir=f"{tmp}/ckpt", sync_timeout_s=120)
            .placement(policy={"max_per_node": 1}, buffer={"labels": {"clawray-host": "a"}},
                       learner={"labels": {"clawray-host": "b"}}))


def check_live(tmp: str, port: int) -> tuple[dict, object, object]:
    """The live loop across the hosts; returns its line, the trainer and the config."""
    import openai
    import pyarrow as pa
    import ray
    from ray import serve

    from clawray.models.loader import load_tokenizer, policy_model_info
    from clawray.samples import make_row, rows_to_batch
    from clawray.serve.app import build_app
    from clawray.training.trainer import Trainer

    cfg = live_config(tmp)
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{APP}/v1", api_key=API_KEY,
                           max_retries=0, timeout=120)
    replica_hosts = actor_hosts("ServeReplica:twohost:Ingress")
    trainer = Trainer(config=cfg.to_dict())
    turns = sum(_session(client, f"s-{i}", good=i % 2 == 0) for i in range(6))
    results, deadline = [], time.monotonic() + 120
    while time.monotonic() < deadline:  # every judged turn of the sessions is trained
        r = trainer.train()
        results.append({k: r.get(k) for k in ("samples", "samples_repeated", "policy_version",
                                               "sync_bytes", "loss")})
        if sum(x["samples"] or 0 for x in results) >= turns:
            break
    r = trainer.train()  # nothing is left: the rows were trained once
    results.append({k: r.get(k) for k in ("samples", "samples_repeated", "policy_version")})
    buffer_stats = ray.get(trainer.pipeline.buffer.stats.remote())
    handle = serve.get_app_handle(APP)
    versions = handle.weights_version.remote().result()
    tok = load_tokenizer(policy_model_info(cfg).path)
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "hi there"}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False))
    response = tok.encode("OK, I understand.", add_special_tokens=False)
    row = make_row(sample_id="probe", kind="rl", source="live", prompt_ids=prompt,
                   response_ids=response, rollout_logprobs=[0.0] * len(response),
                   policy_version=trainer.version, loss_mask=[1] * len(response), reward=0.0)
    learner_lp = trainer.learner.logprobs(pa.Table.from_batches([rows_to_batch([row])]))[0]
    served = [handle.prompt_logprobs.remote(prompt, response).result() for _ in range(16)]
    trainer.save_checkpoint(f"{tmp}/saved")  # where a restarted job resumes (--resume)
    diff = max(max(abs(a - b) for a, b in zip(s, learner_lp)) for s in served)
    return ({"check": "live", "replica_hosts": replica_hosts,
             "buffer_host": actor_hosts("SampleBuffer"),
             "learner_hosts": actor_hosts("LearnerWorker"),
             "turns": turns, "iterations": results, "buffer": {
                 k: buffer_stats.get(k) for k in ("rows_added", "rows_taken", "rows_acked",
                                                  "rows_redelivered", "duplicates",
                                                  "available", "leased_rows")},
             "versions": versions, "max_logprob_diff": diff}, trainer, cfg)


def _sse_error(body: str) -> bool:
    """Whether a streamed body carries an error event (a data line whose JSON has "error")."""
    for line in body.splitlines():
        if line.startswith("data: {"):
            try:
                if "error" in json.loads(line[6:]):
                    return True
            except ValueError:
                return True  # a cut line
    return False


def check_host_loss(trainer, cfg, tmp: str, port: int, ns_b: str, dev_b: str) -> dict:
    """Six clients stream turns; host b is lost under them."""
    import httpx

    url = f"http://127.0.0.1:{port}/{APP}/v1/chat/completions"
    lost_at: list[float] = []
    log: list[dict] = []
    stop = threading.Event()
    lock = threading.Lock()

    def client(k: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            started = time.monotonic()
            entry = {"client": k, "n": n, "start": started}
            try:
                with httpx.stream("POST", url, timeout=httpx.Timeout(150.0), json={
                        "model": "clawray-tiny", "stream": True, "max_tokens": 16,
                        "messages": [{"role": "user", "content": f"hello {k} {n}"}]},
                        headers={"Authorization": f"Bearer {API_KEY}",
                                 "X-Session-Id": f"loss-{k}-{n}", "X-Session-Done": "1"}) as r:
                    entry["status"] = r.status_code
                    body = "".join(r.iter_text())
                    entry["error"] = r.status_code != 200 or _sse_error(body)
                    entry["done"] = "[DONE]" in body
                    if entry["error"]:
                        entry["body"] = body[-300:]
            except Exception as e:  # noqa: BLE001 - what the client saw is the result
                entry.update(status=None, error=True, done=False, body=repr(e)[:300])
            entry["end"] = time.monotonic()
            with lock:
                log.append(entry)
            time.sleep(0.2)

    import ray

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(10.0)  # steady state on both replicas
    lost_at.append(time.monotonic())
    lose_host(ns_b, dev_b)
    # Ray's own health checks (its defaults) find the node dead; then 10 s more of load
    declared = None
    while time.monotonic() - lost_at[0] < 180:
        if declared is None and not host_alive("b"):
            declared = time.monotonic()
        if declared is not None and time.monotonic() - declared > 10:
            break
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(timeout=160)
    t0 = lost_at[0]
    before = [e for e in log if e["end"] < t0]
    across = [e for e in log if e["start"] < t0 <= e["end"]]
    after = [e for e in log if e["start"] >= t0]
    failed_after = [e for e in after if e["error"]]
    last_fail = max([e["end"] for e in across + after if e["error"]], default=t0)
    typical = sorted(e["end"] - e["start"] for e in before)[len(before) // 2] if before else 0
    stalled = [e for e in across + after if e["end"] - e["start"] > max(10 * typical, 5.0)]
    # judged turns after the loss, through what is left; then the trainer, whose learner rank
    # was on host b, takes them
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{APP}/v1", api_key=API_KEY,
                           max_retries=0, timeout=120)
    try:
        sessions_after = sum(_session(client, f"after-{i}", good=True) for i in range(2))
    except Exception as e:  # noqa: BLE001
        sessions_after = f"{type(e).__name__}: {str(e)[:300]}"
    started = time.monotonic()
    try:
        r = trainer.train()
        trainer_said = {"ok": True, "samples": r.get("samples")}
    except Exception as e:  # noqa: BLE001 - the message is the result
        trainer_said = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
    trainer_said["seconds"] = round(time.monotonic() - started, 1)
    # the batch the lost rank was training was not acknowledged: once its lease ends the
    # buffer (on host a) offers it again; no row is lost
    deadline = time.monotonic() + 90
    while True:
        st = ray.get(trainer.pipeline.buffer.stats.remote())
        if st["leased_rows"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    rows = {k: st[k] for k in ("rows_added", "rows_taken", "rows_acked", "leases_expired",
                               "available", "leased_rows")}
    rows["lost"] = rows["rows_added"] - rows["rows_acked"] - rows["available"] \
        - rows["leased_rows"]
    answered = sum(1 for e in log if not e["error"] and e.get("done"))
    recorded = 0
    if Path(f"{tmp}/turns.jsonl").exists():
        recorded = sum(1 for line in Path(f"{tmp}/turns.jsonl").read_text().splitlines()
                       if "loss-" in line)

    def brief(e: dict) -> dict:
        return {"status": e.get("status"), "error": e["error"], "done": e.get("done"),
                "start": round(e["start"] - t0, 1), "seconds": round(e["end"] - e["start"], 1),
                **({"body": e["body"]} if e.get("body") else {})}

    return {"check": "host_loss", "requests": len(log), "before": len(before),
            "before_failed": sum(e["error"] for e in before),
            "in_flight": [brief(e) for e in across],
            "after": len(after), "after_failed": len(failed_after),
            "after_failed_first": [brief(e) for e in failed_after[:4]],
            "declared_dead_s": None if declared is None else round(declared - t0, 1),
            "after_ok_once_declared": sum(1 for e in after if not e["error"] and declared
                                          and e["start"] > declared),
            "typical_s": round(typical, 2), "stalled": len(stalled),
            "stalled_until_s": round(max([e["end"] for e in stalled], default=t0) - t0, 1),
            "last_failure_s": round(last_fail - t0, 1), "longest_s": round(max(
                e["end"] - e["start"] for e in log), 1),
            "unfinished_clients": sum(t.is_alive() for t in threads),
            "answered": answered, "recorded": recorded, "turns_after": sessions_after,
            "rows": rows,
            "trainer": trainer_said,
            "replica_hosts_after": actor_hosts("ServeReplica:twohost:Ingress")}


def check_return(cfg, tmp: str, ns_b: str, dev_b: str, address: str) -> dict:
    """Host b comes back (its link up, ``ray start`` again); the training job is restarted
    from its checkpoint, as a Ray job with retries would be: its learner rank goes to b again,
    it trains the rows the lost batch left (redelivered after their lease), and both replicas
    serve its next version."""
    import ray
    from ray import serve

    from clawray.training.trainer import Trainer

    started = time.monotonic()
    rejoin_host(ns_b, dev_b, address, f"{tmp}/ray", f"{tmp}/ray-b-again.log")
    while not host_alive("b"):
        if time.monotonic() - started > 180:
            raise RuntimeError("host b did not join again in 180 s")
        time.sleep(1.0)
    joined = time.monotonic() - started
    fresh = Trainer(config=cfg.to_dict())
    fresh.restore(f"{tmp}/saved")
    version_restored = fresh.version
    results = []
    for _ in range(6):
        r = fresh.train()
        results.append({k: r.get(k) for k in ("samples", "samples_repeated", "policy_version")})
        st = ray.get(fresh.pipeline.buffer.stats.remote())
        if st["available"] == 0 and st["leased_rows"] == 0:
            break
    handle = serve.get_app_handle(APP)
    deadline = time.monotonic() + 180  # Serve places the missing replica on b again
    while time.monotonic() < deadline:
        versions = handle.weights_version.remote().result()
        if len(versions["replicas"]) == 2 and set(versions["replicas"].values()) == {
                versions["published"]}:
            break
        time.sleep(2.0)
    st = ray.get(fresh.pipeline.buffer.stats.remote())
    return {"check": "return", "joined_s": round(joined, 1),
            "learner_hosts": actor_hosts("LearnerWorker"), "version_restored": version_restored,
            "iterations": results, "versions": versions,
            "replica_hosts": actor_hosts("ServeReplica:twohost:Ingress"),
            "rows": {k: st[k] for k in ("rows_added", "rows_acked", "rows_redelivered",
                                        "available", "leased_rows")},
            "seconds": round(time.monotonic() - started, 1)}


def drive(model_path: str, ns_b: str, dev_b: str, address: str, tmp: str,
          resume: str = "") -> None:
    import ray
    from ray import serve

    sys.path.insert(0, str(REPO))
    from tests.support import multinode

    ray.init(address=address, log_to_driver=False, logging_level="WARNING",
             namespace="clawray-twohost")
    deadline = time.monotonic() + 180
    while len([n for n in ray.nodes() if n["Alive"]]) < 2 and time.monotonic() < deadline:
        time.sleep(1.0)
    alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    if len(alive) < 2:
        print(f"host b did not join the cluster in 180 s: alive nodes {alive}",
              file=sys.stderr, flush=True)
        os._exit(2)
    port = multinode.free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
                logging_config={"log_level": "WARNING", "enable_access_log": False})
    multinode.start_serve.port = port  # check_envs shares this Serve instance
    trainer = cfg = None

    def live() -> dict:
        nonlocal trainer, cfg
        line, trainer, cfg = check_live(tmp, port)
        return line

    failed = 0
    for check in (check_hosts, lambda: multinode.check_learner(model_path), live,
                  # one runner slot per host: the two runners run one on each
                  lambda: multinode.check_envs(tmp, 180.0, 0.25, placement={
                      "env_runners": {"resources": {"runner_slot": 1}}}),
                  lambda: check_host_loss(trainer, cfg, tmp, port, ns_b, dev_b),
                  *([lambda: check_return(cfg, tmp, ns_b, dev_b, address)] if resume else [])):
        try:
            print(json.dumps(check()), flush=True)
        except Exception as e:  # noqa: BLE001 - reported, then the next check runs
            import traceback
            failed += 1
            print(f"check failed: {e!r}\n{traceback.format_exc()[-2000:]}", file=sys.stderr,
                  flush=True)
    os._exit(1 if failed else 0)  # host b is gone: ray.shutdown() would wait on it


if __name__ == "__main__":
    if sys.argv[1] == "--driver":
        drive(*sys.argv[2:8])
    else:  # MODEL_PATH [TIMEOUT_S] [--ray-health-defaults] [--resume]
        args = [a for a in sys.argv[1:] if not a.startswith("--")]
        sys.exit(orchestrate(args[0], float(args[1]) if len(args) > 1 else 1200,
                             fast_detection="--ray-health-defaults" not in sys.argv,
                             resume="--resume" in sys.argv))
