"""The ``PolicyGate`` actor: one per Serve app (``{app}:gate``, namespace ``clawray``).

It holds the gate's rules (``GateCore``) and does what they need done:

- keeps each proposed version's LoRA payload on disk (``{gate.dir}/{app}/v{n}.pt``), the last
  ``gate.keep`` of them, and has the app's replicas serve it as adapter ``~gate/v{n}`` through
  the app's control actor (``AppControl.publish_adapter``), so a rollback needs no trainer;
- runs the shadow evaluation of a new candidate: the app's ingress (a Serve handle,
  ``gate_replies``) answers the held-out set with the candidate's adapter and with the
  incumbent's, same seeds; the set's scorer scores both and the health checks read both;
- counts the canary's judged turns (``observe``, from the trainer, which sees every judged row)
  and lets the rules promote or roll back;
- pushes the routing table (``GateCore.routing``) to the control actor, which every replica
  mirrors (``WeightReceiver.routing``, read by ``ChatService``);
- writes every decision to ``decisions.jsonl`` (and counts it in the Ray metric
  ``clawray_gate_decisions_total``) and its state to ``state.json`` (a restarted gate resumes), and re-asserts adapters and routing when the control actor restarted.

Operators reach it through Ray (``clawray gate status|promote|reject|rollback|pin|unpin``),
never through the public HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pkgutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray

from clawray.config import GateConfig
from clawray.files import write_atomic
from clawray.gate.core import BASE, GateCore, GateSettings, adapter_name, merge_serving
from clawray.gate.health import health
from clawray.names import NAMESPACE, gate_name
from clawray.weights.control import check_payload_box, start_app_control

logger = logging.getLogger(__name__)

SHADOW_TRIES = 3
HEAL_S = 5.0
# Without a configured set: health checks on a few everyday requests.
BUILTIN_PROMPTS = ["Hello!", "What can you do?", "Thanks for the help.",
                   "Can you explain what a list is?", "Good morning.", "Tell me about yourself.",
                   "How are you today?", "Please summarize our conversation.",
                   "What is a good name for a cat?", "Why is the sky blue?"]


@dataclass
class ShadowSet:
    """A held-out set for shadow evaluation: chat prompts and a score per reply (None: every
    reply scores 0, so only the health checks compare)."""

    prompts: list[list[dict[str, Any]]]
    score: Callable[[int, str], float] | None = None
    name: str = ""


def load_shadow_set(spec: str | None, kwargs: dict[str, Any] | None = None) -> ShadowSet:
    """``gate.shadow_set``: None (built-in prompts), a JSONL file of ``{"messages": [...]}``,
    or ``module:factory`` called with ``kwargs``."""
    if spec is None:
        return ShadowSet([[{"role": "user", "content": p}] for p in BUILTIN_PROMPTS],
                         name="built-in")
    path = Path(spec).expanduser()
    if spec.endswith(".jsonl") or path.exists():
        if not path.exists():
            raise ValueError(f"gate.shadow_set: no file {path}")
        prompts = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                    raise ValueError(f"gate.shadow_set {path}:{n}: expected "
                                     '{"messages": [...]}')
                prompts.append(row["messages"])
        if not prompts:
            raise ValueError(f"gate.shadow_set {path}: no prompts")
        return ShadowSet(prompts, name=str(path))
    if not spec.partition(":")[2]:
        raise ValueError(f"gate.shadow_set {spec!r}: a .jsonl file or 'module:factory'")
    made = pkgutil.resolve_name(spec)(**(kwargs or {}))
    if not isinstance(made, ShadowSet) or not made.prompts:
        raise ValueError(f"gate.shadow_set {spec!r} returned {type(made).__name__}, not a "
                         "ShadowSet with prompts")
    return made


class GateMetrics:
    """The gate as Ray metrics (scraped by Prometheus with the rest of Ray's):
    ``clawray_gate_decisions_total{app, event}`` counts every event, and gauges give the
    incumbent, the candidate (-1: none), and the canary's judged turns per side. ``factory``
    makes a metric (tests pass their own)."""

    SIDES = ("candidate", "incumbent")

    def __init__(self, app: str, factory: Callable[..., Any] | None = None) -> None:
        if factory is None:
            from ray.util.metrics import Counter, Gauge

            def factory(kind: str, name: str, description: str, tag_keys: tuple) -> Any:
                return (Counter if kind == "counter" else Gauge)(
                    name, description=description, tag_keys=tag_keys)
        self.tags = {"app": app}
        self.decisions = factory("counter", "clawray_gate_decisions_total",
                                 "policy gate events, by kind", ("app", "event"))
        self.incumbent = factory("gauge", "clawray_gate_incumbent",
                                 "the version serving everyone (0: the base)", ("app",))
        self.candidate = factory("gauge", "clawray_gate_candidate",
                                 "the pending candidate (-1: none)", ("app",))
        self.turns = factory("gauge", "clawray_gate_canary_turns",
                             "judged turns of the running canary, by side", ("app", "side"))

    def record(self, new_events: list[dict[str, Any]], core: GateCore) -> None:
        for ev in new_events:
            self.decisions.inc(1, tags={**self.tags, "event": ev["event"]})
        self.incumbent.set(core.incumbent, tags=self.tags)
        self.candidate.set(-1 if core.candidate is None else core.candidate, tags=self.tags)
        for side in self.SIDES:
            n = core.arms[side].n if core.phase == "canary" else 0
            self.turns.set(n, tags={**self.tags, "side": side})


@ray.remote(num_cpus=0)
class PolicyGate:
    """The policy gate of one app (async actor)."""

    def __init__(self, app: str, gate: dict[str, Any]) -> None:
        self.app = app
        self.cfg = GateConfig(**gate)
        self.dir = Path(self.cfg.dir).expanduser() / app
        self.dir.mkdir(parents=True, exist_ok=True)
        settings = GateSettings.of(self.cfg)
        state = self.dir / "state.json"
        self.core = (GateCore.from_dict(json.loads(state.read_text()), settings)
                     if state.exists() else GateCore(settings=settings))
        self.control = start_app_control(app)
        self._lock = asyncio.Lock()
        self._shadow: asyncio.Task | None = None
        self._heal: asyncio.Task | None = None
        self._shadow_set: ShadowSet | None = None
        self.shadow_errors: list[str] = []
        self._logged_seq = self.core.event_seq  # events up to here are in decisions.jsonl
        self.metrics = GateMetrics(app)

    # ---- the trainer's side ------------------------------------------------------------------

    async def propose(self, version: int, payload_box: list, line: int | None = None
                      ) -> dict[str, Any]:
        """The trainer's new version (``payload_box[0]``: its LoRA payload's ObjectRef), trained
        on gate line ``line`` (a version of a line abandoned since is discarded)."""
        self._ensure_healer()
        check_payload_box(payload_box)
        if version <= self.core.published:
            raise ValueError(f"version {version} is not newer than the last published "
                             f"{self.core.published}")
        if line is not None and line != self.core.line:  # nothing to keep or serve
            async with self._lock:
                ev = self.core.propose(version, line)
                await self._after()
            return ev
        payload = await payload_box[0]
        import torch

        await asyncio.to_thread(write_atomic, self._file(version),
                                lambda f: torch.save(payload, f))
        await self.control.publish_adapter.remote(adapter_name(version), version, payload_box)
        async with self._lock:
            ev = self.core.propose(version, line)
            await self._after()
        return ev

    async def observe(self, observations: list[tuple]) -> list[dict[str, Any]]:
        """Judged turns ``(version, reward, served_at[, status])`` (status: judged | feedback |
        regenerated); the decisions they caused, the replicas' serving signals first."""
        serving = [ev] if (ev := await self._serving_round()) is not None else []
        async with self._lock:
            events = [ev for v, r, at, *st in observations
                      if (ev := self.core.observe(int(v), float(r), at, *st)) is not None]
            if events:  # (a serving round's decision was handled by the round)
                await self._after()
        return serving + events

    async def _serving_round(self) -> dict[str, Any] | None:
        """During a canary: the replicas' serving signals (errors, latency per side) to the
        rules, which may roll the candidate back."""
        if self.core.phase != "canary":
            return None
        salt = self.core.salt
        reports = await self.control.serving_reports.remote()
        async with self._lock:
            if self.core.phase != "canary" or self.core.salt != salt:  # decided meanwhile
                return None
            ev = self.core.serving_report(merge_serving(reports, salt))
            if ev is not None:
                await self._after()
        return ev

    def line(self) -> dict[str, Any]:
        """What the trainer follows: ``line`` changes when a candidate was abandoned (restart
        from ``head``'s weights, the newest version not abandoned; drop rows of the
        ``abandoned`` versions)."""
        return {"line": self.core.line, "incumbent": self.core.incumbent,
                "head": max([self.core.incumbent, *self.core.kept]),
                "abandoned": sorted(self.core.abandoned), "published": self.core.published}

    async def payload(self, version: int) -> list | None:
        """Kept ``version``'s LoRA payload as ``[ObjectRef]`` (None for the base, 0)."""
        if version == BASE:
            return None
        return [ray.put(await asyncio.to_thread(self._load, version))]

    # ---- the operator's side -----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {"app": self.app, **self.core.status(),
                "shadow_running": self._shadow is not None and not self._shadow.done(),
                "shadow_errors": self.shadow_errors[-5:], "dir": str(self.dir)}

    async def promote(self, by: str = "operator") -> dict[str, Any]:
        async with self._lock:
            ev = self.core.promote(by)
            await self._after()
        return ev

    async def reject(self, reason: str = "", by: str = "operator") -> dict[str, Any]:
        async with self._lock:
            ev = self.core.reject(reason, by)
            await self._after()
        return ev

    async def rollback(self, version: int, pin: bool = False, by: str = "operator",
                       wait_s: float = 30.0) -> dict[str, Any]:
        """Serve kept ``version`` to everyone (``pin``: and hold there); returns once every
        live replica routes by it."""
        if version != BASE and version not in self.core.kept:
            raise ValueError(f"version {version} is not kept (kept: {self.core.kept})")
        if version != BASE:
            await self._ensure_served(version)
        async with self._lock:
            ev = self.core.rollback(version, by, pin)
            seq = await self._after()
        replicas = await self.control.wait_routing.remote(seq, wait_s)
        return {**ev, "replicas": replicas}

    async def unpin(self, by: str = "operator") -> dict[str, Any]:
        async with self._lock:
            ev = self.core.unpin(by)
            await self._after()
        return ev

    def events(self, n: int = 50) -> list[dict[str, Any]]:
        return self.core.events[-n:]

    # ---- internals ---------------------------------------------------------------------------

    def _file(self, version: int) -> Path:
        return self.dir / f"v{version}.pt"

    def _load(self, version: int) -> dict[str, Any]:
        import torch

        path = self._file(version)
        if not path.exists():
            raise ValueError(f"version {version} has no kept payload ({path})")
        return torch.load(path, map_location="cpu", weights_only=True)

    async def _after(self) -> int:
        """After a change (under the lock): log new events, save the state, drop versions
        beyond ``keep``, push the routing table, start a pending shadow evaluation. Returns the
        routing's sequence number."""
        new = [ev for ev in self.core.events if ev["seq"] > self._logged_seq]
        if new:
            with (self.dir / "decisions.jsonl").open("a") as f:
                for ev in new:
                    f.write(json.dumps({"app": self.app, **ev}, default=str) + "\n")
                    logger.info("gate %s: %s", self.app, ev)
            self._logged_seq = new[-1]["seq"]
        self.metrics.record(new, self.core)
        for v in self.core.to_drop():
            self._file(v).unlink(missing_ok=True)
            await self.control.delete_adapter.remote(adapter_name(v))
            self.core.dropped([v])
        for v in sorted(self.core.abandoned | self.core.rejected):
            if self._file(v).exists():
                self._file(v).unlink()
                await self.control.delete_adapter.remote(adapter_name(v))
        state = json.dumps(self.core.to_dict())
        await asyncio.to_thread(write_atomic, self.dir / "state.json",
                                lambda f: f.write(state.encode()))
        seq = await self.control.set_routing.remote(self.core.routing())
        if self.core.phase == "shadow" and (self._shadow is None or self._shadow.done()):
            self._shadow = asyncio.get_running_loop().create_task(
                self._run_shadow(self.core.candidate))
        return seq

    async def _ensure_served(self, version: int) -> None:
        """Have the replicas serve kept ``version``'s adapter (again, after a restart)."""
        name = adapter_name(version)
        served = (await self.control.status.remote())["adapters"]
        if served.get(name) != version:
            payload = await asyncio.to_thread(self._load, version)
            await self.control.publish_adapter.remote(name, version, [ray.put(payload)])

    async def _run_shadow(self, version: int | None) -> None:
        if version is None:
            return
        for attempt in range(1, SHADOW_TRIES + 1):
            try:
                await self._shadow_once(version)
                return
            except Exception as e:  # noqa: BLE001 - recorded, retried, then rejected
                error = f"{type(e).__name__}: {e}"
                self.shadow_errors.append(f"v{version} try {attempt}: {error}")
                logger.warning("gate %s: shadow evaluation of version %d failed (try %d): %s",
                               self.app, version, attempt, error)
                await asyncio.sleep(2.0 * attempt)
        async with self._lock:
            if self.core.shadow_failed(version, f"{SHADOW_TRIES} tries, the last: "
                                       f"{self.shadow_errors[-1]}") is not None:
                await self._after()

    async def _shadow_once(self, version: int) -> None:
        from ray import serve

        if self._shadow_set is None:
            self._shadow_set = await asyncio.to_thread(
                load_shadow_set, self.cfg.shadow_set, self.cfg.shadow_kwargs)
        shadow = self._shadow_set
        incumbent = self.core.incumbent
        if incumbent != BASE:
            await self._ensure_served(incumbent)
        await self.control.wait_adapter.remote(adapter_name(version), version, 60.0)
        handle = serve.get_app_handle(self.app)
        kw = {"seed": self.cfg.shadow_seed, "max_tokens": self.cfg.shadow_max_tokens}
        started = time.perf_counter()
        cand, inc = await asyncio.gather(
            handle.gate_replies.remote(shadow.prompts, adapter_name(version), **kw),
            handle.gate_replies.remote(shadow.prompts, adapter_name(incumbent)
                                       if incumbent != BASE else None, **kw))
        score = shadow.score or (lambda i, text: 0.0)
        cs = [float(score(i, r["text"])) for i, r in enumerate(cand)]
        is_ = [float(score(i, r["text"])) for i, r in enumerate(inc)]
        ch = health([r["text"] for r in cand], [r["tokens"] for r in cand])
        ih = health([r["text"] for r in inc], [r["tokens"] for r in inc])
        async with self._lock:
            ev = self.core.shadow_report(version, cs, is_, ch, ih)
            if "evidence" in ev:  # (an "ignored" report has none)
                ev["evidence"].update(set=shadow.name,
                                      seconds=round(time.perf_counter() - started, 2))
            await self._after()

    def _ensure_healer(self) -> None:
        if self._heal is None or self._heal.done():
            self._heal = asyncio.get_running_loop().create_task(self._healer())

    async def _healer(self) -> None:
        """Re-assert adapters and routing when the control actor lost them (restarted)."""
        while True:
            await asyncio.sleep(HEAL_S)
            try:
                await self._serving_round()
                status = await self.control.status.remote()
                routing = self.core.routing()
                if status.get("routing") != routing:
                    for v in {self.core.incumbent, self.core.candidate} - {None, BASE}:
                        await self._ensure_served(v)
                    await self.control.set_routing.remote(routing)
                    logger.info("gate %s: routing re-asserted on the control actor", self.app)
            except Exception:  # noqa: BLE001 - the next round tries again
                logger.exception("gate %s: healing round failed", self.app)


def start_policy_gate(app: str, gate: GateConfig) -> Any:
    """The app's gate actor, created (detached, restarting) if it does not exist yet."""
    return PolicyGate.options(name=gate_name(app), namespace=NAMESPACE, get_if_exists=True,
                              lifetime="detached", max_restarts=-1,
                              max_task_retries=-1).remote(app, gate.model_dump())


def get_policy_gate(app: str) -> Any:
    """The running app's gate; raises ValueError if there is none."""
    return ray.get_actor(gate_name(app), namespace=NAMESPACE)
