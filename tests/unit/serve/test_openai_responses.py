"""The Responses front door: input items become the same turn as Chat Completions, a chain of
``previous_response_id`` is one conversation and one session of the key that made it, the
stream has the Responses event sequence, and what is not supported is refused by name."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.serve import openai_chat
from clawray.serve import openai_responses as orr
from clawray.serve.chat import ChatService
from clawray.serve.protocol import APIError, parse_request
from clawray.serve.response_store import LocalStore, ResponseStoreCore
from tests.unit.serve.test_anthropic_messages import CALL, OPENAI_TOOLS, TextPolicy
from tests.support.common import ListSink

TOOLS = [{"type": "function", "name": "ls", "description": "List files.",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]


def service(tokenizer, text, **kw):
    sink = ListSink()
    return ChatService(tokenizer, TextPolicy(tokenizer, text, **kw), "m", 4096,
                       ServingConfig(), sink), sink


def req_of(**kw):
    return orr.parse_request(json.dumps({"model": "m", **kw}).encode())


async def turn_of(svc, kept, tenant="key-a", headers=None, **kw):
    req = req_of(**kw)
    history, chain = [], None
    if req.previous_response_id:
        prev = await kept.history(req.previous_response_id, tenant)
        if "error" in prev:
            raise APIError(400, prev["error"], param="previous_response_id")
        history, chain = prev["messages"], prev["session_id"]
    turn = await svc.prepare(orr.to_turn_request(req, history, chain), headers or {}, tenant)
    return req, turn


async def test_input_items_are_the_same_turn_as_chat_completions(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, "ok")
    _, turn = await turn_of(svc, LocalStore(10), instructions="You are terse.", tools=TOOLS,
                            input=[
        {"role": "user", "content": "list /tmp"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "call_id": "toolu_1", "name": "ls",
         "arguments": '{"path": "/tmp"}'},
        {"type": "function_call_output", "call_id": "toolu_1", "output": "a.txt"},
        {"role": "user", "content": [{"type": "input_text", "text": "and now?"}]}])
    from tests.unit.serve.test_anthropic_messages import OPENAI_CONVERSATION

    req, fields = parse_request(json.dumps({"model": "m", **OPENAI_CONVERSATION}).encode())
    chat = await svc.prepare(openai_chat.to_turn_request(req, fields), {}, "key-a")
    assert turn.prompt_ids == chat.prompt_ids and turn.meta.key == chat.meta.key
    assert turn.request_id.startswith("resp_")


async def test_a_chain_is_one_conversation_and_one_session(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer, "Let me look." + CALL)
    store = LocalStore(10)
    req, turn = await turn_of(svc, store, instructions="Be brief.", tools=TOOLS,
                              input="list /tmp", headers={"x-session-id": "chain-1"})
    first = await orr.complete(svc, turn, req, store)
    [msg, call] = first["output"]
    assert msg["content"][0]["text"] == "Let me look." and call["type"] == "function_call"
    assert json.loads(call["arguments"]) == {"path": "/tmp"}
    # the next request sends only the tool's output; the server supplies the rest
    req2, turn2 = await turn_of(svc, store, instructions="Be brief.", tools=TOOLS,
                                previous_response_id=first["id"], input=[
        {"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt"}])
    assert turn2.meta.session_id == "chain-1" and turn2.meta.source == "previous_response"
    assert [m["role"] for m in turn2.messages] == ["system", "user", "assistant", "tool"]
    assert turn2.messages[2]["tool_calls"][0]["function"]["arguments"] == {"path": "/tmp"}
    # and it is token for token what a client resending the whole history would get
    req3, turn3 = await turn_of(svc, store, instructions="Be brief.", tools=TOOLS, input=[
        {"role": "user", "content": "list /tmp"},
        {"role": "assistant", "content": "Let me look."},
        {"type": "function_call", "call_id": call["call_id"], "name": "ls",
         "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt"}])
    assert turn2.prompt_ids == turn3.prompt_ids
    second = await orr.complete(svc, turn2, req2, store)
    assert second["previous_response_id"] == first["id"]
    assert [r.session_id for r in sink.records] == ["chain-1", "chain-1"]


async def test_another_key_cannot_continue_read_or_delete_a_response(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, "hello")
    store = LocalStore(10)
    req, turn = await turn_of(svc, store, input="hi")
    body = await orr.complete(svc, turn, req, store)
    assert await store.get(body["id"], "key-a") == body
    assert await store.get(body["id"], "key-b") is None
    assert (await store.history(body["id"], "key-b")) == {"error": "not_found"}
    assert not await store.delete(body["id"], "key-b")
    assert await store.delete(body["id"], "key-a")
    assert await store.get(body["id"], "key-a") is None


async def test_store_false_keeps_nothing(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, "hello")
    store = LocalStore(10)
    req, turn = await turn_of(svc, store, input="hi", store=False)
    body = await orr.complete(svc, turn, req, store)
    assert await store.get(body["id"], "key-a") is None


def test_the_store_is_bounded_and_says_when_a_chain_was_evicted():
    store = ResponseStoreCore(max_entries=2)
    store.put("r1", "t", None, [{"role": "user", "content": "a"}], "s", {})
    store.put("r2", "t", "r1", [{"role": "user", "content": "b"}], "s", {})
    assert [m["content"] for m in store.history("r2", "t")["messages"]] == ["a", "b"]
    store.put("r3", "t", "r2", [{"role": "user", "content": "c"}], "s", {})
    assert len(store) == 2
    assert store.history("r3", "t") == {"error": "expired"}  # r1 was dropped
    assert store.history("r1", "t") == {"error": "not_found"}


def _events(lines):
    out = []
    for chunk in lines:
        name, data = chunk.strip().split("\n")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append(payload)
    return out


async def test_the_stream_has_the_responses_event_sequence(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, "Let me look." + CALL)
    store = LocalStore(10)
    req, turn = await turn_of(svc, store, tools=TOOLS, input="list /tmp", stream=True)
    events = _events([x async for x in orr.stream(svc, turn, req, store)])
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text == "Let me look."
    assert final["output"][1]["arguments"] == done["arguments"]
    assert json.loads(done["arguments"]) == {"path": "/tmp"}
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    closed = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == closed == [0, 1]
    # the streamed response is stored like a whole one
    assert (await store.get(final["id"], "key-a"))["output"] == final["output"]


async def test_a_failure_mid_stream_is_an_error_event(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer, "one two three four five six", fail_after=2)
    store = LocalStore(10)
    req, turn = await turn_of(svc, store, input="count", stream=True)
    events = _events([x async for x in orr.stream(svc, turn, req, store)])
    assert events[-1]["type"] == "error" and "decode step failed" in events[-1]["message"]
    assert sink.records[0].finish_reason == "abort"


@pytest.mark.parametrize("extra, param", [
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
])
def test_what_is_not_supported_is_refused_by_name(extra, param):
    with pytest.raises(APIError) as e:
        r = req_of(**{"input": "hi", **extra})
        orr.to_turn_request(r, [], None)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_null_is_the_default():
    r = req_of(input="hi", temperature=None, reasoning=None, tools=None, store=None)
    assert (r.temperature, r.store, r.tools) == (1.0, True, None)


def test_openai_tools_match():
    assert orr.to_turn_request(req_of(input="x", tools=TOOLS), [], None).tools == [
        {"type": "function", "function": {**OPENAI_TOOLS[0]["function"]}}]
