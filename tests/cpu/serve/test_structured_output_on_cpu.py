"""Structured output and forced tool calls through the official SDKs, on both engines (vLLM's
structured outputs; xgrammar on the transformers engine): ``chat.completions.parse`` and
``responses.parse`` with a pydantic model, ``tool_choice: "required"`` / a named function in
Chat Completions and Responses, Anthropic's ``tool_choice: any | tool`` and
``output_config.format`` — every answer parses and validates against its schema."""

from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.ray


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    mood: Literal["happy", "sad", "calm"]


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                             "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 9},
                                         "b": {"type": "integer", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
GREEDY = {"temperature": 0}  # this anthropic SDK has no temperature argument any more
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "add", "parameters": ADD}}]


def check_args(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
        assert isinstance(args["city"], str) and len(args["city"]) <= 16
    else:
        assert name == "add" and set(args) == {"a", "b"}
        assert all(isinstance(v, int) and -9 <= v <= 9 for v in args.values())


@pytest.fixture(scope="module")
def oai(served_by):
    return openai.OpenAI(base_url=served_by.base_url, api_key=served_by.api_key, max_retries=0)


def test_chat_parse_returns_the_pydantic_model(oai, served_by):
    for prompt in ("Who is Ann?", "hi", "Describe a cat."):
        done = oai.chat.completions.parse(
            model=served_by.model, messages=[{"role": "user", "content": prompt}],
            response_format=Person, max_tokens=120, temperature=0.8, seed=1)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)


def test_required_and_named_tool_choice_through_chat(oai, served_by):
    for prompt in ("What's the weather in Oslo?", "hello", "Add 2 and 3."):
        done = oai.chat.completions.create(
            model=served_by.model, messages=[{"role": "user", "content": prompt}],
            tools=CHAT_TOOLS, tool_choice="required", max_tokens=120, temperature=0.8, seed=2)
        calls = done.choices[0].message.tool_calls
        assert done.choices[0].finish_reason == "tool_calls" and calls
        for call in calls:
            check_args(call.function.name, call.function.arguments)
    done = oai.chat.completions.create(
        model=served_by.model, messages=[{"role": "user", "content": "weather?"}],
        tools=CHAT_TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=120, temperature=0)
    [call] = done.choices[0].message.tool_calls
    assert call.function.name == "add"
    check_args("add", call.function.arguments)


def test_a_streamed_constrained_answer_parses(oai, served_by):
    stream = oai.chat.completions.create(
        model=served_by.model, messages=[{"role": "user", "content": "hi"}], stream=True,
        max_tokens=120, temperature=0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": Person.model_json_schema()}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    Person.model_validate_json(text)


def test_responses_parse_and_required_tools(oai, served_by):
    r = oai.responses.parse(model=served_by.model, input="Tell me about Bob.",
                            text_format=Person, max_output_tokens=120, temperature=0)
    assert isinstance(r.output_parsed, Person)
    r = oai.responses.create(
        model=served_by.model, input="hello", tool_choice="required", max_output_tokens=120,
        temperature=0, tools=[{"type": "function", "name": "add", "parameters": ADD,
                               "strict": True}])
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "add" for c in calls)
    for c in calls:
        check_args(c.name, c.arguments)


def test_anthropic_tool_choice_and_output_format(served_by):
    client = anthropic.Anthropic(base_url=served_by.base_url.removesuffix("/v1"),
                                 api_key=served_by.api_key, max_retries=0)
    tools = [{"name": "get_weather", "input_schema": WEATHER},
             {"name": "add", "input_schema": ADD}]
    m = client.messages.create(model=served_by.model, max_tokens=120, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "hello"}], tools=tools,
                               tool_choice={"type": "any"})
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses
    for u in uses:
        check_args(u.name, json.dumps(u.input))
    m = client.messages.create(model=served_by.model, max_tokens=120, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "hello"}], tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.name for b in m.content if b.type == "tool_use"] == ["get_weather"]
    m = client.messages.create(
        model=served_by.model, max_tokens=120, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Who is Ann?"}],
        output_config={"format": {"type": "json_schema", "schema": Person.model_json_schema()}})
    Person.model_validate_json("".join(b.text for b in m.content if b.type == "text"))


def test_errors_name_the_field(oai, served_by):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=served_by.model, max_tokens=4, tool_choice="required",
                                    messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=served_by.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}})
    assert "cannot be enforced" in e.value.body["message"]
