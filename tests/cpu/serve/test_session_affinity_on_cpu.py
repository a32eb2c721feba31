"""Session-affine routing on a real Serve app: the split layout with two PolicyServer
replicas sends every turn of a session to one replica (clawray/serve/routing.py)."""

from __future__ import annotations

import openai
import pytest

from tests.support.common import API_KEY

pytestmark = pytest.mark.ray
APP = "affinity"


def test_every_turn_of_a_session_lands_on_one_policy_replica(served, tmp_path_factory):
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.records import session_key
    from clawray.serve.app import build_app
    from clawray.serve.auth import tenant_of_key

    cfg = ClawRayConfig().serving(
        api_keys=[API_KEY], record_sink=["jsonl"], layout="split", policy_replicas=2,
        replica_num_cpus=0.5, default_max_tokens=2,
        records_path=str(tmp_path_factory.mktemp(APP) / "turns.jsonl"))
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    try:
        client = openai.OpenAI(base_url=served.base_url.replace("/v1", f"/{APP}/v1"),
                               api_key=API_KEY, max_retries=0)
        sessions = [f"aff-{i}" for i in range(12)]
        for turn in range(3):
            for sid in sessions:
                client.chat.completions.create(
                    model=served.model, max_tokens=2, extra_headers={"X-Session-Id": sid},
                    messages=[{"role": "user", "content": f"turn {turn} of {sid}"}])
        handle = serve.get_deployment_handle("PolicyServer", app_name=APP)
        seen: dict[str, dict[str, int]] = {}
        for _ in range(10):  # status calls carry no session: they reach either replica
            for response in [handle.status.remote() for _ in range(16)]:
                st = response.result()
                seen[st.extra["replica"]] = st.extra["sessions"]
            if len(seen) == 2:
                break
        assert len(seen) == 2, seen
        for sid in sessions:
            key = session_key(tenant_of_key(API_KEY), None, sid)  # routed per tenant's session
            holders = {rid: counts[key] for rid, counts in seen.items() if key in counts}
            assert list(holders.values()) == [3], (sid, seen)
        assert all(seen.values())  # 12 sessions are spread, not all on one replica
    finally:
        serve.delete(APP)
