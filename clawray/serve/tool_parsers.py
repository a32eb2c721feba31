"""Which tool-call format the served model writes, and the parser that reads it back.

``serving.tool_call_parser`` names it (docs/models.md, "Tools"):

- ``"clawray"`` (default): ``<tool_call>{json}</tool_call>`` blocks, the markup of clawray's
  templates and of Hermes/Qwen-style models, read by ``clawray.models.tool_calls``; a streamed
  call goes out as soon as its block closes, and constrained decoding (``tool_choice``
  required or named) writes the same markup.
- the name of one of vLLM's tool parsers (``vllm.tool_parsers.ToolParserManager``:
  ``hermes``, ``llama3_json``, ``mistral``, ``pythonic``, …): vLLM's own parser reads the
  reply, so a model whose template writes another format is served as ``vllm serve
  --tool-call-parser NAME`` would serve it. When the request's tools may be called, a streamed
  reply is parsed once complete: its content and calls come in the final chunks (the same
  result as without streaming). A reply constrained to a tool call is written in clawray's
  markup, and read by clawray's parser. vLLM must be installed.

Both give ``(content, calls)`` with the content rule of ``clawray.models.tool_calls``: text
outside the calls, stripped, None when empty.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from clawray.models.tool_calls import (ContentDelta, Event, ParsedToolCall,
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
        """A parser with ``feed(delta) -> events`` and ``finish() -> events``."""
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

    def parse(self, text: str, tools: list[dict[str, Any]] | None
              ) -> tuple[str | None, list[ParsedToolCall]]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(model="clawray", messages=[], tools=tools or None)
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

    def stream(self, tools: list[dict[str, Any]] | None) -> "BufferedParser":
        return BufferedParser(self, tools)


class BufferedParser:
    """Holds the reply until it ends, then parses it whole (``VLLMFormat``)."""

    def __init__(self, fmt: VLLMFormat, tools: list[dict[str, Any]] | None) -> None:
        self.fmt, self.tools, self.text = fmt, tools, ""

    def feed(self, delta: str) -> list[Event]:
        self.text += delta
        return []

    def finish(self) -> list[Event]:
        content, calls = self.fmt.parse(self.text, self.tools)
        events: list[Event] = [ContentDelta(content)] if content else []
        return events + [ToolCallEvent(i, call) for i, call in enumerate(calls)]


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
