"""The tool-call parser: whole-text and streaming parsing agree, bad blocks stay text."""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from clawray.models.tool_calls import (
    ContentDelta,
    ParsedToolCall,
    StreamingToolCallParser,
    ToolCallEvent,
    parse_tool_calls,
)

LS_CALL = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'


def stream(chunks: list[str]) -> tuple[str, list[ParsedToolCall], list[int]]:
    parser = StreamingToolCallParser()
    events = [ev for chunk in chunks for ev in parser.feed(chunk)] + parser.finish()
    content = "".join(ev.text for ev in events if isinstance(ev, ContentDelta))
    calls = [ev.call for ev in events if isinstance(ev, ToolCallEvent)]
    indexes = [ev.index for ev in events if isinstance(ev, ToolCallEvent)]
    return content, calls, indexes


def shape(calls: list[ParsedToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def test_fixture_style_call_with_object_arguments():
    content, calls = parse_tool_calls(LS_CALL)
    assert content is None
    assert shape(calls) == [("ls", '{"path": "."}')]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0].id)
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "ls", "arguments": '{"path": "."}'}}


def test_arguments_given_as_json_string_are_kept_verbatim():
    text = '<tool_call>{"name": "ls", "arguments": "{\\"path\\":\\".\\"}"}</tool_call>'
    assert shape(parse_tool_calls(text)[1]) == [("ls", '{"path":"."}')]


def test_missing_arguments_become_empty_object():
    assert shape(parse_tool_calls('<tool_call>{"name": "status"}</tool_call>')[1]) == \
        [("status", "{}")]


def test_content_around_calls_is_stripped_and_kept():
    text = f"Let me look.\n{LS_CALL}\n{LS_CALL}\nDone."
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.\n\n\nDone."
    assert len(calls) == 2 and calls[0].id != calls[1].id


def test_plain_text_has_no_calls():
    assert parse_tool_calls("  Hello there!\n") == ("Hello there!", [])
    assert parse_tool_calls("   \n") == (None, [])


def test_invalid_blocks_stay_in_content():
    for body in ("not json", '{"arguments": {}}', '{"name": 3}', '["ls"]',
                 '{"name": "ls", "arguments": [1]}', '{"name": "ls", "arguments": "oops"}',
                 '{"name": "ls"'):
        text = f"<tool_call>{body}</tool_call>"
        assert parse_tool_calls(text) == (text, []), body


def test_unterminated_block_is_content():
    text = 'Sure <tool_call>{"name": "ls", "arguments": {}}'
    assert parse_tool_calls(text) == (text, [])
    assert stream([text[:7], text[7:]])[:2] == (text, [])


def test_non_ascii_arguments_survive():
    _, calls = parse_tool_calls('<tool_call>{"name": "say", "arguments": {"t": "héllo ✓"}}</tool_call>')
    assert json.loads(calls[0].arguments) == {"t": "héllo ✓"}


def test_streaming_char_by_char_emits_content_early_and_indexes_calls():
    text = f"Checking the workspace. {LS_CALL}\n{LS_CALL}"
    parser = StreamingToolCallParser()
    first = parser.feed("Checking the")
    assert first == [ContentDelta("Checking the")]  # streams before the message ends
    events = first + [ev for ch in text[len("Checking the"):] for ev in parser.feed(ch)]
    events += parser.finish()
    assert [ev.index for ev in events if isinstance(ev, ToolCallEvent)] == [0, 1]
    assert "".join(ev.text for ev in events if isinstance(ev, ContentDelta)) == \
        "Checking the workspace."


def test_streaming_holds_back_only_a_possible_start_tag():
    parser = StreamingToolCallParser()
    assert parser.feed("a <tool") == [ContentDelta("a")]
    assert parser.feed("box> b") == [ContentDelta(" <toolbox> b")]


def test_whitespace_between_calls_makes_no_content_events():
    content, calls, indexes = stream([LS_CALL, "\n", "\n", LS_CALL, "\n"])
    assert content == "" and indexes == [0, 1]


# Text made of fragments that exercise tags, near-tags, JSON and whitespace.
FRAGMENTS = st.sampled_from([
    LS_CALL, '<tool_call>{"name": "read", "arguments": "{\\"p\\": 1}"}</tool_call>',
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "<tool_call>{bad}</tool_call>",
    '{"name": "x"}', "Hello", " world", "\n", "  ", "\t", "<", ">", "tool_call", "é✓",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(FRAGMENTS, max_size=12), st.data())
def test_streaming_equals_whole_text_for_any_split(fragments, data):
    text = "".join(fragments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = parse_tool_calls(text)
    s_content, s_calls, indexes = stream(chunks)
    assert s_content == (content or "")
    assert shape(s_calls) == shape(calls)
    assert indexes == list(range(len(calls)))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='<>/_toolcal {}":n\n ', max_size=60), st.data())
def test_streaming_equals_whole_text_on_tag_like_noise(text, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    content, calls = parse_tool_calls(text)
    s_content, s_calls, _ = stream(chunks)
    assert s_content == (content or "") and shape(s_calls) == shape(calls)
