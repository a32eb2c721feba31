"""Session-affine routing: rendezvous hashing keeps a session on one replica, spreads
sessions over replicas, and moves only a removed replica's sessions."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

from clawray.serve.routing import (
    SESSION_KWARG,
    SessionAffinityRouter,
    rendezvous_order,
    session_key_of,
)

REPLICAS = [f"replica-{i}" for i in range(4)]


def test_a_session_always_prefers_the_same_replica_whatever_the_listing_order():
    for key in ("s1", "openclaw:abc", "x" * 300):
        first = rendezvous_order(key, REPLICAS)
        assert sorted(first) == sorted(REPLICAS)
        assert rendezvous_order(key, list(reversed(REPLICAS))) == first


def test_sessions_spread_over_replicas():
    counts = Counter(rendezvous_order(f"session-{i}", REPLICAS)[0] for i in range(400))
    assert set(counts) == set(REPLICAS)
    assert max(counts.values()) < 2 * min(counts.values())


def test_removing_a_replica_moves_only_its_sessions():
    keys = [f"session-{i}" for i in range(200)]
    before = {k: rendezvous_order(k, REPLICAS)[0] for k in keys}
    after = {k: rendezvous_order(k, REPLICAS[:-1])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == REPLICAS[-1] for k in moved)


def _replica(rid):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=rid))


def test_the_router_ranks_the_sessions_replica_first_then_the_rest():
    replicas = [_replica(r) for r in REPLICAS]
    request = SimpleNamespace(kwargs={SESSION_KWARG: "s1"})
    ranks = asyncio.run(SessionAffinityRouter.choose_replicas(None, replicas, request))
    order = rendezvous_order("s1", REPLICAS)
    assert [r.replica_id.unique_id for r in ranks[0]] == order[:1]
    assert [r.replica_id.unique_id for r in ranks[1]] == order[1:]
    # No key: one rank of every replica (Serve then takes the least loaded).
    plain = asyncio.run(SessionAffinityRouter.choose_replicas(
        None, replicas, SimpleNamespace(kwargs={})))
    assert plain == [replicas]
    assert session_key_of(None) is None and session_key_of(SimpleNamespace(kwargs={
        SESSION_KWARG: ""})) is None


def test_through_the_serve_proxy_the_key_is_the_session_header_it_read():
    # Colocated layout: the proxy puts its session header (x-session-id by default) into the
    # request metadata; the ingress's own resolved key (split layout) takes precedence.
    replicas = [_replica(r) for r in REPLICAS]
    via_proxy = SimpleNamespace(kwargs={}, metadata=SimpleNamespace(session_id="s7"))
    assert session_key_of(via_proxy) == "s7"
    ranks = asyncio.run(SessionAffinityRouter.choose_replicas(None, replicas, via_proxy))
    assert [r.replica_id.unique_id for r in ranks[0]] == rendezvous_order("s7", REPLICAS)[:1]
    both = SimpleNamespace(kwargs={SESSION_KWARG: "s1"}, metadata=SimpleNamespace(session_id="s7"))
    assert session_key_of(both) == "s1"
    assert session_key_of(SimpleNamespace(kwargs={}, metadata=SimpleNamespace(session_id=""))) \
        is None
