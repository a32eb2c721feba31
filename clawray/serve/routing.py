"""Session-affine routing: a session's turns go to the replica that has its prefix cached.

An agent session resends its whole history on every turn; only the replica that served the
previous turn has it in its prefix cache. ``SessionAffinityRouter`` is a Ray Serve request
router (the public ``ray.serve.request_router`` API, set on the deployment with
``RequestRouterConfig``) that sends every request carrying a ``session_key`` keyword argument
to the same replica: replicas are ranked by rendezvous hashing of (session, replica), so a
session keeps its replica while replicas come and go (only the sessions of a removed replica
move). The preferred replica is the first rank; when it is full, Serve falls through to the
next ranks, so affinity never makes a request wait for one busy replica. Requests without a
key go to the least-loaded of all replicas.

Two places use it:

* ``split`` layout, Ingress → PolicyServer replicas: the ingress passes the session key it
  already resolved for the turn (``X-Session-Id``, OpenClaw's ``session_id`` /
  ``x-session-affinity`` headers, ``prompt_cache_key``, or the derived key;
  ``clawray/serve/session_meta.py``) as the ``session_key`` keyword argument.
* ``colocated`` layout with several ingress replicas (each runs its own engine), Serve proxy →
  Ingress: the proxy cannot read bodies, so the key is the session header the proxy itself
  reads into the request's ``session_id`` metadata: Ray Serve's session header,
  ``x-session-id`` (clawray's own ``X-Session-Id``), or whichever header
  ``RAY_SERVE_SESSION_ID_HEADER_KEY`` names when Ray starts (``x-session-affinity`` for
  OpenClaw's session-affinity option). Requests without it are balanced by load.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

SESSION_KWARG = "session_key"
ROUTER_CLASS = "clawray.serve.routing:SessionAffinityRouter"


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` from most to least preferred for ``key`` (highest random weight)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{rid}".encode(), digest_size=8).digest()

    return sorted(replica_ids, key=weight, reverse=True)


def session_key_of(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None:
        return None
    key: Any = (pending_request.kwargs or {}).get(SESSION_KWARG)
    if not (isinstance(key, str) and key):  # through the Serve proxy: its session header
        key = getattr(getattr(pending_request, "metadata", None), "session_id", None)
    return key if isinstance(key, str) and key else None


class SessionAffinityRouter(FIFOMixin, RequestRouter):
    """Ranks: [the session's replica], then the others in the session's order."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        key = session_key_of(pending_request)
        if key is None:
            return [list(candidate_replicas)]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = rendezvous_order(key, list(by_id))
        return [[by_id[order[0]]], [by_id[rid] for rid in order[1:]]] if len(order) > 1 \
            else [[by_id[order[0]]]]
