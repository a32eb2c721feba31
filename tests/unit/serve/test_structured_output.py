"""Constrained decoding on the embedded model through the transformers engine (xgrammar):
a ``json_schema`` answer always parses and validates, ``tool_choice: required`` always yields
calls of declared tools whose arguments match their schemas, a named tool choice calls exactly
that tool, and each API's spelling reaches the same constraint. The same requests against
vLLM's structured outputs are in tests/cpu/serve/test_client_apis_on_cpu.py."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.inference.hf_engine import HFEngine
from clawray.serve import anthropic_messages as am
from clawray.serve import openai_chat
from clawray.serve import openai_responses as orr
from clawray.serve.chat import ChatService
from clawray.serve.policy_server import LocalPolicy
from clawray.serve.protocol import APIError, parse_request
from clawray.serve.response_store import LocalStore
from clawray.serve.structured import OutputFormat, ToolChoice, structural_tag, tool_choice_of
from tests.support.common import ListSink

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "pets"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                         "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                         "b": {"type": "integer", "minimum": -99, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PROMPTS = ["Tell me about Ann.", "hi", "What's the weather in Oslo?", "Add 2 and 3.",
           "Write a poem about the sea.", "ls -la"]


def validate(value, schema) -> None:
    """The JSON-schema check (the ``jsonschema`` library, Draft 2020-12)."""
    import jsonschema

    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return HFEngine.from_path(tiny_model_path, max_model_len=2048)


@pytest.fixture()
def svc(engine, tiny_tokenizer):
    return ChatService(tiny_tokenizer, LocalPolicy(engine), "m", 2048, ServingConfig(max_n=4),
                       ListSink())


async def chat(svc, body: dict) -> dict:
    req, fields = parse_request(json.dumps({"model": "m", **body}).encode())
    return await openai_chat.complete(svc, await svc.prepare(
        openai_chat.to_turn_request(req, fields), {}))


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_a_json_schema_answer_always_parses_and_validates(svc, prompt):
    body = await chat(svc, {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, "n": 3,
        "temperature": 1.0, "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON, "strict": True}}})
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop", choice
        validate(json.loads(choice["message"]["content"]), PERSON)


async def test_json_object_gives_an_object(svc):
    """Any object is allowed, so the tiny model may write one string longer than the budget
    (greedy, near-tied logits made that happen in one suite run and not another): an answer
    that stops is a whole object; one cut by ``max_tokens`` is the start of an object."""
    body = await chat(svc, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
                            "n": 4, "temperature": 1.0, "seed": 5,
                            "response_format": {"type": "json_object"}})
    stopped = 0
    for choice in body["choices"]:
        content = choice["message"]["content"]
        assert content.lstrip().startswith("{"), choice
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(content), dict), choice
            stopped += 1
        else:
            assert choice["finish_reason"] == "length", choice
            with pytest.raises(json.JSONDecodeError):
                json.loads(content)
    assert stopped >= 1, body["choices"]


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_required_tool_choice_always_calls_a_declared_tool(svc, prompt):
    body = await chat(svc, {
        "messages": [{"role": "user", "content": prompt}], "tools": TOOLS,
        "tool_choice": "required", "max_tokens": 200, "n": 3, "temperature": 1.0, "seed": 3})
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for choice in body["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert calls and choice["message"]["content"] is None
        for call in calls:
            validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    # the record holds the calls as the template writes them: a constrained turn trains alike
    rec = svc.sink.records[-1]
    assert rec.tool_calls and "<tool_call>" in svc.tokenizer.decode(rec.response_ids)


async def test_a_named_tool_choice_calls_exactly_that_tool(svc):
    for name in ("get_weather", "add"):
        body = await chat(svc, {
            "messages": [{"role": "user", "content": "hello"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": name}},
            "max_tokens": 200, "temperature": 0})
        calls = body["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == [name]


async def test_parallel_tool_calls_false_gives_one_call(svc):
    body = await chat(svc, {
        "messages": [{"role": "user", "content": "do both"}], "tools": TOOLS,
        "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 200, "n": 4,
        "temperature": 1.0, "seed": 11})
    assert all(len(c["message"]["tool_calls"]) == 1 for c in body["choices"])


async def test_a_json_format_with_tools_allows_either(svc):
    body = await chat(svc, {
        "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
        "max_tokens": 200, "n": 4, "temperature": 1.0, "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    for choice in body["choices"]:
        msg = choice["message"]
        if msg["tool_calls"]:
            assert msg["content"] is None
        else:
            validate(json.loads(msg["content"]), PERSON)


async def test_streamed_constrained_output_is_the_same_json(svc):
    req, fields = parse_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200,
        "temperature": 0, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON}}}).encode())
    lines = [x async for x in openai_chat.stream(
        svc, await svc.prepare(openai_chat.to_turn_request(req, fields), {}))]
    text = "".join(json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
                   for x in lines[:-1] if json.loads(x[6:])["choices"])
    validate(json.loads(text), PERSON)


async def test_responses_text_format_and_tool_choice(svc):
    store = LocalStore(10)
    req = orr.parse_request(json.dumps({
        "input": "hi", "max_output_tokens": 200, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                            "strict": True}}}).encode())
    body = await orr.complete(svc, await svc.prepare(orr.to_turn_request(req, [], None), {}),
                              req, store)
    text = body["output"][0]["content"][0]["text"]
    validate(json.loads(text), PERSON)
    assert body["text"]["format"]["name"] == "person"
    req = orr.parse_request(json.dumps({
        "input": "hi", "max_output_tokens": 200, "temperature": 0, "tool_choice": "required",
        "tools": [{"type": "function", "name": t["function"]["name"],
                   "parameters": t["function"]["parameters"]} for t in TOOLS]}).encode())
    body = await orr.complete(svc, await svc.prepare(orr.to_turn_request(req, [], None), {}),
                              req, store)
    assert [o["type"] for o in body["output"]] and all(
        o["type"] == "function_call" for o in body["output"])


async def test_anthropic_tool_choice_any_tool_and_output_format(svc):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    base = {"model": "m", "max_tokens": 200, "temperature": 0,
            "messages": [{"role": "user", "content": "hello"}]}
    for choice, names in (({"type": "any"}, {"get_weather", "add"}),
                          ({"type": "tool", "name": "add"}, {"add"})):
        req = am.parse_request(json.dumps({**base, "tools": tools,
                                           "tool_choice": choice}).encode())
        body = await am.complete(svc, await svc.prepare(am.to_turn_request(req), {}))
        uses = [b for b in body["content"] if b["type"] == "tool_use"]
        assert uses and {u["name"] for u in uses} <= names and body["stop_reason"] == "tool_use"
    req = am.parse_request(json.dumps({**base, "output_config": {
        "format": {"type": "json_schema", "schema": PERSON}}}).encode())
    body = await am.complete(svc, await svc.prepare(am.to_turn_request(req), {}))
    validate(json.loads(body["content"][0]["text"]), PERSON)


# ---------------------------------------------------------------- requests that are refused
async def test_bad_requests_are_400_naming_the_field(svc):
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                     "schema": [1]}}},
         "response_format.json_schema.schema"),
    ]
    for extra, param in cases:
        with pytest.raises(APIError) as e:
            await chat(svc, {"messages": [{"role": "user", "content": "hi"}], **extra})
        assert e.value.status == 400 and e.value.param == param, (extra, e.value.message)


async def test_a_schema_the_grammar_cannot_enforce_is_a_400(svc):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object", "properties": {
                    "a": {"$ref": "#/definitions/missing"}}}}}}
    with pytest.raises(APIError) as e:
        await chat(svc, body)
    assert e.value.status == 400
    assert e.value.message == ("the requested output format cannot be enforced: Cannot find "
                               "field definitions in #/definitions/missing")


def test_the_constraint_follows_the_templates_markup(tiny_tokenizer):
    tag = json.loads(structural_tag(None, TOOLS, ToolChoice("named", "add"), True))
    begin = tag["format"]["begin"]
    rendered = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c", "type": "function", "function": {"name": "add",
                                                          "arguments": '{"a": 1, "b": 2}'}}]}],
        tokenize=False)
    assert begin + '{"a": 1, "b": 2}' + tag["format"]["end"] in rendered
    assert structural_tag(None, TOOLS, tool_choice_of("auto"), True) is None
    assert structural_tag(None, TOOLS, tool_choice_of("none"), True) is None
    assert json.loads(structural_tag(OutputFormat(), None, tool_choice_of(None), True))[
        "format"]["type"] == "json_schema"
