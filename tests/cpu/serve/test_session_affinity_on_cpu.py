"""Session-affine routing on a real Serve app (clawray/serve/routing.py): the split layout with
two PolicyServer replicas, and the colocated layout with two ingress replicas behind the Serve
proxy, send every turn of a session to one replica."""

from __future__ import annotations

import itertools
from typing import Any, Callable

import openai
import pytest

from tests.support.common import API_KEY

pytestmark = pytest.mark.ray
SESSIONS = 12
TURNS = 3


def _replicas(serve, status, replica_sessions) -> dict[str, dict[str, int]]:
    """Each replica's id (``Deployment#unique_id``) and served sessions, from status calls:
    they carry no session and reach either replica."""
    seen: dict[str, dict[str, int]] = {}
    for _ in range(10):
        for response in [status(serve) for _ in range(16)]:
            rid, counts = replica_sessions(response.result())
            seen[rid] = counts
        if len(seen) == 2:
            break
    assert len(seen) == 2, seen
    return seen


def spread_sessions(prefix: str, replicas: set[str], routing_key: Callable[[str], str]):
    """``SESSIONS`` session ids, half of them preferred by each replica under the router's
    rendezvous hashing (clawray/serve/routing.py), and the replica each prefers. Replica ids
    are new on every run: twelve fixed ids would all go to one replica in one run of 2,048."""
    from clawray.serve.routing import rendezvous_order

    unique = {rid.split("#", 1)[1]: rid for rid in replicas}  # the router's ids
    chosen: dict[str, str] = {}
    per = dict.fromkeys(replicas, 0)
    for i in itertools.count():
        sid = f"{prefix}-{i}"
        home = unique[rendezvous_order(routing_key(sid), list(unique))[0]]
        if per[home] < SESSIONS // 2:
            per[home] += 1
            chosen[sid] = home
        if len(chosen) == SESSIONS:
            return chosen


def check_sessions_stay_on_one_replica(served, app: str, prefix: str, status: Callable[[Any], Any],
                                       replica_sessions: Callable[[Any], tuple[str, dict]],
                                       routing_key: Callable[[str], str]):
    """Replay ``SESSIONS`` sessions of ``TURNS`` turns through the Serve proxy with
    X-Session-Id, then read each replica's served sessions from its status (``status(handle)``
    → a response; ``replica_sessions(result)`` → (replica id, {session key: requests}));
    ``routing_key(session id)`` is the key the router hashes."""
    from ray import serve

    client = openai.OpenAI(base_url=served.base_url.replace("/v1", f"/{app}/v1"),
                           api_key=API_KEY, max_retries=0)
    homes = spread_sessions(prefix, set(_replicas(serve, status, replica_sessions)),
                            routing_key)
    sessions = list(homes)
    for turn in range(TURNS):
        for sid in sessions:
            client.chat.completions.create(
                model=served.model, max_tokens=2, extra_headers={"X-Session-Id": sid},
                messages=[{"role": "user", "content": f"turn {turn} of {sid}"}])
    seen = _replicas(serve, status, replica_sessions)
    for sid in sessions:
        key = tenant_session_key(sid)  # the replicas count a tenant's sessions
        holders = {rid: counts[key] for rid, counts in seen.items() if key in counts}
        assert holders == {homes[sid]: TURNS}, (sid, homes[sid], seen)  # its replica only
    assert all(seen.values())  # the sessions are spread, not all on one replica


def tenant_session_key(sid: str) -> str:
    from clawray.records import session_key
    from clawray.serve.auth import tenant_of_key

    return session_key(tenant_of_key(API_KEY), None, sid)


def test_every_turn_of_a_session_lands_on_one_policy_replica(served, tmp_path_factory):
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.serve.app import build_app

    app = "affinity"
    cfg = ClawRayConfig().inference(engine="hf").serving(
        api_keys=[API_KEY], record_sink=["jsonl"], layout="split", policy_replicas=2,
        replica_num_cpus=0.5, default_max_tokens=2,
        records_path=str(tmp_path_factory.mktemp(app) / "turns.jsonl"))
    serve.run(build_app(cfg), name=app, route_prefix=f"/{app}")
    try:
        check_sessions_stay_on_one_replica(
            served, app, "aff",
            lambda s: s.get_deployment_handle("PolicyServer", app_name=app).status.remote(),
            lambda st: (st.extra["replica"], st.extra["sessions"]),
            tenant_session_key)  # the ingress passes the session key it resolved
    finally:
        serve.delete(app)


def test_colocated_replicas_keep_a_session_by_the_header_the_serve_proxy_reads(
        served, tmp_path_factory):
    # Two ingress replicas, each with its own engine (a fixed-latency one: routing is the
    # subject, not generation), requests through the Serve proxy with X-Session-Id.
    # Measured with affinity off: sessions split over both replicas ([1, 2] turns).
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.serve.app import build_app

    app = "affinity-colocated"
    cfg = (ClawRayConfig().inference(engine="fixed_latency", fixed_latency_s=0.001)
           .serving(api_keys=[API_KEY], record_sink=["jsonl"], ingress_replicas=2,
                    replica_num_cpus=0.25, default_max_tokens=2,
                    records_path=str(tmp_path_factory.mktemp(app) / "turns.jsonl")))
    serve.run(build_app(cfg), name=app, route_prefix=f"/{app}")
    try:
        check_sessions_stay_on_one_replica(
            served, app, "col",
            lambda s: s.get_deployment_handle("Ingress", app_name=app).status.remote(),
            lambda st: (st["replica"], st["sessions"]),
            lambda sid: sid)  # the proxy passes the X-Session-Id header as it came
    finally:
        serve.delete(app)
