"""Which tool-call format the served model writes, and the parser that reads it back.

``serving.tool_call_parser`` names it (docs/models.md, "Tools"):

- ``"clawray"`` (default): ``<tool_call>{json}</tool_call>`` blocks, the markup of clawray's
  templates and of Hermes/Qwen-style models, read by ``clawray.models.tool_calls``; a streamed
  call goes out as soon as its block closes, and constrained decoding (``tool_choice``
  required or named) writes the same markup.
- the name of one of vLLM's tool parsers (``vllm.tool_parsers.ToolParserManager``:
  ``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, …): vLLM's own parser reads the
  reply, so a model whose template writes another format is served as ``vllm serve
  --tool-call-parser NAME`` would serve it. A streamed reply goes through the parser's own
  streaming reader (``extract_tool_calls_streaming``, fed the text and the token ids): content
  streams as it comes, and each call goes out whole once the parser has moved past it; at
  the end the whole reply is parsed as without streaming, and whatever the streaming reader
  held back (content after a call, the last call) goes out then, so a streamed reply says what
  the whole one says. A reply constrained to a tool call is written in clawray's markup, and
  read by clawray's parser. vLLM must be installed.

Both give ``(content, calls)`` with the content rule of ``clawray.models.tool_calls``: text
outside the calls, stripped, None when empty.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from collections.abc import Sequence

from clawray.models.tool_calls import (ContentStream, Event, ParsedToolCall,
                                       StreamingToolCallParser, ToolCallEvent, new_call_id,
                                       parse_tool_calls)

CLAWRAY = "clawray"
logger = logging.getLogger(__name__)


class ToolCallFormat(Protocol):
    name: str

    def parse(self, text: str, tools: list[dict[str, Any]] | None
              ) -> tuple[str | None, list[ParsedToolCall]]:
        ...

    def stream(self, tools: list[dict[str, Any]] | None) -> Any:
        """A parser with ``feed(delta, ids) -> events`` and ``finish() -> events``."""
        ...


class ClawrayFormat:
    name = CLAWRAY

    def parse(self, text: str, tools: list[dict[str, Any]] | None
              ) -> tuple[str | None, list[ParsedToolCall]]:
        return parse_tool_calls(text)

    def stream(self, tools: list[dict[str, Any]] | None) -> StreamingToolCallParser:
        return StreamingToolCallParser()


CLAWRAY_FORMAT = ClawrayFormat()


class VLLMFormat:
    """One of vLLM's tool parsers, made per reply (they keep per-reply state)."""

    def __init__(self, name: str, tokenizer: Any) -> None:
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        self.parser_cls = ToolParserManager.get_tool_parser(name)
        self.tokenizer = tokenizer
        try:  # some refuse a tokenizer without their tokens: say so when the model loads
            self.parser_cls(tokenizer, None)
        except Exception as e:
            raise ValueError(f"serving.tool_call_parser {name!r} cannot read this model's "
                             f"replies: {e}") from None

    def request(self, tools: list[dict[str, Any]] | None) -> Any:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest(model="clawray", messages=[], tools=tools or None)

    def parse(self, text: str, tools: list[dict[str, Any]] | None
              ) -> tuple[str | None, list[ParsedToolCall]]:
        request = self.request(tools)
        try:
            info = self.parser_cls(self.tokenizer, request.tools).extract_tool_calls(text,
                                                                                     request)
        except Exception:  # a parser that trips on odd text: the reply stays plain text
            logger.exception("tool parser %s failed on a reply; sent as content", self.name)
            return _content(text), []
        if not info.tools_called:
            return _content(text), []
        calls = [ParsedToolCall(id=new_call_id(), name=c.function.name,
                                arguments=_arguments(c.function.arguments))
                 for c in info.tool_calls]
        return _content(info.content or ""), calls

    def stream(self, tools: list[dict[str, Any]] | None) -> "VLLMStreamParser":
        return VLLMStreamParser(self, tools)


class VLLMStreamParser:
    """A vLLM parser's streaming reader, giving clawray's events (``ContentDelta``, a whole
    ``ToolCallEvent``); ``finish`` makes the stream say what the whole reply's parse says."""

    def __init__(self, fmt: VLLMFormat, tools: list[dict[str, Any]] | None) -> None:
        self.fmt, self.tools = fmt, tools
        self.request = fmt.request(tools)
        self.parser = fmt.parser_cls(fmt.tokenizer, self.request.tools)
        self.text, self.ids = "", []
        self.content = ContentStream()
        self.calls: list[dict[str, str]] = []  # per index: id, name, arguments, as streamed
        self.sent: list[ParsedToolCall] = []  # the calls that went out, in order
        self.broken = False  # the streaming reader failed: the rest waits for the end

    def feed(self, delta: str, ids: Sequence[int] = ()) -> list[Event]:
        previous_text, previous_ids = self.text, self.ids
        self.text += delta
        self.ids = list(ids)
        if self.broken:
            return []
        try:
            msg = self.parser.extract_tool_calls_streaming(
                previous_text, self.text, delta, previous_ids, self.ids,
                self.ids[len(previous_ids):], self.request)
        except Exception:
            logger.exception("tool parser %s failed mid-stream; the rest of the reply is "
                             "parsed once complete", self.fmt.name)
            self.broken = True
            return []
        if msg is None:
            return []
        events: list[Event] = list(self.content.feed(msg.content or ""))
        for d in msg.tool_calls:
            while len(self.calls) <= d.index:
                self.calls.append({"id": "", "name": "", "arguments": ""})
            call = self.calls[d.index]
            call["id"] = call["id"] or (d.id or "")
            if d.function is not None:
                fn = d.function if isinstance(d.function, dict) else d.function.model_dump()
                call["name"] += fn.get("name") or ""
                call["arguments"] += fn.get("arguments") or ""
        # a call the reader has moved past is whole: it goes out now
        while len(self.sent) < len(self.calls) - 1:
            call = self._whole(self.calls[len(self.sent)])
            if call is None:  # not a call after all: the end decides
                break
            events.append(ToolCallEvent(len(self.sent), call))
            self.sent.append(call)
        return events

    def finish(self) -> list[Event]:
        content, calls = self.fmt.parse(self.text, self.tools)
        events: list[Event] = []
        content = content or ""
        if content.startswith(self.content.sent):
            events += self.content.feed(content[len(self.content.sent):])
        else:
            logger.warning("tool parser %s streamed content the whole reply does not have "
                           "(%r, then %r)", self.fmt.name, self.content.sent, content)
        for i, (got, want) in enumerate(zip(self.sent, calls)):
            if not _same(got, want):
                logger.warning("tool parser %s streamed call %d as %s, the whole reply has %s",
                               self.fmt.name, i, got, want)
        for i in range(len(self.sent), len(calls)):
            events.append(ToolCallEvent(i, calls[i]))
        return events

    @staticmethod
    def _whole(call: dict[str, str]) -> ParsedToolCall | None:
        try:
            arguments = json.loads(call["arguments"] or "{}")
        except ValueError:
            return None
        if not call["name"] or not isinstance(arguments, dict):
            return None
        return ParsedToolCall(id=call["id"] or new_call_id(), name=call["name"],
                              arguments=_arguments(call["arguments"] or "{}"))


def _same(a: ParsedToolCall, b: ParsedToolCall) -> bool:
    try:
        return (a.name, json.loads(a.arguments)) == (b.name, json.loads(b.arguments))
    except ValueError:
        return (a.name, a.arguments) == (b.name, b.arguments)


def _content(text: str) -> str | None:
    return text.strip() or None


def _arguments(arguments: Any) -> str:
    """JSON text of an object, as the OpenAI API carries it."""
    if isinstance(arguments, str):
        return arguments or "{}"
    return json.dumps(arguments if arguments is not None else {})


def known_parsers() -> list[str]:
    """clawray's own and vLLM's (where installed)."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:
        return [CLAWRAY]
    return [CLAWRAY, *sorted(ToolParserManager.list_registered())]


def make_tool_format(name: str, tokenizer: Any) -> ToolCallFormat:
    """The format ``serving.tool_call_parser`` names; a clear error for an unknown name."""
    if name == CLAWRAY:
        return CLAWRAY_FORMAT
    try:
        return VLLMFormat(name, tokenizer)
    except ImportError as e:
        raise ValueError(f"serving.tool_call_parser {name!r} is one of vLLM's tool parsers, and "
                         f"vLLM is not installed ({e}); use {CLAWRAY!r}") from None
    except KeyError:
        raise ValueError(f"unknown serving.tool_call_parser {name!r}; known: "
                         f"{', '.join(known_parsers())}") from None
