"""Turn the model's ``<tool_call>{json}</tool_call>`` markup into OpenAI tool calls.

A block is valid when its body (stripped) is a JSON object with a string ``name`` and
``arguments`` that is missing/null (→ ``{}``), an object (re-serialized with ``json.dumps``),
or a string holding a JSON object (kept verbatim, as OpenAI clients send it back). Anything else
(bad JSON, no name, a block never closed) is not a tool call and stays in the content as the
text the model wrote: the parser never raises and never drops text.

Content rule (both parsers): the content is the text outside valid blocks, concatenated, with
leading and trailing whitespace stripped; ``None`` when nothing is left. Whitespace *between*
two pieces of text is kept. So ``"Let me look.\\n<tool_call>...</tool_call>\\n"`` gives content
``"Let me look."`` and whitespace between back-to-back blocks gives no content at all.

The streaming parser gives exactly the same result for any split of the text into deltas: the
concatenated ``ContentDelta`` texts equal ``parse_tool_calls(text)[0] or ""`` and the calls come
in the same order. Text streams as soon as it cannot be the start of ``<tool_call>``; only a
possible partial start tag and trailing whitespace (which may turn out to be the end of the
message) are held back; a block's body is buffered until its ``</tool_call>``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from typing import Any, Union

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
# How the chat template (chat_template.py) writes a call, exactly: constrained decoding
# (serve/structured.py) makes the model write the same markup.
CALL_MARKUP_END = "}\n" + TOOL_CALL_END
CALL_SEPARATOR = "\n"  # between two calls of one message


def call_markup_begin(name: str) -> str:
    """The markup before a call's arguments object: ``<tool_call>\\n{"name": "…", "arguments": ``."""
    return f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": '


@dataclasses.dataclass(frozen=True)
class ParsedToolCall:
    """One tool call: ``arguments`` is JSON text of an object, as in the OpenAI API."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The ``tool_calls`` entry of an OpenAI chat message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ContentDelta:
    """Plain text to stream as ``delta.content``."""

    text: str


@dataclasses.dataclass(frozen=True)
class ToolCallEvent:
    """A complete tool call, the ``index``-th of the message (0, 1, 2, ...)."""

    index: int
    call: ParsedToolCall


Event = Union[ContentDelta, ToolCallEvent]


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call_body(body: str) -> ParsedToolCall | None:
    """The tool call in a block's body, or None when the body is not a valid call."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments")
    if args is None:
        arguments = "{}"
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    elif isinstance(args, str):
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except (ValueError, RecursionError):
            return None
        arguments = args
    else:
        return None
    return ParsedToolCall(id=new_call_id(), name=obj["name"], arguments=arguments)


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """Split a finished completion into ``(content or None, tool calls)``."""
    pieces: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_START, pos)
        if start < 0:
            break
        end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START))
        if end < 0:  # never closed: plain text
            break
        call = parse_call_body(text[start + len(TOOL_CALL_START):end])
        block_end = end + len(TOOL_CALL_END)
        if call is None:
            pieces.append(text[pos:block_end])
        else:
            pieces.append(text[pos:start])
            calls.append(call)
        pos = block_end
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    return (content or None), calls


class ContentStream:
    """Streams a message's content as the whole-reply rule writes it (``strip``): leading
    whitespace dropped, whitespace held back until text follows it (none ends the message)."""

    def __init__(self) -> None:
        self.held = ""  # trailing whitespace withheld from the stream
        self.sent = ""  # what went out

    def feed(self, text: str) -> list[ContentDelta]:
        if not text:
            return []
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        if not self.sent:
            body = body.lstrip()
        if not body:
            return []
        self.sent += body
        return [ContentDelta(body)]


def _partial_start(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of the start tag."""
    for n in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0


class StreamingToolCallParser:
    """Incremental ``parse_tool_calls``: feed text deltas, get content deltas and calls."""

    def __init__(self) -> None:
        self._outside = ""  # text outside a block not yet classified (possible start tag)
        self._block: str | None = None  # body of the open block, None when outside
        self._scanned = 0  # how much of the open block was searched for the end tag
        self._content = ContentStream()
        self._count = 0

    def feed(self, delta: str, ids: Sequence[int] = ()) -> list[Event]:
        """Consume the next piece of model text (``ids``, the reply's token ids so far, are
        for vLLM's parsers, which some read; this one does not)."""
        events: list[Event] = []
        if self._block is None:
            self._outside += delta
        else:
            self._block += delta
        while True:
            if self._block is None:
                start = self._outside.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_start(self._outside)
                    self._emit(self._outside[: len(self._outside) - keep], events)
                    self._outside = self._outside[len(self._outside) - keep:]
                    return events
                self._emit(self._outside[:start], events)
                self._block, self._scanned = self._outside[start + len(TOOL_CALL_START):], 0
                self._outside = ""
            end = self._block.find(TOOL_CALL_END, self._scanned)
            if end < 0:
                self._scanned = max(0, len(self._block) - len(TOOL_CALL_END) + 1)
                return events
            body, rest = self._block[:end], self._block[end + len(TOOL_CALL_END):]
            self._block = None
            call = parse_call_body(body)
            if call is None:
                self._emit(TOOL_CALL_START + body + TOOL_CALL_END, events)
            else:
                events.append(ToolCallEvent(self._count, call))
                self._count += 1
            self._outside = rest

    def finish(self) -> list[Event]:
        """End of the completion: flush held text; an unclosed block is plain text."""
        events: list[Event] = []
        if self._block is not None:
            self._emit(TOOL_CALL_START + self._block, events)
            self._block = None
        self._emit(self._outside, events)
        self._outside = ""  # trailing whitespace of the message is stripped: never sent
        return events

    def _emit(self, text: str, events: list[Event]) -> None:
        events += self._content.feed(text)
