import json

import pytest

from clawray.records import session_key, tenant_prefix
from clawray.serve.auth import LOCAL_TENANT, KeyChecker, tenant_of_key
from clawray.serve.protocol import APIError, normalize_messages, normalize_tools, parse_request
from clawray.serve.session_meta import derive_session_key, session_meta


def _parse(body):
    return parse_request(json.dumps(body).encode())


@pytest.mark.parametrize(
    "raw, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "m"}).encode(), 400, "'messages' is required"),
        (json.dumps({"messages": []}).encode(), 400, "messages"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}],
                     "tools": [{"type": "function", "function": {}}]}).encode(), 400, "tools"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}],
                     "tools": [{"type": "retrieval"}]}).encode(), 400, "tools"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(),
         400, "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [""]}).encode(),
         400, "stop"),
    ],
)
def test_bad_bodies_become_precise_api_errors(raw, status, needle):
    with pytest.raises(APIError) as e:
        parse_request(raw)
    assert e.value.status == status
    assert needle in e.value.message
    body = e.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


def test_session_fields_are_stripped_from_the_body():
    req, fields = _parse({"messages": [{"role": "user", "content": "hi"}], "session_id": "s",
                          "turn_type": "side", "session_done": "yes", "prompt_cache_key": "k"})
    assert fields == {"session_id": "s", "turn_type": "side", "session_done": "yes",
                      "prompt_cache_key": "k"}
    assert "session_id" not in req.model_dump()


def test_normalize_maps_developer_parts_and_tool_arguments():
    req, _ = _parse({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{\"path\":\".\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"},
    ]})
    msgs = normalize_messages(req.messages)
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[1]["content"] == "ab"
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"path": "."}
    assert msgs[3] == {"role": "tool", "content": "x", "tool_call_id": "c1"}


def test_image_parts_are_rejected_not_dropped():
    req, _ = _parse({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]})
    with pytest.raises(APIError, match="image_url"):
        normalize_messages(req.messages)


def test_tools_roundtrip():
    req, _ = _parse({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
    assert normalize_tools(req.tools) == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_session_meta_precedence_and_flags():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    m = session_meta({"x-session-id": "h", "session_id": "aff"}, {"session_id": "b"}, msgs, "main")
    assert (m.session_id, m.source) == ("h", "header")
    m = session_meta({"session_id": "aff1:0", "x-session-affinity": "aff1:0"},
                     {"prompt_cache_key": "aff1:0"}, msgs, "main")
    assert (m.session_id, m.source) == ("aff1:0", "header")
    m = session_meta({}, {"prompt_cache_key": "k"}, msgs, "side")
    assert (m.session_id, m.source, m.turn_type) == ("k", "prompt_cache_key", "side")
    for v in ("1", "true", "YES", "on", True):
        assert session_meta({"x-session-done": v} if isinstance(v, str) else {},
                            {} if isinstance(v, str) else {"session_done": v}, msgs, "main").session_done
    assert not session_meta({"x-session-done": "no"}, {}, msgs, "main").session_done
    assert session_meta({"x-turn-type": "heartbeat"}, {}, msgs, "main").turn_type == "side"


def test_derived_session_key_is_stable_over_turns_and_distinct_across_conversations():
    t1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "first"}]
    t2 = t1 + [{"role": "assistant", "content": "r"}, {"role": "user", "content": "second"}]
    other = [{"role": "system", "content": "S"}, {"role": "user", "content": "different"}]
    assert derive_session_key(t1) == derive_session_key(t2)
    assert derive_session_key(t1) != derive_session_key(other)
    assert session_meta({}, {}, t1, "main").source == "derived"


def test_key_checker_returns_the_tenant_of_the_matching_key():
    kc = KeyChecker.of_keys(["k1", "k2", "k3"])
    assert kc.check({"authorization": "Bearer k2"}) == tenant_of_key("k2")
    assert kc.check({"x-api-key": "k1"}) == tenant_of_key("k1")
    assert kc.check({"authorization": "bearer k3"}) == tenant_of_key("k3")
    assert len({tenant_of_key(k) for k in ("k1", "k2", "k3")}) == 3
    assert "k2" not in tenant_of_key("k2") and tenant_of_key("k2").startswith("key-")
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k1"},
                    {"authorization": "Bearer k"}, {"authorization": "Bearer k12"}):
        with pytest.raises(APIError) as e:
            kc.check(headers)
        assert e.value.status == 401
    assert KeyChecker([]).check({}) == LOCAL_TENANT  # auth off: one tenant


def test_sessions_are_namespaced_by_tenant_and_user():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    a = session_meta({"x-session-id": "s1"}, {}, msgs, "main", tenant="key-a")
    b = session_meta({"x-session-id": "s1"}, {}, msgs, "main", tenant="key-b")
    # the client's id is kept as sent; the pipeline's key differs per tenant
    assert a.session_id == b.session_id == "s1" and a.key != b.key
    # users of one key (a proxy): their own namespaces, from the body or a header
    u1 = session_meta({"x-session-id": "s1"}, {"user": "u1"}, msgs, "main", tenant="key-a")
    u2 = session_meta({"x-session-id": "s1", "x-user-id": "u2"}, {}, msgs, "main",
                      tenant="key-a")
    assert (u1.user, u2.user) == ("u1", "u2") and len({a.key, u1.key, u2.key}) == 3
    assert all(m.key.startswith(tenant_prefix("key-a")) for m in (a, u1, u2))
    # the same opening ("hi") in two tenants or for two users: different derived sessions
    derived = [session_meta({}, body, msgs, "main", tenant=t).session_id
               for t, body in (("key-a", {}), ("key-b", {}), ("key-a", {"user": "u1"}))]
    assert len(set(derived)) == 3
    # a user id cannot forge another namespace: lengths are spelled out
    assert session_key("t", "a|1:b", "c") != session_key("t", "a", "1:b|c")


@pytest.mark.parametrize("body, param", [
    ({"user": ["u"]}, "user"), ({"session_id": {"a": 1}}, "session_id"),
    ({"session_id": "x" * 501}, "session_id"), ({"user": "x" * 501}, "user")])
def test_bad_session_or_user_ids_are_refused(body, param):
    with pytest.raises(APIError) as e:
        _parse({"messages": [{"role": "user", "content": "x"}], **body})
    assert e.value.status == 400 and e.value.param == param


def test_an_over_long_session_header_is_refused():
    with pytest.raises(APIError) as e:
        session_meta({"x-session-id": "x" * 501}, {}, [{"role": "user", "content": "x"}], "main")
    assert e.value.status == 400 and e.value.param == "session_id"


def test_only_a_trusted_app_picks_the_end_users_policy():
    """Per-user policies: a key marked a trusted app (or no auth) is served by the policy of
    the end user it names; any other key by its own, whatever user it names (the user still
    namespaces its sessions)."""
    msgs = [{"role": "user", "content": "u"}]
    untrusted = session_meta({"x-user-id": "ann"}, {}, msgs, "main", tenant="key-a")
    assert (untrusted.user, untrusted.policy_user) == ("ann", "key-a")
    trusted = session_meta({}, {"user": "ann"}, msgs, "main", tenant="key-a", trusted_app=True)
    assert trusted.policy_user == "key-a/ann" and trusted.key == untrusted.key
    assert session_meta({}, {}, msgs, "main", tenant="key-a", trusted_app=True).policy_user \
        == "key-a"
    # the same user name through another trusted app is another person
    other = session_meta({}, {"user": "ann"}, msgs, "main", tenant="key-b", trusted_app=True)
    assert other.policy_user == "key-b/ann"
