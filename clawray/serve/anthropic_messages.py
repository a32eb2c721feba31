"""Anthropic Messages on the wire: ``POST /v1/messages``.

A request (system, messages of content blocks — text, tool_use, tool_result — tools,
tool_choice, stop_sequences, metadata.user_id as the end user) becomes the internal
``TurnRequest``; the turn is rendered as a ``message`` object or as Anthropic's stream of
events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``). Errors use Anthropic's shape, ``{"type": "error", "error": {type, message}}``,
in the body or as an ``error`` event once the stream started.

Messages become the chat template's form, the same the Chat Completions path produces, so a
session is one session whichever API its client speaks: a ``tool_use`` block is an assistant
tool call, a ``tool_result`` block a ``tool`` message.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from clawray.serve.chat import ChatService, PreparedTurn, api_error_of
from clawray.serve.protocol import (
    APIError,
    check_id,
    client_sampling,
    json_object,
    refuse_unsupported,
    validated,
)
from clawray.serve.structured import AUTO, OutputFormat
from clawray.serve.structured import ToolChoice as StructuredToolChoice
from clawray.serve.turns import (
    ChoiceEnd,
    ChoiceResult,
    Opened,
    ReasoningDelta,
    StreamUsage,
    TextDelta,
    ToolCallDelta,
    TurnRequest,
    TurnResult,
)

# Fields this server does not implement, and the values that ask for nothing.
UNSUPPORTED = {
    "top_k": (None,),
    "mcp_servers": (None, []),
    "container": (None,),
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "abort": "end_turn"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Open):
    type: str


class Message(_Open):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Open):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or absent; server tools (web search, …) are refused


class ToolChoice(_Open):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputConfig(_Open):
    format: dict[str, Any] | None = None  # {"type": "json_schema", "schema": {...}}
    effort: None = None  # a reasoning-effort hint: not built (any value is a 400)


class Metadata(_Open):
    user_id: str | None = None


class MessagesRequest(_Open):
    model: str
    max_tokens: int
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    # Accepted either way: a reasoning model's thinking comes back as thinking blocks whenever
    # it reasoned (serving.reasoning_parser); budget_tokens is not enforced.
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


def parse_request(raw: bytes) -> MessagesRequest:
    data = json_object(raw)
    refuse_unsupported(data, UNSUPPORTED)
    req = validated(MessagesRequest, data, ("model", "max_tokens", "messages"))
    if req.metadata is not None:
        check_id(req.metadata.user_id, "metadata.user_id")
    return req


def to_turn_request(req: MessagesRequest) -> TurnRequest:
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _texts(req.system, "system")})
    for i, m in enumerate(req.messages):
        messages += _convert(m, i)
    tool_choice = AUTO
    if req.tool_choice is not None:
        kind = req.tool_choice.type
        if kind == "tool" and not req.tool_choice.name:
            raise APIError(400, "tool_choice.name is required when tool_choice.type is 'tool'",
                           param="tool_choice.name")
        tool_choice = (StructuredToolChoice("named", req.tool_choice.name) if kind == "tool"
                       else StructuredToolChoice("required" if kind == "any" else kind))
    fmt = None
    if req.output_config is not None and req.output_config.format is not None:
        spec = req.output_config.format
        if spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': "
                           "{...}}", param="output_config.format")
        fmt = OutputFormat(spec["schema"], "output")
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type not in (None, "custom"):
                raise APIError(400, f"tools.{i}: server tool type '{t.type}' is not supported "
                               "(only client tools with an input_schema)", param=f"tools.{i}.type")
            tools.append({"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.input_schema}})
    session_fields: dict[str, Any] = {}
    if req.metadata is not None and req.metadata.user_id:
        session_fields["user"] = req.metadata.user_id
    return TurnRequest(
        messages=messages, tools=tools, model=req.model, max_tokens=req.max_tokens,
        **client_sampling(req),
        stop=tuple(req.stop_sequences or ()), tool_choice=tool_choice, output_format=fmt,
        stream=req.stream,
        parallel_tool_calls=not (req.tool_choice and req.tool_choice.disable_parallel_tool_use),
        session_fields=session_fields, id_prefix="msg_")


def _convert(m: Message, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template messages (tool results become ``tool`` ones)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(m.content):
        where = f"messages.{i}.content.{j}"
        extra = b.model_extra or {}
        if b.type == "text":
            texts.append(_str(extra.get("text"), f"{where}.text"))
        elif b.type == "thinking" and m.role == "assistant":
            thoughts.append(_str(extra.get("thinking"), f"{where}.thinking"))
        elif b.type == "redacted_thinking" and m.role == "assistant":
            pass  # another provider's encrypted reasoning: nothing a template could render
        elif b.type == "tool_use" and m.role == "assistant":
            if not isinstance(extra.get("input"), dict):
                raise APIError(400, f"{where}.input: must be an object", param=f"{where}.input")
            calls.append({"id": _str(extra.get("id"), f"{where}.id"), "type": "function",
                          "function": {"name": _str(extra.get("name"), f"{where}.name"),
                                       "arguments": extra["input"]}})
        elif b.type == "tool_result" and m.role == "user":
            content = extra.get("content", "")
            text = content if isinstance(content, str) else _texts(
                [Block.model_validate(c) for c in content], f"{where}.content")
            out.append({"role": "tool", "tool_call_id": _str(extra.get("tool_use_id"),
                                                             f"{where}.tool_use_id"),
                        "content": text})
        else:
            raise APIError(400, f"{where}: content block of type '{b.type}' is not supported "
                           f"in a{'n' if m.role == 'assistant' else ''} {m.role} message",
                           param=f"{where}.type")
    if texts or calls or thoughts or not out:
        msg: dict[str, Any] = {"role": m.role, "content": "".join(texts) if texts else None}
        if thoughts:
            msg["reasoning_content"] = "".join(thoughts)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _texts(value: str | list[Block], where: str) -> str:
    if isinstance(value, str):
        return value
    texts = []
    for j, b in enumerate(value):
        if b.type != "text":
            raise APIError(400, f"{where}.{j}: block of type '{b.type}' is not supported "
                           "here (text only)", param=f"{where}.{j}.type")
        texts.append(_str((b.model_extra or {}).get("text"), f"{where}.{j}.text"))
    return "".join(texts)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where}: must be a string", param=where)
    return value


# ---------------------------------------------------------------- responses
def message_body(turn: PreparedTurn, result: TurnResult) -> dict[str, Any]:
    [choice] = result.choices
    return {"id": turn.request_id, "type": "message", "role": "assistant", "model": turn.model,
            "content": _blocks(choice),
            "stop_reason": _stop_reason(choice.finish_reason, choice.stop_string),
            "stop_sequence": choice.stop_string if choice.finish_reason == "stop" else None,
            "usage": _usage(result.usage.prompt_tokens, result.usage.completion_tokens,
                            result.usage.cached_tokens)}


def _stop_reason(finish: str, stop_string: str | None) -> str:
    if finish == "stop" and stop_string:
        return "stop_sequence"
    return STOP_REASONS[finish]


def _blocks(choice: ChoiceResult) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.content:
        blocks.append({"type": "text", "text": choice.content})
    for call in choice.tool_calls:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def _usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    # Anthropic counts cache reads apart from input_tokens (input = uncached prompt tokens).
    cached = cached or 0
    return {"input_tokens": prompt - cached, "output_tokens": completion,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def complete(service: ChatService, turn: PreparedTurn) -> dict[str, Any]:
    return message_body(turn, await service.run(turn))


async def stream(service: ChatService, turn: PreparedTurn) -> AsyncIterator[str]:
    """Anthropic's SSE events. The first waits for the engine's first token, so failures
    before it raise (an HTTP error); later ones end the stream with an ``error`` event."""
    events = service.events(turn)
    try:
        opened = await anext(events)
        assert isinstance(opened, Opened)
        prompt = len(turn.prompt_ids)
        start = {"id": turn.request_id, "type": "message", "role": "assistant", "content": [],
                 "model": turn.model, "stop_reason": None, "stop_sequence": None,
                 "usage": _usage(prompt, 0, opened.cached_tokens)}
        yield event("message_start", {"type": "message_start", "message": start})
        block = -1  # index of the last content block
        open_kind: str | None = None  # "text" | "thinking": the kind of the open block
        finish: tuple[str, str | None] = ("end_turn", None)

        def close() -> list[str]:
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [event("content_block_stop", {"type": "content_block_stop", "index": block})]

        def opening(kind: str) -> list[str]:
            nonlocal block, open_kind
            if open_kind == kind:
                return []
            lines = close()
            block += 1
            open_kind = kind
            start_block = ({"type": "text", "text": ""} if kind == "text" else
                           {"type": "thinking", "thinking": "", "signature": ""})
            return lines + [event("content_block_start", {
                "type": "content_block_start", "index": block, "content_block": start_block})]

        try:
            async for ev in events:
                if isinstance(ev, (TextDelta, ReasoningDelta)):
                    kind = "text" if isinstance(ev, TextDelta) else "thinking"
                    for line in opening(kind):
                        yield line
                    delta = ({"type": "text_delta", "text": ev.text} if kind == "text" else
                             {"type": "thinking_delta", "thinking": ev.text})
                    yield event("content_block_delta", {"type": "content_block_delta",
                                                        "index": block, "delta": delta})
                elif isinstance(ev, ToolCallDelta):
                    for line in close():
                        yield line
                    block += 1
                    fn = ev.call["function"]
                    yield event("content_block_start", {
                        "type": "content_block_start", "index": block,
                        "content_block": {"type": "tool_use", "id": ev.call["id"],
                                          "name": fn["name"], "input": {}}})
                    yield event("content_block_delta", {
                        "type": "content_block_delta", "index": block,
                        "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
                    yield event("content_block_stop", {"type": "content_block_stop",
                                                       "index": block})
                elif isinstance(ev, ChoiceEnd):
                    for line in close():
                        yield line
                    finish = (_stop_reason(ev.finish_reason, ev.stop_string), ev.stop_string
                              if ev.finish_reason == "stop" else None)
                elif isinstance(ev, StreamUsage):
                    yield event("message_delta", {
                        "type": "message_delta",
                        "delta": {"stop_reason": finish[0], "stop_sequence": finish[1]},
                        "usage": {"output_tokens": ev.usage.completion_tokens}})
            yield event("message_stop", {"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - the stream started: report in-band
            yield event("error", error_body(api_error_of(e)))
    finally:
        await events.aclose()


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_body(e: APIError) -> dict[str, Any]:
    """Anthropic's error object for an ``APIError`` (status kept, type in Anthropic's names)."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}
