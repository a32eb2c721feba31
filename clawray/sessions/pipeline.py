"""Starting the live pipeline (SampleBuffer, PRM voters, SessionHubs) and the ingress sink.

All three are named, detached actors in the ``clawray`` namespace, created with
``get_if_exists``: every ingress replica of an app attaches to the same ones, they outlive an
ingress restart, and a training job finds them by name (``{app}:buffer``, ``{app}:hub:{i}``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import ray

from clawray.buffer.actor import start_sample_buffer
from clawray.config import ClawRayConfig
from clawray.judging.voters import PRMVoter
from clawray.names import NAMESPACE, buffer_name, hub_name, voter_name
from clawray.records import TurnRecord
from clawray.sessions.hub import SessionHub, shard_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LivePipeline:
    app_name: str
    buffer: Any
    voters: list[Any]
    hubs: list[Any]

    def hub_for(self, session_key: str) -> Any:
        """The hub of a session (its key: ``TurnRecord.session_key``)."""
        return self.hubs[shard_of(session_key, len(self.hubs))]

    def flush(self, timeout_s: float = 60.0) -> None:
        """Finish in-flight judging and write every due row to the sample log (tests, demo).

        A restarting buffer is waited for, as the hubs do: its calls are not retried by Ray.
        """
        deadline = time.monotonic() + timeout_s
        ray.get([h.flush.remote(timeout_s) for h in self.hubs], timeout=timeout_s + 10)
        while True:
            try:
                ray.get(self.buffer.flush.remote(), timeout=timeout_s)
                return
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.RayActorError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def judging(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """How the app's turns were judged so far, summed over its hubs: the turns' outcomes
        (``judged``, ``unjudged``, ``no_next_state``, ...), the voters' calls (``calls``,
        ``timeouts``, ``call_failures``, ``shed``, ...) and the turns being judged or waiting
        (``running``, ``waiting``), prefixed ``judge_``; ``judge_controls``: the hubs'
        ``judge.control`` values (one, unless hubs differ)."""
        total: dict[str, Any] = {}
        for st in ray.get([h.stats.remote() for h in self.hubs], timeout=timeout_s):
            controls = total.setdefault("judge_controls", [])
            if st.get("judge_control") not in controls:  # what the voters actually do
                controls.append(st.get("judge_control"))
            for k in ("turns", "judge_jobs", "judged", "unjudged", "no_next_state"):
                total[k] = total.get(k, 0) + int(st.get(k, 0))
            for k, v in [*st["voters"].items(), *st["judge_load"].items()]:
                total[f"judge_{k}"] = total.get(f"judge_{k}", 0) + int(v)
        return total


def names(app_name: str, cfg: ClawRayConfig) -> dict[str, Any]:
    return {
        "buffer": buffer_name(app_name),
        "voters": [voter_name(app_name, i) for i in range(cfg.judge_cfg.num_voters)],
        "hubs": [hub_name(app_name, i) for i in range(cfg.sessions_cfg.num_hubs)],
    }


def journal_path(cfg: ClawRayConfig, app_name: str, shard: int) -> str | None:
    """Where hub ``shard`` journals its pending turns: next to the sample log, in a folder
    Parquet readers skip."""
    if not cfg.sessions_cfg.journal:
        return None
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in app_name)
    return str(Path(cfg.buffer_cfg.path).expanduser() / "_journal" / f"{safe}-hub-{shard}.jsonl")


def start_live_pipeline(cfg: ClawRayConfig, app_name: str = "clawray") -> LivePipeline:
    """Create (or attach to) the app's buffer, voters and hubs."""
    n = names(app_name, cfg)
    buffer = start_sample_buffer(cfg.buffer_cfg, name=n["buffer"], namespace=NAMESPACE,
                                 placement=cfg.placement_cfg.buffer)
    detached = {"namespace": NAMESPACE, "get_if_exists": True, "lifetime": "detached",
                "max_restarts": -1, "max_task_retries": -1}
    voters = [PRMVoter.options(name=v, **detached).remote(cfg.judge_cfg.model_dump(), app_name)
              for v in n["voters"]]
    ray.get([v.ping.remote() for v in voters])  # attach only once they can take calls
    hubs = [SessionHub.options(name=h, **detached).remote(
                cfg.to_dict(), i, n["buffer"], n["voters"], journal_path(cfg, app_name, i))
            for i, h in enumerate(n["hubs"])]
    ray.get([h.stats.remote() for h in hubs])
    return LivePipeline(app_name, buffer, voters, hubs)


def attach_live_pipeline(cfg: ClawRayConfig, app_name: str = "clawray") -> LivePipeline:
    """The running app's pipeline (for a training job or a test); fails if it is not running."""
    n = names(app_name, cfg)
    get = lambda name: ray.get_actor(name, namespace=NAMESPACE)  # noqa: E731
    return LivePipeline(app_name, get(n["buffer"]), [get(v) for v in n["voters"]],
                        [get(h) for h in n["hubs"]])


# How long feedback waits for a session hub that has not answered (restarting, or on a host
# that was lost and not yet declared dead) before the client is told to retry.
FEEDBACK_WAIT_S = 8.0


class HubUnavailable(Exception):
    """A session hub did not answer feedback in time: the client should retry (HTTP 503)."""


class HubSink:
    """The ingress's record sink: each record goes to its session's hub, fire-and-forget.

    The call is retried by Ray through a hub restart (``max_task_retries=-1``); a call that
    still fails is logged with the record's id and session, never dropped silently.
    """

    def __init__(self, pipeline: LivePipeline, feedback_wait_s: float = FEEDBACK_WAIT_S) -> None:
        self.pipeline = pipeline
        self.feedback_wait_s = feedback_wait_s

    def put(self, record: TurnRecord) -> None:
        ref = self.pipeline.hub_for(record.session_key()).submit.remote(record.to_dict())
        ref.future().add_done_callback(lambda f: _log_failure(f, record))

    def close(self) -> None:
        pass

    async def feedback(self, rating: int, text: str | None, response_id: str | None,
                       session_key: str | None, tenant: str) -> dict[str, Any]:
        """Route feedback of ``tenant``: by session key to its hub, by response id to every hub
        (``first_known``); a turn or session of another tenant is ``unknown``."""
        if response_id is None:
            refs = [self.pipeline.hub_for(session_key or "").feedback.remote(
                rating, text, None, session_key, tenant)]
        else:
            hubs = [self.pipeline.hub_for(session_key)] if session_key else self.pipeline.hubs
            refs = [h.feedback.remote(rating, text, response_id, None, tenant) for h in hubs]
        return await first_known(refs, self.feedback_wait_s)


async def first_known(answers: list[Any], wait_s: float) -> dict[str, Any]:
    """The first of the hubs' ``answers`` (awaitables) that knows the turn ("applied" or
    "sealed": a turn lives in one hub), without waiting for the rest; "unknown" once every hub
    said so. ``HubUnavailable`` when, after ``wait_s``, no hub that answered knew it and some
    have not answered (a hub restarting, or on a lost host)."""
    async def answer(a: Any) -> dict[str, Any]:
        return await a

    tasks = [asyncio.ensure_future(answer(a)) for a in answers]
    unknown: list[dict[str, Any]] = []
    try:
        for next_done in asyncio.as_completed(tasks, timeout=wait_s):
            r = await next_done
            if r["status"] != "unknown":
                return r
            unknown.append(r)
    except asyncio.TimeoutError:
        raise HubUnavailable(f"{len(tasks) - len(unknown)} of {len(tasks)} session hubs did "
                             f"not answer within {wait_s:g} s") from None
    finally:
        for t in tasks:
            t.cancel()
    return unknown[0]


def _log_failure(future: Any, record: TurnRecord) -> None:
    exc = future.exception()
    if exc is not None:
        logger.error("turn %s of session %s (tenant %s) could not reach its session hub: %s",
                     record.record_id, record.session_id, record.tenant, exc)
