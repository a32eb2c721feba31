"""A replica's side of a weight channel: ``WeightReceiver`` long-polls the channel's
``AppControl`` actor (``clawray/weights/control.py``), applies newer published weights between
two generation steps through the matching ``WeightSync.receive`` and reports the version it
serves. ``start_receiver`` starts one inside a Serve replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import ray

from clawray.weights.control import POLL_S, start_app_control
from clawray.weights.sync import make_weight_sync

logger = logging.getLogger(__name__)
REPORT_S = 1.0  # serving tallies (the policy gate's canary signals) at most this often


def serve_replica_id() -> tuple[str, str] | None:
    """``(app_name, replica_id)`` inside a Serve replica, else None (tests, scripts)."""
    try:
        from ray import serve

        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica
        return None
    return ctx.app_name, f"{ctx.deployment}#{ctx.replica_tag}"


class WeightReceiver:
    """A replica's side of the control plane, run as a background task on its event loop.

    With an ``engine`` it applies newer published weights between generation steps and reports
    the version it serves; without one (an ingress in the ``split`` layout) it only mirrors the
    ``collecting`` switch. Errors are logged with context and retried at the next change or
    after ``retry_s``; the loop never ends the replica and survives the control actor
    restarting or being recreated.
    """

    def __init__(self, app_name: str, replica_id: str, engine: Any = None, *,
                 poll_s: float = POLL_S, retry_s: float = 1.0) -> None:
        self.app_name = app_name
        self.replica_id = replica_id
        self.engine = engine
        self.poll_s = poll_s
        self.retry_s = retry_s
        self.collecting = True
        self.version = int(getattr(engine, "policy_version", 0) or 0)
        self.error: str | None = None
        # The newest version handled (applied, failed, or published without a payload): the
        # long poll waits for a newer one, so a failing payload is retried at the next change.
        self._known_version = self.version
        self._syncs: dict[str, Any] = {}  # per-kind receive state (LoRA base weights, NCCL group)
        # Per-user adapters, for engines that serve them (``load_adapter``): the changes
        # applied so far, as the control actor's (epoch, sequence number).
        self._adapters_known: tuple[str, int] | None = \
            ("", 0) if callable(getattr(engine, "load_adapter", None)) else None
        self.adapter_errors: dict[str, str] = {}
        # The policy gate's routing table (``clawray.gate.core.GateCore.routing``), mirrored
        # from the control actor; None: no gate, the shared policy serves everyone.
        self.routing: dict[str, Any] | None = None
        self._routing_known: tuple[str, int] = ("", 0)
        self._control: Any = None
        self._task: asyncio.Task | None = None
        # The gate's serving signals counted by this replica's ingress (``ServingTally``: a
        # ``changes`` counter and a ``snapshot()``), reported every ``REPORT_S`` when changed.
        self.serving_tally: Any = None
        self._serving_sent = 0
        self._report_task: asyncio.Task | None = None

    def start(self) -> WeightReceiver:
        """Start the loop on the running event loop (Serve runs replica constructors on it)."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name=f"clawray-weights-{self.replica_id}")
        self._report_task = loop.create_task(self._report_serving(),
                                             name=f"clawray-serving-{self.replica_id}")
        return self

    def close(self) -> None:
        """Stop the loop and deregister (fire-and-forget, safe from a destructor)."""
        for task in (self._task, self._report_task):
            if task is not None and not task.done():
                task.cancel()
        if self._control is not None:
            try:
                self._control.deregister.remote(self.replica_id)
            except Exception:  # noqa: BLE001 - Ray may already be shut down
                pass

    async def _run(self) -> None:
        while True:
            try:
                if self._control is None:
                    self._control = await asyncio.to_thread(start_app_control, self.app_name)
                    if self.engine is not None:  # register right away, before the first poll
                        await self._control.report.remote(self.replica_id, self.version)
                state = await self._control.wait_change.remote(
                    self._known_version, self.collecting, self.poll_s, self.replica_id,
                    self.version if self.engine is not None else None, self._adapters_known,
                    known_routing=self._routing_known)
                if state["collecting"] != self.collecting:
                    logger.info("app %s replica %s: collecting %s", self.app_name,
                                self.replica_id, "on" if state["collecting"] else "off")
                    self.collecting = state["collecting"]
                if state["version"] > self._known_version:
                    if self.engine is not None and state["payload"]:
                        await self._apply(state)
                    self._known_version = state["version"]
                if "routing" in state:
                    routing = state["routing"]
                    # (a restarted control actor knows no routing until the gate sets it
                    # again: meanwhile the replica keeps routing as it did)
                    if (routing is not None or state["routing_seq"] > 0) \
                            and routing != self.routing:
                        logger.info("app %s replica %s: routing %s", self.app_name,
                                    self.replica_id, routing)
                        self.routing = routing
                    self._routing_known = (state["routing_epoch"], state["routing_seq"])
                if self._adapters_known is not None and "adapters" in state:
                    for change in state["adapters"]:
                        await self._apply_adapter(change)
                    self._adapters_known = (state["adapter_epoch"], state["adapter_seq"])
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the replica must keep serving
                logger.exception("app %s replica %s: weight control loop failed; retrying in "
                                 "%.1fs", self.app_name, self.replica_id, self.retry_s)
                if not await _actor_alive(self._control):
                    self._control = None  # recreated (get_if_exists) on the next round
                await asyncio.sleep(self.retry_s)

    async def _report_serving(self) -> None:
        """Send the serving tally to the control actor whenever it changed (every
        ``REPORT_S`` at most); a failed report is sent again the next round."""
        while True:
            await asyncio.sleep(REPORT_S)
            tally = self.serving_tally
            if tally is None or self._control is None or tally.changes == self._serving_sent:
                continue
            changes = tally.changes
            try:
                await self._control.report_serving.remote(self.replica_id, tally.snapshot())
                self._serving_sent = changes
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the replica must keep serving
                logger.warning("app %s replica %s: serving report failed; retrying",
                               self.app_name, self.replica_id, exc_info=True)

    async def _apply_adapter(self, change: dict[str, Any]) -> None:
        """Load (or unload) one user's adapter; a failure is logged and reported, the replica
        serves on (that user's requests on the base policy)."""
        user, version = change["user"], change["version"]
        error = None
        try:
            evicted: list[str] = []
            if version is None:
                await self.engine.unload_adapter(user)
            else:
                payload = await asyncio.to_thread(ray.get, change["payload"][0])
                evicted = await self.engine.load_adapter(user, payload, version) or []
        except Exception as e:  # noqa: BLE001 - logged and reported
            error = f"adapter {user!r} version {version}: {type(e).__name__}: {e}"
            logger.exception("app %s replica %s: could not apply %s", self.app_name,
                             self.replica_id, error)
            self.adapter_errors[user] = error
            version = self.engine.adapters().get(user)  # what it still serves, if anything
            evicted = []
        else:
            self.adapter_errors.pop(user, None)
        served = self.engine.adapters()
        for gone in evicted:  # made room in memory (max_loras); the transformers engine still
            # serves it from its disk store, else it is served by the base now
            await self._control.report_adapter.remote(self.replica_id, gone, served.get(gone))
        await self._control.report_adapter.remote(self.replica_id, user, version, error)

    async def _apply(self, state: dict[str, Any]) -> None:
        version, kind = state["version"], state["kind"]
        started = time.monotonic()
        try:
            payload = await asyncio.to_thread(ray.get, state["payload"][0])
            sync = self._syncs.get(kind)
            if sync is None:  # a full swap of another kind invalidates per-kind caches
                sync = make_weight_sync(kind, self.app_name, replica_id=self.replica_id)
                self._syncs = {kind: sync}
            await sync.receive(self.engine, payload, version)
        except Exception as e:  # noqa: BLE001 - logged, reported, retried at the next version
            self.error = f"version {version} ({kind}): {type(e).__name__}: {e}"
            logger.exception("app %s replica %s: could not apply %s weights of version %d; "
                             "still serving version %d", self.app_name, self.replica_id, kind,
                             version, self.version)
        else:
            self.version, self.error = version, None
            logger.info("app %s replica %s: now serving version %d (%s) after %.3fs",
                        self.app_name, self.replica_id, version, kind,
                        time.monotonic() - started)
        await self._control.report.remote(self.replica_id, self.version, self.error)


async def _actor_alive(handle: Any) -> bool:
    if handle is None:
        return False
    try:
        await asyncio.wait_for(handle.status.remote(), 5)
        return True
    except Exception:  # noqa: BLE001
        return False


def start_receiver(engine: Any = None, *,
                   channel: Callable[[str], str] | None = None) -> WeightReceiver | None:
    """A started receiver when running in a Serve replica with an event loop, else None.

    It listens on the replica's app's own channel, or on ``channel(app_name)`` when given
    (``judge_channel`` for JudgeServer replicas).
    """
    where = serve_replica_id()
    if where is None:
        return None
    app_name = where[0] if channel is None else channel(where[0])
    try:
        return WeightReceiver(app_name, where[1], engine).start()
    except RuntimeError:  # no running event loop: cannot happen in a Serve 2.60 constructor
        logger.warning("replica %s has no running event loop: weight sync is off", where[1])
        return None
