"""Chaos soak: live sessions, feedback and training while the parts die one at a time.

    .venv/bin/python bench/chaos.py --quick      # 33 s of chaos (make test-long runs it)
    .venv/bin/python bench/chaos.py              # 5 minutes (docs/reliability.md)
    .venv/bin/python bench/chaos.py --duration-s 600 --users 6 --kill-every-s 15

On loopback only, one local Ray cluster runs a clawray app (two colocated ingress replicas,
the transformers engine, two SessionHubs, two PRM voters, the SampleBuffer) and a live
Trainer (DeepSpeed, checkpoint every 2 iterations) that trains and syncs weights into the
replicas. Simulated clients (the official ``openai`` SDK, streaming, a tool in every request)
run 3-turn sessions and rate some replies through ``/v1/feedback``. A chaos driver kills, one at
a time, in a seeded random order that covers every kind before repeating one: a SessionHub, a
PRM voter, the SampleBuffer, a learner rank, an ingress replica, or the trainer job (it dies
right after taking a batch, before its update; the job is restarted from its last checkpoint,
as a Ray job with retries would be). A killed learner rank or buffer call fails the trainer's
iteration the same way. The run lasts its duration, and longer (up to three times) until every
kind has been killed once, so a slow kill never leaves a kind out.

Reported (``bench/results/chaos.json``, ``.png``; the table is printed):

- requests sent / failed: a client retries a failed or cut request once (``X-Retry: 1``); a
  request fails when its retry fails too; p50/p99 latency of the completed ones
- turns served (completed main turns) against the sample log: lost (a served turn without its
  row), duplicated (a ``sample_id`` twice in the log)
- rows trained, and trained twice: a row trained again by weights that already hold it (a
  restored trainer's lineage starts at its checkpoint, so rows of updates the crash lost are
  retrained, as they must be)
- peak memory (RSS) of each actor class, sampled every 2 s
- every kill, with its time

Goal: 0 lost, 0 duplicated, 0 trained twice, failed requests only those in flight on a replica
at the instant it died.

Two hosts (``--hosts 2``; as root): the same soak on the two-host harness of
``tests/support/twohost.py`` (two network namespaces joined by a veth link, a Ray head in one
and a worker in the other, Ray's node health checks shortened), one ingress replica per host,
the sample buffer on host a. A seventh kind of fault joins the others: **host**, host b lost
(its link down, every process of it SIGKILLed, whatever ran there), back ``--host-down-s``
later (link up, ``ray start`` again). No other kill happens while b is away. Reported per host
loss: the parts that were on b, when Ray declared b dead, when it joined again, when both
ingress replicas served again, the requests that failed or stalled meanwhile.

    .venv/bin/python bench/chaos.py --hosts 2 --out bench/results/chaos_hosts.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
APP = "chaos"
KEY = "sk-chaos-local"
KINDS = ("hub", "voter", "buffer", "learner", "ingress", "trainer")
HOST_KINDS = (*KINDS, "host")  # --hosts 2
TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "List files in a directory.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
REPLIES = ("Thanks, that works.", "That's wrong, try again.", "OK, next one please.")

log = logging.getLogger("chaos")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(work: Path, port: int, batch_size: int = 16, hosts: int = 1) -> Any:
    """The soak's app and trainer; on two hosts one ingress replica per host and the sample
    buffer (its files stand for a persistent volume) on host a."""
    from clawray.config import ClawRayConfig

    cfg = (ClawRayConfig()
            .inference(engine="hf", max_running=16)
            .serving(host="127.0.0.1", port=port, api_keys=[KEY], record_sink=["hub"],
                     ingress_replicas=2, replica_num_cpus=0.25, default_max_tokens=12)
            .sessions(num_hubs=2, idle_timeout_s=4, feedback_window_s=1, flush_interval_s=0.2)
            .judge(num_voters=2, timeout_s=20)
            .buffer(path=str(work / "samples"), seal_age_s=0.2, lease_s=15)
            .training(app=APP, batch_size=batch_size, min_batch=4, take_timeout_s=3, lr=1e-4,
                      learner_num_cpus=0.25, checkpoint_every=2, sync_timeout_s=60,
                      checkpoint_dir=str(work / "ckpt"), metrics_path=str(work / "m.jsonl")))
    if hosts == 2:
        cfg = cfg.placement(policy={"max_per_node": 1},
                            buffer={"labels": {"clawray-host": "a"}})
    return cfg


# ---------------------------------------------------------------------------- clients
class Clients:
    """Seeded users running 3-turn streaming sessions; counts every request's fate."""

    def __init__(self, base_url: str, users: int, seed: int) -> None:
        import openai

        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=KEY, max_retries=0,
                                         timeout=60)
        self.base_url, self.users, self.seed = base_url, users, seed
        self.stop = asyncio.Event()
        self.sent = self.failed = self.retried_ok = self.cut = self.feedback_ok = 0
        self.feedback_failed = 0
        self.served: list[str] = []  # response ids of completed main turns
        self.latencies: list[tuple[float, float]] = []  # (time, seconds) of completed ones
        # (start, end, error) of every failed attempt
        self.failures: list[tuple[float, float, str]] = []
        self.unfinished_failures: list[tuple[float, float]] = []  # (start, end) failed twice
        self.errors: collections.Counter[str] = collections.Counter()

    async def run(self) -> None:
        await asyncio.gather(*(self._user(i) for i in range(self.users)))

    async def _user(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        n = 0
        while not self.stop.is_set():
            n += 1
            sid = f"chaos-{self.seed}-{i}-{n}"
            msgs = [{"role": "system", "content": "You are a file assistant."},
                    {"role": "user", "content": f"List the files in folder {rng.randint(1, 99)}."}]
            for turn in range(3):
                last = turn == 2
                headers = {"X-Session-Id": sid, **({"X-Session-Done": "1"} if last else {})}
                out = await self._ask(msgs, headers)
                if out is None:
                    break  # the session is abandoned, as a user would after an error
                text, rid = out
                if rng.random() < 0.3:
                    await self._feedback(rid, rng.choice(("up", "down")))
                msgs += [{"role": "assistant", "content": text},
                         {"role": "user", "content": rng.choice(REPLIES)}]

    async def _ask(self, msgs: list[dict[str, Any]], headers: dict[str, str]
                   ) -> tuple[str, str] | None:
        first = time.time()
        for attempt in range(2):
            self.sent += 1
            t0 = time.monotonic()
            rid, text, done = None, "", False
            try:
                stream = await self.client.chat.completions.create(
                    model="clawray-tiny", messages=msgs, tools=TOOLS, stream=True,
                    max_tokens=12, extra_headers={**headers, **({"X-Retry": "1"} if attempt
                                                                 else {})})
                async for chunk in stream:
                    rid = chunk.id
                    for ch in chunk.choices:
                        text += ch.delta.content or ""
                        done = done or ch.finish_reason is not None
                if not done:
                    raise RuntimeError("stream ended without a finish reason")
            except Exception as e:  # noqa: BLE001 - every failure is counted
                self.errors[type(e).__name__] += 1
                self.failures.append((time.time() - (time.monotonic() - t0), time.time(),
                                      type(e).__name__))
                if rid is not None:
                    self.cut += 1
                continue
            self.served.append(rid)
            self.latencies.append((time.time(), time.monotonic() - t0))
            self.retried_ok += attempt
            return text, rid
        self.failed += 1
        self.unfinished_failures.append((first, time.time()))
        return None

    async def _feedback(self, rid: str, rating: str) -> None:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.post(self.base_url + "/feedback",
                                    json={"response_id": rid, "rating": rating},
                                    headers={"Authorization": f"Bearer {KEY}"})
            ok = r.status_code in (200, 404, 409)  # 404: not in its hub yet; 409: sealed
            self.feedback_ok += ok
            self.feedback_failed += not ok
        except Exception:  # noqa: BLE001
            self.feedback_failed += 1


# ---------------------------------------------------------------------------- trainer
class TrainerJob:
    """The training job in a thread: a crashed iteration restarts it from its checkpoint."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.ckpt = Path(cfg.training_cfg.checkpoint_dir)
        self.stop = threading.Event()
        self.kill = threading.Event()
        self.trainer: Any = None
        self.restarts = self.updates = self.iterations = 0
        self.trained_rows = self.trained_twice = self.repeats_dropped = 0
        self.errors: collections.Counter[str] = collections.Counter()
        self.left_in_buffer: dict[str, Any] = {}
        self.lineage: set[str] = set()
        self.ever: set[str] = set()  # every row some update trained, across restarts
        self.where: Any = None  # --hosts 2: () -> the hosts of the learner ranks
        self.starts: list[dict[str, Any]] = []  # each (re)start: when, and where its ranks went

    def _start(self) -> Any:
        from clawray.training.trainer import Trainer

        t = Trainer(config=self.cfg.to_dict())
        if (self.ckpt / "trainer.json").exists():
            t.restore(str(self.ckpt))
        self.lineage = set(t.trained.recent())  # what these weights already hold
        add = t.trained.add

        def trained(ids: list[str]) -> None:
            self.trained_rows += len(ids)
            self.trained_twice += sum(i in self.lineage for i in ids)
            self.lineage.update(ids)
            self.ever.update(ids)
            add(ids)

        t.trained.add = trained
        take = t._take_batch

        def take_then_maybe_die() -> Any:
            batch = take()
            if batch.slices and self.kill.is_set():
                self.kill.clear()
                raise RuntimeError("chaos: the trainer job died after taking a batch")
            return batch

        t._take_batch = take_then_maybe_die
        return t

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.trainer is None:
                    self.trainer = self._start()
                    if self.where is not None:
                        self.starts.append({"t": time.time(), "learner_hosts": self.where()})
                r = self.trainer.train()
                self.iterations += 1
                self.updates += bool(r.get("optimizer_steps"))
                self.repeats_dropped += r.get("samples_repeated", 0)
            except Exception as e:  # noqa: BLE001 - the job crashed: restart it
                self.errors[type(e).__name__] += 1
                log.warning("trainer job died (%s: %s); restarting from its checkpoint",
                            type(e).__name__, str(e)[:200])
                self.restarts += 1
                old, self.trainer = self.trainer, None
                if old is not None:
                    try:
                        old.cleanup()
                    except Exception:  # noqa: BLE001 - its actors may be dead already
                        pass
                time.sleep(1.0)
        if self.trainer is not None:
            self.trainer.cleanup()

    def learner_workers(self) -> list[Any]:
        t = self.trainer
        return list(getattr(getattr(t, "learner", None), "workers", []) or [])


# ---------------------------------------------------------------------------- chaos
def _ray_processes() -> list[tuple[Any, str]]:
    """(process, actor class) of this machine's Ray actor processes, by their title
    (``ray::SessionHub``; Serve replicas ``ray::ServeReplica:app:Deployment``)."""
    import psutil
    import ray

    session = ray._private.worker._global_node.get_session_dir_path()
    raylets = [p for p in psutil.process_iter(["cmdline"])
               if any("raylet" in c for c in (p.info.get("cmdline") or [])[:1])
               and any(session in c for c in p.info.get("cmdline") or [])]
    out = []
    for raylet in raylets:  # this cluster's workers only, not another one's on the machine
        for proc in raylet.children(recursive=True):
            try:
                cmd = proc.cmdline()
            except psutil.Error:
                continue
            if cmd and cmd[0].startswith("ray::") and not cmd[0].startswith("ray::IDLE"):
                out.append((proc, cmd[0][5:].split(".")[0].split()[0]))
    return out


class HostFault:
    """Host b lost, then back (``--hosts 2``). ``lose`` takes it down; ``tick`` (the chaos
    loop calls it) notes when Ray declares b dead, brings b back ``down_s`` after the loss
    (not before Ray declared it dead), notes when it joined and when both ingress replicas
    are running again, one per host; ``busy`` until then."""

    def __init__(self, ns_b: str, dev_b: str, address: str, temp_dir: str, cpus: int,
                 down_s: float) -> None:
        self.ns_b, self.dev_b, self.address = ns_b, dev_b, address
        self.temp_dir, self.cpus, self.down_s = temp_dir, cpus, down_s
        self.events: list[dict[str, Any]] = []

    @property
    def busy(self) -> bool:
        return bool(self.events) and "replicas_back" not in self.events[-1]

    def lose(self) -> str:
        from tests.support import twohost

        on_b = twohost.actors_on("b")
        twohost.lose_host(self.ns_b, self.dev_b)
        self.events.append({"lost": time.time(), "parts_on_b": on_b})
        return "host b (" + ", ".join(f"{n} {c}" for c, n in sorted(
            collections.Counter(c.split(":")[-1] for c in on_b).items())) + ")"

    def tick(self, now: float) -> None:
        from tests.support import twohost

        if not self.busy:
            return
        e = self.events[-1]
        if "declared_dead" not in e:
            if not twohost.host_alive("b"):
                e["declared_dead"] = now
        elif "rejoining" not in e:
            if now - e["lost"] >= self.down_s:
                e["rejoining"] = now
                twohost.rejoin_host(self.ns_b, self.dev_b, self.address, self.temp_dir,
                                    f"{self.temp_dir}/ray-b-again.log", self.cpus)
        elif "rejoined" not in e:
            if twohost.host_alive("b"):
                e["rejoined"] = now
        elif _ingress_running() >= 2 and sum(f"ServeReplica:{APP}:Ingress" in c
                                             for c in twohost.actors_on("b")) == 1:
            e["replicas_back"] = now
            e["parts_after"] = {h: twohost.actors_on(h) for h in ("a", "b")}


def _ingress_running() -> int:
    """The app's ingress replicas Serve counts RUNNING."""
    from ray import serve

    app = serve.status().applications.get(APP)
    dep = app.deployments.get("Ingress") if app else None
    return dep.replica_states.get("RUNNING", 0) if dep else 0


def kill_one(kind: str, pipeline: Any, job: TrainerJob, rng: random.Random,
             host: HostFault | None = None) -> str:
    """Kill one part of ``kind``; returns what was killed."""
    import ray

    if kind == "host":
        assert host is not None, "a host loss needs --hosts 2"
        return host.lose()
    if kind == "hub":
        i = rng.randrange(len(pipeline.hubs))
        ray.kill(pipeline.hubs[i], no_restart=False)
        return f"hub {i}"
    if kind == "voter":
        i = rng.randrange(len(pipeline.voters))
        ray.kill(pipeline.voters[i], no_restart=False)
        return f"voter {i}"
    if kind == "buffer":
        ray.kill(pipeline.buffer, no_restart=False)
        return "sample buffer"
    if kind == "learner":
        workers = job.learner_workers()
        if not workers:
            return "learner (none running)"
        i = rng.randrange(len(workers))
        ray.kill(workers[i])
        return f"learner rank {i}"
    if kind == "ingress":
        replicas = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                          if a["namespace"] == "serve"
                          and a["name"].startswith(f"SERVE_REPLICA::{APP}#Ingress#"))
        if not replicas:
            return "ingress (none alive)"
        victim = rng.choice(replicas)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return f"ingress replica {victim.rsplit('#', 1)[-1]}"
    job.kill.set()
    return "trainer job (after its next take)"


def sample_memory(peaks: dict[str, float]) -> None:
    import psutil

    for proc, cls in _ray_processes():
        try:
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        name = cls.split(":")[-1]
        peaks[name] = max(peaks.get(name, 0.0), rss)


# ---------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from clawray.serve.app import build_app
    from clawray.sessions.pipeline import attach_live_pipeline

    work = Path(tempfile.mkdtemp(prefix="clawray-chaos-"))
    port = free_port()
    cfg = make_config(work, port, args.batch_size, args.hosts)
    host: HostFault | None = None
    kinds = HOST_KINDS if args.in_host else KINDS
    own = not ray.is_initialized()
    if args.in_host:  # a driver on host a of the two-host cluster (main made it)
        ns_b, dev_b, address, temp_dir, cpus = args.in_host
        host = HostFault(ns_b, dev_b, address, temp_dir, int(cpus), args.host_down_s)
        ray.init(address=address, log_to_driver=False, logging_level="WARNING",
                 namespace="clawray-chaos")
        while sum(n["Alive"] for n in ray.nodes()) < 2:
            time.sleep(1.0)
    elif own:
        from clawray.apps.launch import init_local_ray

        init_local_ray(num_cpus=8, include_dashboard=False, log_to_driver=False,
                       logging_level="WARNING")
    rng = random.Random(args.seed)
    kills: list[dict[str, Any]] = []
    peaks: dict[str, float] = {}
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
        base = f"http://127.0.0.1:{port}/{APP}/v1"
        pipeline = attach_live_pipeline(cfg, APP)
        job = TrainerJob(cfg)
        if host is not None:
            from tests.support.twohost import actor_hosts

            job.where = lambda: actor_hosts("LearnerWorker")
        trainer = threading.Thread(target=job.run, name="trainer-job", daemon=True)
        trainer.start()
        started = time.time()
        while job.iterations < 1:  # the job is up (its learner ready) before the chaos begins
            if time.time() - started > 300:
                raise RuntimeError(f"the trainer job did not start: {dict(job.errors)}")
            time.sleep(0.5)
        clients = Clients(base, args.users, args.seed)
        t0 = time.time()
        stop_chaos = threading.Event()

        def chaos() -> None:
            order: list[str] = []
            next_kill = t0 + args.warmup_s
            next_mem = 0.0
            while not stop_chaos.is_set():
                now = time.time()
                if now >= next_mem:
                    try:
                        sample_memory(peaks)
                    except Exception:  # noqa: BLE001 - measurement only
                        log.debug("memory sample failed", exc_info=True)
                    next_mem = now + 2.0
                if host is not None and host.busy:  # nothing else dies while b is away
                    try:
                        host.tick(now)
                    except Exception:  # noqa: BLE001 - the GCS was busy: the next tick
                        log.warning("host fault tick failed", exc_info=True)
                    if not host.busy:
                        e = host.events[-1]
                        print(f"[{now - t0:6.1f} s] host b back: declared dead after "
                              f"{e['declared_dead'] - e['lost']:.1f} s, joined after "
                              f"{e['rejoined'] - e['lost']:.1f} s, both replicas after "
                              f"{e['replicas_back'] - e['lost']:.1f} s", flush=True)
                        next_kill = now + args.kill_every_s
                    time.sleep(0.5)
                    continue
                if now >= next_kill:
                    if not order:
                        order = list(kinds)
                        rng.shuffle(order)
                    kind = order.pop()
                    try:
                        what = kill_one(kind, pipeline, job, rng, host)
                    except Exception as e:  # noqa: BLE001 - e.g. the actor was restarting
                        what = f"{kind}: kill failed ({type(e).__name__})"
                    kills.append({"t": round(now - t0, 1), "kind": kind, "what": what})
                    print(f"[{now - t0:6.1f} s] killed {what}", flush=True)
                    next_kill = now + args.kill_every_s
                time.sleep(0.2)

        chaos_thread = threading.Thread(target=chaos, name="chaos", daemon=True)
        chaos_thread.start()

        async def drive() -> None:
            task = asyncio.create_task(clients.run())

            def going() -> bool:  # the duration, and (up to 3x as long) each kind killed once
                elapsed = time.time() - t0
                return elapsed < args.duration_s or (
                    len({k["kind"] for k in kills}) < len(kinds)
                    and elapsed < 3 * args.duration_s) or (
                    host is not None and host.busy and elapsed < 4 * args.duration_s)

            while going():
                await asyncio.sleep(1.0)
                if args.progress:
                    print(f"[{time.time() - t0:6.1f} s] requests {clients.sent}, served "
                          f"{len(clients.served)}, failed {clients.failed}; trainer "
                          f"{job.iterations} iterations, {job.restarts} restarts", flush=True)
            clients.stop.set()  # users finish the turn they are in
            await task

        asyncio.run(drive())
        stop_chaos.set()
        chaos_thread.join()
        # Let everything finish: idle sessions close, hubs write, the trainer trains the rest.
        time.sleep(cfg.sessions_cfg.idle_timeout_s + 2)
        _flush(pipeline)
        drain_until = time.time() + args.drain_s
        left: dict[str, Any] = {}
        # Done when nothing is leased and what is left is less than the trainer takes
        # (training.min_batch), the same for a few take timeouts in a row.
        settle_s = 2 * cfg.training_cfg.take_timeout_s + 1
        settled_since: float | None = None
        while time.time() < drain_until:
            try:
                st = ray.get(pipeline.buffer.stats.remote(), timeout=10)
                left = {"available": st["available"], "leased": st["leased_rows"]}
                idle = (st["leased_rows"] == 0 and job.trainer is not None
                        and st["available"] < cfg.training_cfg.min_batch)
                settled_since = (settled_since or time.time()) if idle else None
                if (st["available"] == 0 and idle) or (
                        settled_since is not None and time.time() - settled_since > settle_s):
                    break
            except Exception:  # noqa: BLE001 - restarting
                pass
            time.sleep(1.0)
        job.left_in_buffer = left
        job.stop.set()
        trainer.join(timeout=120)
        sample_memory(peaks)
        return report(args, cfg, clients, job, kills, peaks, work, time.time() - t0, host)
    finally:
        try:
            serve.delete(APP)
        except Exception:  # noqa: BLE001
            pass
        if own:
            ray.shutdown()


def _flush(pipeline: Any, timeout_s: float = 120.0) -> None:
    """Every hub and the buffer written out, waiting out restarts."""
    deadline = time.time() + timeout_s
    while True:
        try:
            pipeline.flush(30.0)
            return
        except Exception:  # noqa: BLE001 - a part still restarting
            if time.time() > deadline:
                raise
            time.sleep(1.0)


def host_losses(events: list[dict[str, Any]], latencies: list[tuple[float, float]],
                failures: list[tuple[float, float, str]],
                unfinished: list[tuple[float, float]]) -> list[dict[str, Any]]:
    """Per host loss, in seconds after it: when Ray declared b dead, when b joined again, when
    both ingress replicas ran again (``recovered``); the failed attempts and the requests that
    failed their retry too between the loss and the recovery; the completed requests in that
    window that took more than 10 times the median before the loss (at least 5 s): stalled,
    and when the last of them ended. ``latencies`` are (end, seconds) of completed requests,
    ``failures`` (start, end, error) of failed attempts, ``unfinished`` (start, end) of
    requests whose retry failed too; times are ``time.time()``."""
    out = []
    for e in events:
        lost = e["lost"]
        end = e.get("replicas_back", float("inf"))
        before = sorted(s for t, s in latencies if t < lost)
        typical = before[len(before) // 2] if before else 0.0
        window = [(t, s) for t, s in latencies if t - s <= end and t >= lost]
        stalled = [(t, s) for t, s in window if s > max(10 * typical, 5.0)]
        failed = [f for f in failures if f[1] >= lost and f[0] <= end]

        def rel(key: str) -> float | None:
            return round(e[key] - lost, 1) if key in e else None

        out.append({"parts_on_b": e["parts_on_b"], "parts_after": e.get("parts_after"),
                    "declared_dead_s": rel("declared_dead"),
                    "rejoined_s": rel("rejoined"), "recovered_s": rel("replicas_back"),
                    "failed_attempts": len(failed),
                    "failed_errors": dict(collections.Counter(f[2] for f in failed)),
                    "requests_failed": sum(1 for a, b in unfinished if b >= lost and a <= end),
                    "completed_in_window": len(window), "typical_s": round(typical, 2),
                    "stalled": len(stalled),
                    "stalled_until_s": round(max(t for t, _ in stalled) - lost, 1)
                    if stalled else None})
    return out


def report(args: argparse.Namespace, cfg: Any, clients: Clients, job: TrainerJob,
           kills: list[dict[str, Any]], peaks: dict[str, float], work: Path,
           seconds: float, host: HostFault | None = None) -> dict[str, Any]:
    import pyarrow.dataset as ds

    table = ds.dataset(str(work / "samples"), format="parquet").to_table(
        columns=["sample_id"])
    sample_ids = table.column("sample_id").to_pylist()
    rows_by_turn = collections.Counter(s.rsplit("/", 1)[0] for s in sample_ids)
    served = clients.served
    lat = np.array([s for _, s in clients.latencies]) * 1000 if clients.latencies else None
    out = {
        "benchmark": "chaos",
        "settings": {"duration_s": args.duration_s, "users": args.users, "hosts": args.hosts,
                     **({"host_down_s": args.host_down_s} if host else {}),
                     "kill_every_s": args.kill_every_s, "warmup_s": args.warmup_s,
                     "batch_size": args.batch_size,
                     "seed": args.seed, "engine": cfg.inference_cfg.engine,
                     "ingress_replicas": cfg.serving_cfg.ingress_replicas,
                     "hubs": cfg.sessions_cfg.num_hubs, "voters": cfg.judge_cfg.num_voters,
                     "lease_s": cfg.buffer_cfg.lease_s,
                     "checkpoint_every": cfg.training_cfg.checkpoint_every},
        "seconds": round(seconds, 1),
        "requests": {"sent": clients.sent, "completed": len(served), "failed": clients.failed,
                     "retried_ok": clients.retried_ok, "cut_mid_stream": clients.cut,
                     "errors": dict(clients.errors)},
        "latency_ms": ({"p50": round(float(np.percentile(lat, 50)), 1),
                        "p99": round(float(np.percentile(lat, 99)), 1)}
                       if lat is not None else None),
        "feedback": {"ok": clients.feedback_ok, "failed": clients.feedback_failed},
        "turns": {"served": len(served), "rows": len(sample_ids),
                  "lost": sum(rows_by_turn[r] == 0 for r in served),
                  "duplicated": len(sample_ids) - len(set(sample_ids)),
                  "lost_ids": [r for r in served if rows_by_turn[r] == 0][:10]},
        "training": {"iterations": job.iterations, "updates": job.updates,
                     "restarts": job.restarts, "rows_trained": job.trained_rows,
                     "rows_trained_unique": len(job.ever & set(sample_ids)),
                     "rows_never_trained": len(set(sample_ids) - job.ever),
                     "left_in_buffer_after_drain": job.left_in_buffer,
                     "trained_twice": job.trained_twice,
                     "repeats_dropped": job.repeats_dropped, "errors": dict(job.errors),
                     **({"starts": [{"t": round(x["t"] - (time.time() - seconds), 1),
                                     "learner_hosts": x["learner_hosts"]}
                                    for x in job.starts]} if host else {})},
        "kills": kills,
        "kills_by_kind": dict(collections.Counter(k["kind"] for k in kills)),
        **({"host_losses": host_losses(host.events, clients.latencies, clients.failures,
                                       clients.unfinished_failures)} if host else {}),
        "peak_rss_mb": {k: round(v, 1) for k, v in sorted(peaks.items())},
        "latency_timeline": [(round(t, 2), round(s * 1000, 1)) for t, s in clients.latencies],
    }
    return out


def print_table(r: dict[str, Any]) -> None:
    q, t, tr = r["requests"], r["turns"], r["training"]
    print(f"chaos soak: {r['seconds']:.0f} s, {len(r['kills'])} kills "
          f"({', '.join(f'{k} {n}' for k, n in sorted(r['kills_by_kind'].items()))})")
    print(f"  requests: {q['sent']} sent, {q['completed']} completed, {q['failed']} failed "
          f"({q['retried_ok']} succeeded on their retry, {q['cut_mid_stream']} cut mid-stream)")
    if r["latency_ms"]:
        print(f"  latency: p50 {r['latency_ms']['p50']:.0f} ms, p99 {r['latency_ms']['p99']:.0f} ms")
    print(f"  turns served {t['served']}, rows {t['rows']}: lost {t['lost']}, "
          f"duplicated {t['duplicated']}")
    print(f"  training: {tr['iterations']} iterations, {tr['updates']} updates, "
          f"{tr['restarts']} job restarts, {tr['rows_trained']} rows trained "
          f"({tr['rows_trained_unique']} distinct; {tr['rows_never_trained']} never, "
          f"buffer after the drain {tr['left_in_buffer_after_drain']}), "
          f"{tr['trained_twice']} trained twice, {tr['repeats_dropped']} repeats dropped")
    if tr.get("starts"):
        print("  trainer job (re)starts, learner ranks on host: " + ", ".join(
            f"{x['t']:.0f} s {'+'.join(x['learner_hosts']) or '?'}" for x in tr["starts"]))
    for h in r.get("host_losses", []):
        print(f"  host b lost: declared dead after {h['declared_dead_s']} s, joined again after "
              f"{h['rejoined_s']} s, both replicas serving after {h['recovered_s']} s; "
              f"{h['failed_attempts']} attempts failed ({h['requests_failed']} requests failed "
              f"their retry too), {h['stalled']} stalled (until {h['stalled_until_s']} s)")
    print("  peak RSS (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in r["peak_rss_mb"].items()))


def save_plot(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = r["latency_timeline"]
    if not timeline:
        return
    start = timeline[0][0] - 1
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.scatter([t - start for t, _ in timeline], [ms for _, ms in timeline], s=6,
               label="completed request")
    colors = dict(zip(HOST_KINDS, ("C1", "C2", "C3", "C4", "C5", "C6", "C7")))
    for k in r["kills"]:
        ax.axvline(k["t"], color=colors.get(k["kind"], "k"), alpha=0.6, lw=1)
    for k, h in zip([k for k in r["kills"] if k["kind"] == "host"], r.get("host_losses", [])):
        ax.axvspan(k["t"], k["t"] + (h["recovered_s"] or 0), color="C7", alpha=0.15)
    if "host_losses" not in r:
        colors.pop("host")
    for kind, color in colors.items():
        ax.plot([], [], color=color, label=f"kill: {kind}")
    ax.set_xlabel("seconds")
    ax.set_ylabel("request latency (ms)")
    ax.set_yscale("log")
    t = r["turns"]
    ax.set_title(f"chaos soak: {t['served']} turns served, {t['lost']} lost, "
                 f"{t['duplicated']} duplicated, {r['training']['trained_twice']} trained twice")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="33 s of chaos, a kill every 5 s (make test-long)")
    p.add_argument("--duration-s", type=float, default=None, help="default 300 (33 quick)")
    p.add_argument("--users", type=int, default=None, help="default 4 (3 quick)")
    p.add_argument("--kill-every-s", type=float, default=None, help="default 20 (5 quick)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="no kill before this (default 15; 6 quick)")
    p.add_argument("--drain-s", type=float, default=None,
                   help="after the chaos, let the trainer train what is left for up to this "
                   "(default 180; 90 quick)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="rows per update (default 16; 32 quick: the drain after the chaos, "
                   "which trains what is left, takes half as many updates)")
    p.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                   help="2: on two hosts (network namespaces; root), host b lost among the "
                   "faults")
    p.add_argument("--host-down-s", type=float, default=45.0,
                   help="--hosts 2: host b comes back this long after it was lost")
    p.add_argument("--in-host", nargs=5, default=None, help=argparse.SUPPRESS,
                   metavar=("NS_B", "DEV_B", "ADDRESS", "TEMP_DIR", "CPUS"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", action="store_true", help="a line every second")
    p.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    args = p.parse_args(argv)
    defaults = ({"duration_s": 33.0, "users": 3, "kill_every_s": 5.0, "warmup_s": 6.0,
                 "drain_s": 90.0, "batch_size": 32} if args.quick else
                {"duration_s": 300.0, "users": 4, "kill_every_s": 20.0, "warmup_s": 15.0,
                 "drain_s": 180.0, "batch_size": 16})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def on_two_hosts(argv: list[str], args: argparse.Namespace) -> int:
    """Make the two hosts (``tests/support/twohost.py``), run this soak as a driver on host a
    (``--in-host``), then remove everything the hosts were, whatever happened."""
    from tests.support.twohost import run_on_hosts

    cpus = 4
    return run_on_hosts(lambda h: [sys.executable, __file__, *argv, "--in-host", h.ns["b"],
                                   h.dev["b"], h.address, f"{h.tmp}/ray", str(cpus)],
                        timeout_s=5 * args.duration_s + args.drain_s + 900, cpus=cpus)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    if args.hosts == 2:
        sys.path.insert(0, str(REPO))  # tests.support.twohost
        if not args.in_host:
            return on_two_hosts(argv, args)
    r = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(r, indent=2))
    save_plot(r, args.out.with_suffix(".png"))
    print_table(r)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", flush=True)
    if args.in_host:
        os._exit(0)  # the cluster goes with the hosts; nothing to wait for
    return 0


if __name__ == "__main__":
    sys.exit(main())
