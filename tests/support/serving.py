"""The suite's Serve apps on the shared cluster (one Serve instance, started by the first)."""

from __future__ import annotations

from tests.support.common import API_KEY, OTHER_KEY, Served, free_port

# The idle timeout of test apps whose sessions all end with X-Session-Done. A turn is judged by
# the user's next message only if that reaches the hub within the idle timeout of the turn
# before; 2 s (these apps' old setting) is about one generation on a loaded two-core machine,
# and a turn finalized without its next state trains on nothing. Nothing waits for it.
DONE_SESSIONS_IDLE_S = 120


def serve_app(name: str, route: str, tmp_path_factory, serving: dict | None = None,
              **inference) -> Served:
    """One clawray app on the shared Serve instance (started by the first call); ``serving``:
    settings of its serving section beyond the suite's."""
    from ray import serve

    from clawray.config import ClawRayConfig
    from clawray.serve.app import build_app
    from clawray.serve.auth import tenant_of_key

    if not hasattr(serve_app, "port"):
        serve_app.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": serve_app.port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
    records = tmp_path_factory.mktemp(f"records-{name}") / "turns.jsonl"
    samples = tmp_path_factory.mktemp(f"samples-{name}")
    # API_KEY is a trusted app (it may name the end user whose policy serves it), OTHER_KEY
    # not; the engine serves up to 4 per-user adapters (none loaded unless a test publishes).
    cfg = (ClawRayConfig()
           .inference(**{"engine": "hf", "max_running": 16, "max_loras": 4, **inference})
           .serving(api_keys=[API_KEY, OTHER_KEY], record_sink=["jsonl", "hub"], records_path=str(records),
                    max_body_bytes=400_000, max_tokens_limit=100_000, default_max_tokens=32,
                    trusted_app_tenants=[tenant_of_key(API_KEY)], **(serving or {}))
           # idle 20 s: a multi-turn test's next turn (a generation or two, a feedback call)
           # must reach the hub within it on a loaded machine, or its turn is not judged
           .sessions(num_hubs=2, idle_timeout_s=20, feedback_window_s=3, flush_interval_s=0.2)
           .judge(num_voters=2, timeout_s=20)
           .buffer(path=str(samples), seal_age_s=0.2))
    serve.run(build_app(cfg), name=name, route_prefix=route)
    base = f"http://127.0.0.1:{serve_app.port}{route.rstrip('/')}/v1"
    return Served(base, API_KEY, "clawray-tiny", records, name, samples, cfg)


def side_app(served: Served, cfg, name: str):
    """Run ``cfg`` as app ``name`` (route ``/name``) on the suite's Serve instance; an openai
    client for it with ``API_KEY``."""
    import openai
    from ray import serve

    from clawray.serve.app import build_app

    serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
    port = served.base_url.split(":")[2].split("/")[0]
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{name}/v1", api_key=API_KEY,
                         max_retries=0, timeout=60)


def chat_session(client, turns: int, user: str | None = None) -> str:
    """One session of ``turns`` turns, each answered "Thanks, perfect." (the heuristic judge
    scores it +1), the last marked done; its session id."""
    import uuid

    sid = f"s-{uuid.uuid4().hex[:10]}"
    msgs = [{"role": "user", "content": "hello there"}]
    for t in range(turns):
        r = client.chat.completions.create(
            model="clawray-tiny", messages=msgs, max_tokens=8,
            extra_headers={"X-Session-Id": sid,
                           **({"X-Session-Done": "1"} if t == turns - 1 else {})},
            **({"user": user} if user else {}))
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "Thanks, perfect."}]
    return sid
