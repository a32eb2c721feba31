"""The Anthropic Messages front door: its requests become the same turns as Chat Completions
(same prompt ids, same session), its answers and streams come in Anthropic's format, and what it
cannot do is refused by name in Anthropic's error shape."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.inference.engine import EngineInternalError, TokenDelta, TokenOutput
from clawray.serve import anthropic_messages as am
from clawray.serve import openai_chat
from clawray.serve.chat import ChatService
from clawray.serve.protocol import APIError, parse_request
from tests.support.common import ListSink

CALL = '<tool_call>{"name": "ls", "arguments": {"path": "/tmp"}}</tool_call>'
ANTHROPIC_TOOLS = [{"name": "ls", "description": "List files.",
                    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "List files.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


class TextPolicy:
    """Answers with the ids of ``text`` (streamed two ids at a time), or fails mid-stream."""

    def __init__(self, tokenizer, text: str, fail_after: int | None = None,
                 stop_string: str | None = None):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.fail_after, self.stop_string = fail_after, stop_string

    async def generate(self, prompt_ids, params, session_key=None):
        return [TokenOutput(list(self.ids), [-0.1] * len(self.ids), "stop", 2,
                            stop_string=self.stop_string, cached_tokens=3)]

    async def stream(self, prompt_ids, params, session_key=None):
        for i in range(0, len(self.ids), 2):
            if self.fail_after is not None and i >= self.fail_after:
                raise EngineInternalError("decode step failed")
            last = i + 2 >= len(self.ids)
            yield TokenDelta(self.ids[i:i + 2], [-0.1] * len(self.ids[i:i + 2]), 2,
                             "stop" if last else None, stop_string=self.stop_string if last
                             else None, cached_tokens=3 if i == 0 else None)

    async def status(self):
        raise NotImplementedError


def service(tokenizer, text, **kw):
    sink = ListSink()
    return ChatService(tokenizer, TextPolicy(tokenizer, text, **kw), "m", 4096,
                       ServingConfig(), sink), sink


def body(**kw):
    return json.dumps({"model": "m", "max_tokens": 32, **kw}).encode()


ANTHROPIC_CONVERSATION = dict(
    system=[{"type": "text", "text": "You are terse."}],
    tools=ANTHROPIC_TOOLS,
    messages=[
        {"role": "user", "content": "list /tmp"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "/tmp"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "a.txt"}]},
            {"type": "text", "text": "and now?"}]},
    ])
OPENAI_CONVERSATION = dict(
    tools=OPENAI_TOOLS,
    messages=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "list /tmp"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "user", "content": "and now?"},
    ])


async def test_a_conversation_is_the_same_turn_in_either_api(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, "ok")
    a = await svc.prepare(am.to_turn_request(am.parse_request(body(**ANTHROPIC_CONVERSATION))),
                          {})
    req, fields = parse_request(json.dumps({"model": "m", **OPENAI_CONVERSATION}).encode())
    o = await svc.prepare(openai_chat.to_turn_request(req, fields), {})
    assert a.prompt_ids == o.prompt_ids and a.messages == o.messages
    assert a.meta.key == o.meta.key  # one derived session, whichever API a client speaks
    assert a.request_id.startswith("msg_")


async def test_metadata_user_id_is_the_end_user(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, "ok")
    turn = await svc.prepare(am.to_turn_request(am.parse_request(body(
        messages=[{"role": "user", "content": "hi"}], metadata={"user_id": "u-7"}))),
        {"x-session-id": "s1"}, tenant="key-abc")
    assert (turn.meta.user, turn.meta.tenant, turn.meta.session_id) == ("u-7", "key-abc", "s1")


async def test_a_message_answers_with_text_and_tool_use_blocks(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer, "Let me look." + CALL)
    req = am.to_turn_request(am.parse_request(body(
        messages=[{"role": "user", "content": "list /tmp"}], tools=ANTHROPIC_TOOLS)))
    turn = await svc.prepare(req, {"x-session-id": "s"})
    out = await am.complete(svc, turn)
    assert out["type"] == "message" and out["role"] == "assistant"
    text, use = out["content"]
    assert text == {"type": "text", "text": "Let me look."}
    assert use["type"] == "tool_use" and use["name"] == "ls" and use["input"] == {"path": "/tmp"}
    assert out["stop_reason"] == "tool_use" and out["stop_sequence"] is None
    [rec] = sink.records
    assert out["usage"] == {"input_tokens": len(rec.prompt_ids) - 3, "output_tokens":
                            len(rec.response_ids), "cache_read_input_tokens": 3,
                            "cache_creation_input_tokens": 0}
    assert rec.tool_calls[0]["id"] == use["id"] and rec.record_id == out["id"]


async def test_a_stop_sequence_is_named(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, "one two", stop_string="END")
    turn = await svc.prepare(am.to_turn_request(am.parse_request(body(
        messages=[{"role": "user", "content": "count"}], stop_sequences=["END"]))), {})
    out = await am.complete(svc, turn)
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "END")


def _events(lines):
    out = []
    for chunk in lines:
        name, data = chunk.strip().split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        out.append(payload)
    return out


async def test_the_stream_has_anthropics_event_sequence_and_the_same_content(tiny_tokenizer):
    text = "Let me look." + CALL
    svc, _ = service(tiny_tokenizer, text)
    req = am.to_turn_request(am.parse_request(body(
        messages=[{"role": "user", "content": "list /tmp"}], tools=ANTHROPIC_TOOLS,
        stream=True)))
    events = _events([x async for x in am.stream(svc, await svc.prepare(req, {}))])
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1]
    streamed = "".join(e["delta"]["text"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta")
    args = "".join(e["delta"]["partial_json"] for e in events
                   if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta")
    whole = await am.complete(svc, await svc.prepare(am.to_turn_request(am.parse_request(body(
        messages=[{"role": "user", "content": "list /tmp"}], tools=ANTHROPIC_TOOLS))), {}))
    assert streamed == whole["content"][0]["text"]
    assert json.loads(args) == whole["content"][1]["input"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    # every block opened is closed, in order
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]


async def test_a_failure_mid_stream_is_an_error_event(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer, "one two three four five six", fail_after=2)
    req = am.to_turn_request(am.parse_request(body(
        messages=[{"role": "user", "content": "count"}], stream=True)))
    events = _events([x async for x in am.stream(svc, await svc.prepare(req, {}))])
    assert events[-1] == {"type": "error", "error": {
        "type": "api_error", "message": events[-1]["error"]["message"]}}
    assert "decode step failed" in events[-1]["error"]["message"]
    assert sink.records[0].finish_reason == "abort"


@pytest.mark.parametrize("extra, param", [
    ({"top_k": 5}, "top_k"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "messages.0.content.0.type"),
    ({"temperature": 1.5}, "temperature"),
    ({"max_tokens": None}, "max_tokens"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search",
                 "input_schema": {}}]}, "tools.0.type"),
])
def test_what_is_not_supported_is_refused_by_name(extra, param):
    data = {"messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(APIError) as e:
        am.to_turn_request(am.parse_request(body(**data)))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    err = am.error_body(e.value)
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"


def test_required_fields_are_named():
    with pytest.raises(APIError) as e:
        am.parse_request(json.dumps({"model": "m", "messages": []}).encode())
    assert e.value.param == "max_tokens"


@pytest.mark.parametrize("status, kind", [(401, "authentication_error"), (404, "not_found_error"),
                                          (429, "rate_limit_error"), (503, "overloaded_error"),
                                          (500, "api_error"), (413, "request_too_large")])
def test_errors_take_anthropics_types(status, kind):
    assert am.error_body(APIError(status, "x"))["error"]["type"] == kind


class StopAwarePolicy(TextPolicy):
    """Answers with two tool calls, or, asked to stop at "</tool_call>", with the first only
    (as an engine does: the stop string's ids are part of the output)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, "ok " + CALL + CALL)
        self.tokenizer, self.full = tokenizer, "ok " + CALL + CALL

    async def generate(self, prompt_ids, params, session_key=None):
        self.seen = params.stop
        text, stop = self.full, None
        if "</tool_call>" in params.stop:
            text, stop = "ok " + CALL, "</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return [TokenOutput(ids, [-0.1] * len(ids), "stop", 2, stop_string=stop)]


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_one_tool_call_at_most_when_parallel_calls_are_off(tiny_tokenizer, api):
    policy = StopAwarePolicy(tiny_tokenizer)
    svc = ChatService(tiny_tokenizer, policy, "m", 4096, ServingConfig(), ListSink())
    for parallel, calls in ((True, 2), (False, 1)):
        if api == "chat":
            req, fields = parse_request(json.dumps({
                "model": "m", "messages": [{"role": "user", "content": "ls"}],
                "tools": OPENAI_TOOLS, "parallel_tool_calls": parallel, "stop": ["END"]})
                .encode())
            turn = await svc.prepare(openai_chat.to_turn_request(req, fields), {})
            out = await openai_chat.complete(svc, turn)
            choice = out["choices"][0]
            assert len(choice["message"]["tool_calls"]) == calls
            assert choice["finish_reason"] == "tool_calls"
        else:
            req = am.to_turn_request(am.parse_request(body(
                messages=[{"role": "user", "content": "ls"}], tools=ANTHROPIC_TOOLS,
                stop_sequences=["END"],
                tool_choice={"type": "auto", "disable_parallel_tool_use": not parallel})))
            out = await am.complete(svc, await svc.prepare(req, {}))
            assert sum(b["type"] == "tool_use" for b in out["content"]) == calls
            # our own stop is not the client's stop sequence
            assert (out["stop_reason"], out["stop_sequence"]) == ("tool_use", None)
        assert ("</tool_call>" in policy.seen) == (not parallel)
        assert "END" in policy.seen
