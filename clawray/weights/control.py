"""The app's control plane: published weights, the sample-collection switch, replica liveness.

One ``AppControl`` actor per Serve app (``{app}:control`` in namespace ``clawray``, detached).
The learner publishes ``(version, kind, [payload_ref])`` there; every replica runs a
``WeightReceiver`` that long-polls ``wait_change``, applies a newer version between two
generation steps through the matching ``WeightSync.receive`` and reports the version it now
serves. ``wait_replicas`` lets the learner wait until every live replica caught up. The same
long poll carries the operator's ``collecting`` switch (turn records to the session pipeline
on/off), so no replica ever stops serving because of training.

The payload ref travels inside a one-element list: Ray resolves a top-level ``ObjectRef``
argument, but passes nested ones through untouched, so the control actor never loads weights.
State lives in memory: after a restart the version is rebuilt from the replicas' reports and
the payload comes back with the learner's next publish.

A channel is any name with its own control actor. The app's policy replicas use the app's name;
its JudgeServer replicas use ``judge_channel(app)`` (``{app}/judge``), so the RLAnything reward
model's weights and versions never mix with the policy's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import ray

from clawray.names import NAMESPACE, control_name

logger = logging.getLogger(__name__)

DEFAULT_LIVE_S = 15.0  # a replica that neither polled nor reported for this long is gone
POLL_S = 5.0  # long-poll timeout; well under DEFAULT_LIVE_S


@ray.remote(num_cpus=0)
class AppControl:
    """Latest published weights and the collecting switch of one Serve app (async actor)."""

    def __init__(self, app_name: str, live_s: float = DEFAULT_LIVE_S) -> None:
        self.app_name = app_name
        self.live_s = live_s
        self.version = 0
        self.kind: str | None = None
        self.payload: list | None = None  # [ObjectRef]
        self.published_at: float | None = None
        self.collecting = True
        self.replicas: dict[str, dict[str, Any]] = {}
        self.serving: dict[str, dict[str, Any]] = {}  # replica id -> its serving tally
        self._state_event = asyncio.Event()  # set (and replaced) on a new version or switch
        self._replica_event = asyncio.Event()  # set (and replaced) on any replica update
        # Per-user adapters (per-user policies): user -> {"version", "box", "seq"}; a deleted
        # user's entry has version and box None. ``adapter_seq`` counts changes; ``epoch``
        # tells a replica this actor restarted (it then re-reads every adapter; the trainer
        # republishes what it trains next, the adapters on disk are the record).
        self.adapters: dict[str, dict[str, Any]] = {}
        self.adapter_seq = 0
        self.epoch = uuid.uuid4().hex
        # The policy gate's routing table (clawray/gate): which adapter serves everyone, which
        # one serves the canary's sessions; ``routing_seq`` counts changes (0: none set).
        self.routing: dict[str, Any] | None = None
        self.routing_seq = 0

    # ---- learner / operator side ------------------------------------------------------------

    async def publish(self, version: int, kind: str, payload_box: list) -> dict[str, Any]:
        """Make ``payload_box[0]`` (an ObjectRef) the weights every replica should serve."""
        if version <= self.version:
            raise ValueError(f"app '{self.app_name}': version {version} is not newer than the "
                             f"published version {self.version}")
        check_payload_box(payload_box)
        self.version, self.kind, self.payload = version, kind, payload_box
        self.published_at = time.time()
        self._wake_state()
        return {"version": version, "kind": kind}

    async def publish_adapter(self, user: str, version: int, payload_box: list) -> dict[str, Any]:
        """Make ``payload_box[0]`` (an ObjectRef: a LoRA payload) ``user``'s adapter at
        ``version``; replicas load it beside the others (``engine.load_adapter``)."""
        old = self.adapters.get(user, {}).get("version") or 0
        if version <= old:
            raise ValueError(f"app '{self.app_name}': adapter {user!r} version {version} is not "
                             f"newer than the published {old}")
        check_payload_box(payload_box)
        self.adapter_seq += 1
        self.adapters[user] = {"version": version, "box": payload_box, "seq": self.adapter_seq}
        self._wake_state()
        return {"user": user, "version": version}

    async def delete_adapter(self, user: str) -> bool:
        """Replicas stop serving ``user``'s adapter (their requests fall back to the base)."""
        if self.adapters.get(user, {}).get("version") is None:
            return False
        self.adapter_seq += 1
        self.adapters[user] = {"version": None, "box": None, "seq": self.adapter_seq}
        self._wake_state()
        return True

    async def wait_adapter(self, user: str, version: int | None, timeout_s: float = 60.0,
                           min_replicas: int = 1) -> dict[str, int | None]:
        """Wait until every live weight replica (at least ``min_replicas``) serves ``user``'s
        adapter at ``version`` or newer (None: no longer serves it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = self._live(weights=True)
            have = {rid: r.get("adapters", {}).get(user) for rid, r in live.items()}
            if version is None:
                lagging = {rid: v for rid, v in have.items() if v is not None}
            else:
                lagging = {rid: v for rid, v in have.items() if v is None or v < version}
            if len(live) >= min_replicas and not lagging:
                return have
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"app '{self.app_name}': after {timeout_s:g}s, adapter "
                                   f"{user!r} version {version}: lagging {lagging or 'none'}, "
                                   f"{len(live)} live of at least {min_replicas}")
            await self._wait(self._replica_event, min(remaining, 0.5))

    async def set_routing(self, routing: dict[str, Any] | None) -> int:
        """The policy gate's routing table (``GateCore.routing``; None: no gate), mirrored by
        every replica's ``WeightReceiver``; returns its sequence number."""
        if routing != self.routing:
            self.routing = routing
            self.routing_seq += 1
            self._wake_state()
        return self.routing_seq

    async def wait_routing(self, seq: int, timeout_s: float = 30.0) -> dict[str, Any]:
        """Wait until every live replica mirrors the routing table of sequence ``seq`` or
        newer (within this actor's epoch); ``{replica_id: seq}``."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = {rid: r.get("routing_seq") for rid, r in self._live().items()}
            lagging = {rid: v for rid, v in live.items()
                       if v is None or v[0] != self.epoch or v[1] < seq}
            if not lagging:
                return {rid: v[1] for rid, v in live.items()}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"app '{self.app_name}': replicas {sorted(lagging)} did not "
                                   f"mirror routing {seq} within {timeout_s:g}s")
            await self._wait(self._replica_event, min(remaining, 0.5))

    async def set_collecting(self, enabled: bool) -> bool:
        if bool(enabled) != self.collecting:
            self.collecting = bool(enabled)
            self._wake_state()
        return self.collecting

    async def wait_replicas(self, version: int, timeout_s: float = 60.0,
                            min_replicas: int = 1) -> dict[str, int]:
        """Wait until at least ``min_replicas`` weight replicas are live and every live one
        serves ``version`` or newer; return ``{replica_id: version}``."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = self._live(weights=True)
            versions = {rid: r.get("version") for rid, r in live.items()}
            lagging = {rid: v for rid, v in versions.items() if v is None or v < version}
            if len(live) >= min_replicas and not lagging:
                return versions
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                errors = {rid: live[rid].get("error") for rid in lagging if live[rid].get("error")}
                raise TimeoutError(
                    f"app '{self.app_name}': after {timeout_s:g}s, not every replica serves "
                    f"version {version}: lagging {lagging or 'none'}"
                    + (f", errors {errors}" if errors else "")
                    + (f", {len(live)} live of at least {min_replicas} needed"
                       if len(live) < min_replicas else ""))
            await self._wait(self._replica_event, min(remaining, 0.5))

    async def wait_collecting(self, enabled: bool, timeout_s: float = 10.0) -> dict[str, bool]:
        """Wait until every live replica mirrors ``collecting == enabled``."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = {rid: r.get("collecting") for rid, r in self._live().items()}
            if all(v == enabled for v in live.values()):
                return live
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"app '{self.app_name}': replicas {live} did not mirror "
                                   f"collecting={enabled} within {timeout_s:g}s")
            await self._wait(self._replica_event, min(remaining, 0.5))

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        live = self._live()
        return {
            "app": self.app_name, "version": self.version, "kind": self.kind,
            "published_at": self.published_at, "collecting": self.collecting,
            "routing": self.routing, "routing_seq": self.routing_seq,
            "adapters": {u: a["version"] for u, a in self.adapters.items()
                         if a["version"] is not None},
            "replicas": {rid: {"version": r.get("version"), "collecting": r.get("collecting"),
                               "weights": r["weights"], "error": r.get("error"),
                               "seen_s_ago": round(now - r["seen"], 3), "live": rid in live}
                         for rid, r in self.replicas.items()},
        }

    # ---- replica side -----------------------------------------------------------------------

    async def wait_change(self, known_version: int, known_collecting: bool | None,
                          timeout_s: float = POLL_S, replica_id: str | None = None,
                          current_version: int | None = None,
                          known_adapters: tuple[str, int] | None = None,
                          known_routing: tuple[str, int] | None = None) -> dict[str, Any]:
        """Long poll: return the state as soon as the version is newer than ``known_version``
        or the switch differs from ``known_collecting``, else after ``timeout_s``.

        ``replica_id`` registers the caller (heartbeat); with ``current_version`` it is a weight
        replica that ``wait_replicas`` waits for, without it only a mirror of the switch.
        ``known_adapters`` (epoch, sequence number) asks for the adapter changes after it too
        (``"adapters"``: one entry per user changed since, in order; everything after a
        restart of this actor, whose epoch then differs). ``known_routing`` (epoch, sequence
        number) asks for the gate's routing table when it changed since (``"routing"``).
        """
        seen = 0
        if known_adapters is not None:
            seen = known_adapters[1] if known_adapters[0] == self.epoch else 0
        if replica_id is not None:
            self._touch(replica_id, polling=1, collecting=known_collecting,
                        version=current_version, weights=current_version is not None,
                        routing_seq=known_routing)
            self.version = max(self.version, current_version or 0)  # rebuilt after a restart
        try:
            deadline = time.monotonic() + timeout_s
            while not (self.version > known_version or self.collecting != known_collecting
                       or (known_adapters is not None and self.adapter_seq > seen)
                       or (known_routing is not None
                           and tuple(known_routing) != (self.epoch, self.routing_seq))):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                await self._wait(self._state_event, remaining)
        finally:
            entry = self.replicas.get(replica_id)  # None once the replica deregistered
            if entry is not None:
                entry["polling"] -= 1
                entry["seen"] = time.monotonic()
        state = {"version": self.version, "kind": self.kind, "payload": self.payload,
                 "collecting": self.collecting}
        if known_routing is not None:
            state.update(routing=self.routing, routing_epoch=self.epoch,
                         routing_seq=self.routing_seq)
        if known_adapters is not None:
            changed = sorted((a["seq"], u) for u, a in self.adapters.items() if a["seq"] > seen)
            state.update(adapter_epoch=self.epoch, adapter_seq=self.adapter_seq, adapters=[
                {"user": u, "version": self.adapters[u]["version"],
                 "payload": self.adapters[u]["box"]} for _, u in changed])
        return state

    def report(self, replica_id: str, version: int, error: str | None = None) -> None:
        """A weight replica now serves ``version`` (``error``: why it could not apply newer)."""
        self._touch(replica_id, version=version, weights=True, error=error or None)
        # After a restart of this actor, the replicas tell which version the app is on.
        self.version = max(self.version, version)

    def report_adapter(self, replica_id: str, user: str, version: int | None,
                       error: str | None = None) -> None:
        """A weight replica serves ``user``'s adapter at ``version`` (None: not at all)."""
        self._touch(replica_id, weights=True, error=error or None)
        adapters = self.replicas[replica_id].setdefault("adapters", {})
        if version is None:
            adapters.pop(user, None)
        else:
            adapters[user] = version

    def report_serving(self, replica_id: str, tally: dict[str, Any]) -> None:
        """A replica's serving signals during the gate's canaries (its whole cumulative
        ``ServingTally.snapshot``: the newest report per replica counts). Kept when the replica
        goes away: what it served still happened."""
        self.serving[replica_id] = tally

    def serving_reports(self) -> list[dict[str, Any]]:
        """Every replica's newest serving tally (the gate sums one canary's: merge_serving)."""
        return list(self.serving.values())

    def deregister(self, replica_id: str) -> None:
        if self.replicas.pop(replica_id, None) is not None:
            self._replica_event = _wake(self._replica_event)

    # ---- internals --------------------------------------------------------------------------

    def _touch(self, replica_id: str, polling: int = 0, **fields: Any) -> None:
        r = self.replicas.setdefault(replica_id, {"polling": 0, "weights": False, "version": None})
        r["seen"] = time.monotonic()
        r["polling"] += polling  # polls in flight: a replica waiting in one is live
        for key, value in fields.items():
            if key == "weights":
                r["weights"] = r["weights"] or value
            elif key == "error" or value is not None:
                r[key] = value
        self._replica_event = _wake(self._replica_event)

    def _live(self, weights: bool = False) -> dict[str, dict[str, Any]]:
        cutoff = time.monotonic() - self.live_s
        return {rid: r for rid, r in self.replicas.items()
                if (r["polling"] > 0 or r["seen"] >= cutoff) and (r["weights"] or not weights)}

    def _wake_state(self) -> None:
        self._state_event = _wake(self._state_event)

    @staticmethod
    async def _wait(event: asyncio.Event, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass


def _wake(event: asyncio.Event) -> asyncio.Event:
    """Wake everyone waiting on ``event``; later waiters wait on the returned fresh one."""
    event.set()
    return asyncio.Event()


def is_payload_box(x: Any) -> bool:
    """A payload reference as the control plane passes it: ``[ObjectRef]`` (a top-level ref
    would be resolved by Ray; a nested one travels untouched)."""
    return isinstance(x, list) and len(x) == 1 and isinstance(x[0], ray.ObjectRef)


def check_payload_box(x: Any) -> None:
    if not is_payload_box(x):
        raise TypeError("payload_box must be a one-element list holding an ObjectRef")


def start_app_control(app_name: str) -> Any:
    """The app's control actor, created (detached, restarting) if it does not exist yet."""
    return AppControl.options(name=control_name(app_name), namespace=NAMESPACE,
                              get_if_exists=True, lifetime="detached", max_restarts=-1,
                              max_task_retries=-1).remote(app_name)


def get_app_control(app_name: str) -> Any:
    """The running app's control actor; raises ValueError if there is none."""
    return ray.get_actor(control_name(app_name), namespace=NAMESPACE)
