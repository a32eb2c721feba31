"""``serving.tool_call_parser``: clawray's own ``<tool_call>`` reader, or one of vLLM's tool
parsers for a model that writes another format, in the served APIs, streamed and whole."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.models.tool_calls import parse_tool_calls
from clawray.serve import anthropic_messages as am
from clawray.serve import openai_chat
from clawray.serve.chat import ChatService
from clawray.serve.protocol import parse_request
from clawray.serve.tool_parsers import CLAWRAY_FORMAT, make_tool_format
from tests.support.common import ListSink
from tests.unit.serve.test_anthropic_messages import TextPolicy

pytest.importorskip("vllm.tool_parsers")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]
HERMES = ['Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>',
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
          "No tool is needed: it is sunny."]


def calls_of(parsed):
    content, calls = parsed
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def stream_events(fmt, text, step=3, tokenizer=None):
    """Each feed's events, then the finish's (the last list)."""
    parser, out = fmt.stream(TOOLS), []
    for i in range(0, len(text), step):
        ids = tokenizer.encode(text[:i + step], add_special_tokens=False) if tokenizer else ()
        out.append(parser.feed(text[i:i + step], ids))
    return out + [parser.finish()]


def streamed(fmt, text, step=3, tokenizer=None):
    events = [e for batch in stream_events(fmt, text, step, tokenizer) for e in batch]
    content = "".join(e.text for e in events if hasattr(e, "text")) or None
    return content, [(e.call.name, json.loads(e.call.arguments)) for e in events
                     if hasattr(e, "call")]


@pytest.mark.parametrize("text", HERMES)
def test_vllms_hermes_parser_reads_what_clawrays_reads(tiny_tokenizer, text):
    hermes = make_tool_format("hermes", tiny_tokenizer)
    assert calls_of(hermes.parse(text, TOOLS)) == calls_of(parse_tool_calls(text))
    assert streamed(hermes, text) == calls_of(parse_tool_calls(text)) == streamed(
        CLAWRAY_FORMAT, text)


def test_vllms_streaming_reader_streams_content_and_calls_before_the_reply_ends(tiny_tokenizer):
    hermes = make_tool_format("hermes", tiny_tokenizer)
    # plain text to a request with tools streams as it comes, not at the end
    text = "No tool is needed: it is sunny and warm all day in Paris."
    batches = stream_events(hermes, text, tokenizer=tiny_tokenizer)
    early = "".join(e.text for b in batches[:-1] for e in b)
    assert len(early) >= len(text) - 3 and text.startswith(early), batches
    # two calls: the first goes out once the reader has moved on to the second
    batches = stream_events(hermes, HERMES[1], tokenizer=tiny_tokenizer)
    first = next(i for i, b in enumerate(batches) if any(hasattr(e, "call") for e in b))
    assert first < len(batches) - 1, batches
    assert [e.call.name for b in batches for e in b if hasattr(e, "call")] == ["get_weather"] * 2
    # content before a call streams before the call closes
    batches = stream_events(hermes, HERMES[0], tokenizer=tiny_tokenizer)
    assert "".join(e.text for e in batches[0] + batches[1] + batches[2]
                   if hasattr(e, "text")).startswith("Let me")
    # the whole and the streamed reply say the same, content after a call included
    text = HERMES[0] + "\nDone."
    assert streamed(hermes, text, tokenizer=tiny_tokenizer) == calls_of(hermes.parse(text, TOOLS))


def test_a_streaming_reader_that_fails_leaves_the_reply_to_the_whole_parse(tiny_tokenizer,
                                                                           caplog):
    hermes = make_tool_format("hermes", tiny_tokenizer)
    parser = hermes.stream(TOOLS)

    def broken(*a, **k):
        raise RuntimeError("boom")

    parser.parser.extract_tool_calls_streaming = broken
    assert parser.feed(HERMES[0][:20], ()) == []
    events = parser.feed(HERMES[0][20:], ()) + parser.finish()
    assert [e.text for e in events if hasattr(e, "text")] == ["Let me check."]
    assert [e.call.name for e in events if hasattr(e, "call")] == ["get_weather"]
    assert "failed mid-stream" in caplog.text


def test_a_pythonic_model_s_calls_become_openai_calls(tiny_tokenizer):
    pythonic = make_tool_format("pythonic", tiny_tokenizer)
    text = '[get_weather(city="Paris"), get_weather(city="Rome")]'
    want = (None, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})])
    assert calls_of(pythonic.parse(text, TOOLS)) == want == streamed(pythonic, text)
    assert calls_of(pythonic.parse("It is sunny.", TOOLS)) == ("It is sunny.", [])
    # clawray's parser sees no call there: the setting decides what a reply means
    assert calls_of(parse_tool_calls(text)) == (text, [])


def test_unknown_or_unfit_parsers_are_refused_when_the_model_loads(tiny_tokenizer):
    with pytest.raises(ValueError, match="unknown serving.tool_call_parser 'nope'; known: "
                                         "clawray, .*hermes"):
        make_tool_format("nope", tiny_tokenizer)
    # Llama 3's parser needs its <|python_tag|> token, which this tokenizer lacks
    with pytest.raises(ValueError, match="'llama3_json' cannot read this model's replies"):
        make_tool_format("llama3_json", tiny_tokenizer)


def test_text_a_parser_trips_on_stays_the_reply(tiny_tokenizer):
    bad = "<tool_call>\n{not json</tool_call> sorry"
    assert make_tool_format("hermes", tiny_tokenizer).parse(bad, TOOLS) == (bad, [])


def service(tokenizer, reply, parser):
    sink = ListSink()
    cfg = ServingConfig(tool_call_parser=parser)
    return ChatService(tokenizer, TextPolicy(tokenizer, reply), "m", 4096, cfg, sink), sink


async def chat(svc, stream, **extra):
    req, fields = parse_request(json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS,
        "stream": stream, **extra}).encode())
    return await svc.prepare(openai_chat.to_turn_request(req, fields), {})


async def test_the_served_apis_use_the_configured_parser(tiny_tokenizer):
    reply = '[get_weather(city="Paris"), get_weather(city="Rome")]'
    svc, sink = service(tiny_tokenizer, reply, "pythonic")
    body = await openai_chat.complete(svc, await chat(svc, False))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] \
        == [{"city": "Paris"}, {"city": "Rome"}]
    lines = [x async for x in openai_chat.stream(svc, await chat(svc, True))]
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    streamed_calls = [c for ch in chunks for c in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"]["name"] for c in streamed_calls] == ["get_weather"] * 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # the record keeps the ids as sampled and the calls as parsed
    assert sink.records[0].response_ids == tiny_tokenizer.encode(reply, add_special_tokens=False)
    # parallel_tool_calls false: the first call only, whole and streamed
    one = await openai_chat.complete(svc, await chat(svc, False, parallel_tool_calls=False))
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1
    lines = [x async for x in openai_chat.stream(svc, await chat(svc, True,
                                                                 parallel_tool_calls=False))]
    assert sum(len(json.loads(x[6:])["choices"][0]["delta"].get("tool_calls", []))
               for x in lines if x.startswith("data: {")) == 1
    # the Anthropic API reads the same calls as tool_use blocks
    req = am.to_turn_request(am.parse_request(json.dumps({
        "model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    }).encode()))
    out = await am.complete(svc, await svc.prepare(req, {}))
    assert [(b["type"], b.get("input")) for b in out["content"]] == [
        ("tool_use", {"city": "Paris"}), ("tool_use", {"city": "Rome"})]
    assert out["stop_reason"] == "tool_use"


async def test_a_forced_call_is_read_in_clawray_markup_whatever_the_setting(tiny_tokenizer):
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    svc, _ = service(tiny_tokenizer, reply, "pythonic")
    turn = await chat(svc, False, tool_choice="required")
    assert turn.tool_format is CLAWRAY_FORMAT and turn.params.structural_tag is not None
    body = await openai_chat.complete(svc, turn)
    assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) \
        == {"city": "Oslo"}
