"""A reasoning model's ``<think>…</think>`` comes apart from its answer in every API — Chat
Completions' ``reasoning_content``, a Responses ``reasoning`` item, an Anthropic ``thinking``
block — streamed and whole alike, while the record keeps the exact ids of both."""

from __future__ import annotations

import json

from clawray.config import ServingConfig
from clawray.serve import anthropic_messages as am
from clawray.serve import openai_chat
from clawray.serve import openai_responses as orr
from clawray.serve.chat import ChatService
from clawray.serve.protocol import parse_request
from clawray.serve.response_store import LocalStore
from tests.support.common import ListSink
from tests.unit.serve.test_anthropic_messages import CALL, TextPolicy

REPLY = "<think>\nThe user wants files.\n</think>\n\nLet me look." + CALL
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


def service(tokenizer, parser="auto"):
    sink = ListSink()
    cfg = ServingConfig(reasoning_parser=parser)
    return ChatService(tokenizer, TextPolicy(tokenizer, REPLY), "m", 4096, cfg, sink), sink


async def chat_turn(svc, stream):
    req, fields = parse_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "ls"}], "tools": TOOLS,
        "stream": stream}).encode())
    return await svc.prepare(openai_chat.to_turn_request(req, fields), {})


async def test_chat_completions_carry_reasoning_content(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer)  # the embedded tokenizer has <think> tokens: auto = on
    body = await openai_chat.complete(svc, await chat_turn(svc, False))
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "\nThe user wants files.\n"
    assert msg["content"] == "Let me look." and msg["tool_calls"][0]["function"]["name"] == "ls"
    lines = [x async for x in openai_chat.stream(svc, await chat_turn(svc, True))]
    deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    # the record keeps every sampled id, reasoning included; its text is the answer's
    ids = tiny_tokenizer.encode(REPLY, add_special_tokens=False)
    assert all(r.response_ids == ids and r.response_text == "Let me look."
               for r in sink.records)


async def test_the_parser_can_be_switched_off(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer, parser="none")
    body = await openai_chat.complete(svc, await chat_turn(svc, False))
    msg = body["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"].startswith("<think>")


async def test_messages_carry_a_thinking_block(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer)
    req = am.to_turn_request(am.parse_request(json.dumps({
        "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "ls"}],
        "thinking": {"type": "enabled", "budget_tokens": 32},
        "tools": [{"name": "ls", "input_schema": {"type": "object"}}]}).encode()))
    out = await am.complete(svc, await svc.prepare(req, {}))
    assert [b["type"] for b in out["content"]] == ["thinking", "text", "tool_use"]
    assert out["content"][0]["thinking"] == "\nThe user wants files.\n"
    req.stream = True
    lines = [x async for x in am.stream(svc, await svc.prepare(req, {}))]
    events = [json.loads(x.split("\n")[1][6:]) for x in lines]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    thinking = "".join(e["delta"]["thinking"] for e in events
                       if e["type"] == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta")
    assert thinking == out["content"][0]["thinking"]
    # a thinking block sent back is the assistant message's reasoning
    back = am.to_turn_request(am.parse_request(json.dumps({
        "model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "ls"},
            {"role": "assistant", "content": out["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id":
                                          out["content"][2]["id"], "content": "a"}]}]})
        .encode()))
    assert back.messages[1]["reasoning_content"] == thinking


async def test_responses_carry_a_reasoning_item(tiny_tokenizer):
    svc, _ = service(tiny_tokenizer)
    store = LocalStore(10)
    body = json.dumps({"model": "m", "input": "ls", "tools": [
        {"type": "function", "name": "ls", "parameters": {"type": "object"}}]}).encode()
    req = orr.parse_request(body)
    turn = await svc.prepare(orr.to_turn_request(req, [], None), {})
    out = await orr.complete(svc, turn, req, store)
    assert [i["type"] for i in out["output"]] == ["reasoning", "message", "function_call"]
    assert out["output"][0]["content"][0] == {"type": "reasoning_text",
                                              "text": "\nThe user wants files.\n"}
    req.stream = True
    lines = [x async for x in orr.stream(svc, await svc.prepare(
        orr.to_turn_request(req, [], None), {}), req, store)]
    events = [json.loads(x.split("\n")[1][6:]) for x in lines]
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    final = events[-1]["response"]
    assert text == final["output"][0]["content"][0]["text"] == "\nThe user wants files.\n"
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    # reasoning items sent back attach to the assistant reply they preceded
    again = orr.to_turn_request(orr.parse_request(json.dumps({
        "model": "m", "input": [{"role": "user", "content": "ls"}, *out["output"],
                                {"type": "function_call_output",
                                 "call_id": out["output"][2]["call_id"], "output": "a"}]})
        .encode()), [], None)
    [reply] = [m for m in again.messages if m["role"] == "assistant"]
    assert reply["reasoning_content"] == "\nThe user wants files.\n"
    assert reply["content"] == "Let me look." and reply["tool_calls"]
