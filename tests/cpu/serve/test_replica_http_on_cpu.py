"""``serving.replica_http_port``: the ingress replica serving HTTP itself (uvicorn on the
engine's event loop) next to Serve's path, on the suite's main app (transformers engine):
the same routes, keys, records and answers through either door, and nothing more public."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def own_url(served) -> str:
    """The replica's own HTTP address, as the replica reports it through its handle."""
    from ray import serve

    url = serve.get_app_handle(served.app_name).replica_http_url.remote().result()
    assert url is not None and url.startswith("http://127.0.0.1:")
    return url


def test_the_replica_answers_as_serves_path_does_and_records_the_turn(served, own_url):
    messages = [{"role": "user", "content": "Hello, what is 2+2?"}]
    answers = {}
    for door, base in (("serve", served.base_url), ("own", own_url + "/v1")):
        client = openai.OpenAI(base_url=base, api_key=served.api_key, max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model=served.model, messages=messages, max_tokens=8, temperature=0,
            extra_headers={"X-Session-Id": f"replica-http-{door}"})
        answers[door] = r.choices[0].message.content
        rec = served.records(session_id=f"replica-http-{door}")
        assert len(rec) == 1 and rec[0].record_id == r.id  # recorded token-exactly, once
        assert r.usage.completion_tokens == len(rec[0].response_ids)
    assert answers["own"] == answers["serve"]  # one engine, greedy: the same reply


def test_the_replica_streams_and_speaks_anthropic(served, own_url):
    client = openai.OpenAI(base_url=own_url + "/v1", api_key=served.api_key, max_retries=0,
                           timeout=60)
    chunks = list(client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
        temperature=0, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    msg = anthropic.Anthropic(base_url=own_url, api_key=served.api_key, max_retries=0,
                              timeout=60).messages.create(
        model=served.model, max_tokens=6, messages=[{"role": "user", "content": "hi"}])
    assert msg.type == "message" and msg.stop_reason in ("end_turn", "max_tokens")


def test_the_replicas_door_checks_keys_and_exposes_no_admin_route(served, own_url):
    from ray import serve

    r = httpx.post(own_url + "/v1/chat/completions", json={
        "model": served.model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(own_url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    for path in ("/status", "/set_collecting", "/load_weights", "/v1/status"):
        r = httpx.post(own_url + path, headers={"Authorization": f"Bearer {served.api_key}"})
        assert r.status_code in (404, 405), path
        assert "error" in r.json()  # the API's error object, not Starlette's
    health = httpx.get(own_url + "/healthz").json()
    assert health["instance"] == serve.get_app_handle(served.app_name).instance_id.remote(
        ).result()
