"""OpenAI Responses on the wire: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``.

A request (``input`` as a string or as items — messages, ``function_call``,
``function_call_output`` — ``instructions``, function tools, ``previous_response_id``) becomes
the internal ``TurnRequest``; the turn is rendered as a ``response`` object or as the Responses
stream (``response.created`` … ``response.output_text.delta`` …
``response.function_call_arguments.done`` … ``response.completed``, each with its
``sequence_number``).

``previous_response_id`` continues a conversation the server kept (``response_store.py``): the
stored history, then this request's input. As OpenAI does, the previous ``instructions`` are not
carried over. A chain is one session: its turns share the first turn's session id unless the
client names one. Responses are stored unless ``store`` is false; only the key that created
one can continue, read or delete it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from clawray.serve.chat import ChatService, PreparedTurn, api_error_of
from clawray.serve.protocol import (
    APIError,
    check_id,
    client_sampling,
    json_object,
    parse_arguments,
    refuse_unsupported,
    validated,
)
from clawray.serve.structured import OutputFormat, output_format_of, tool_choice_of
from clawray.serve.turns import (
    ChoiceEnd,
    ChoiceResult,
    Opened,
    ReasoningDelta,
    StreamUsage,
    TextDelta,
    ToolCallDelta,
    TurnRequest,
    Usage,
)

# Fields this server does not implement yet, and the values that ask for nothing.
UNSUPPORTED = {
    "reasoning": (None, {}),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "background": (None, False),
    "conversation": (None,),
    "prompt": (None,),
    "top_logprobs": (None, 0),
}
TEXT_PARTS = ("input_text", "output_text", "text")


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionTool(_Open):
    type: str
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(_Open):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    previous_response_id: str | None = Field(None, max_length=200)
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool = True


def parse_request(raw: bytes) -> ResponsesRequest:
    data = json_object(raw)
    for name in [k for k, v in data.items() if v is None]:
        del data[name]  # null: the default
    refuse_unsupported(data, UNSUPPORTED)
    req = validated(ResponsesRequest, data, ("input",))
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        check_id(getattr(req, name), name)
    output_format(req)  # a bad text.format or tool_choice is a 400 before anything runs
    tool_choice_of(req.tool_choice)
    return req


def output_format(req: ResponsesRequest) -> OutputFormat | None:
    """``text.format`` (``{"type": "json_schema", "name", "schema", "strict"}`` or
    ``json_object``) as the answer's format."""
    if req.text is not None and not isinstance(req.text, dict):
        raise APIError(400, "text must be an object", param="text")
    return output_format_of((req.text or {}).get("format"), "text.format")


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """This request's input items as chat-template messages (without the instructions)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item, for the assistant reply that follows it
    for i, item in enumerate(req.input):
        where = f"input.{i}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            thought = (thought or "") + "".join(
                p.get("text", "") for p in parts if isinstance(p, dict))
            continue
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role: must be user, assistant, system or "
                               "developer", param=f"{where}.role")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{where}.content")})
            if role == "assistant" and thought is not None:
                out[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call":
            call = {"id": _str(item.get("call_id"), f"{where}.call_id"), "type": "function",
                    "function": {"name": _str(item.get("name"), f"{where}.name"),
                                 "arguments": parse_arguments(
                                     _str(item.get("arguments"), f"{where}.arguments"))}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and thought is None:
                last.setdefault("tool_calls", []).append(call)  # text and calls: one reply
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if thought is not None:
                    out[-1]["reasoning_content"], thought = thought, None
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool",
                        "tool_call_id": _str(item.get("call_id"), f"{where}.call_id"),
                        "content": output if isinstance(output, str)
                        else _text(output, f"{where}.output")})
        else:
            raise APIError(400, f"{where}: input items of type '{kind}' are not supported "
                           "(messages, reasoning, function_call and function_call_output are)",
                           param=f"{where}.type")
    return out


def to_turn_request(req: ResponsesRequest, history: list[dict[str, Any]],
                    chain_session_id: str | None) -> TurnRequest:
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else [])
    messages += history + input_messages(req)
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.type != "function" or not t.name:
                raise APIError(400, f"tools.{i}: tools of type '{t.type}' are not supported "
                               "(function tools are)", param=f"tools.{i}.type")
            tools.append({"type": "function", "function": {
                "name": t.name, "description": t.description or "",
                "parameters": t.parameters or {"type": "object", "properties": {}}}})
    fields: dict[str, Any] = {}
    if req.user or req.safety_identifier:
        fields["user"] = req.user or req.safety_identifier
    if req.prompt_cache_key:
        fields["prompt_cache_key"] = req.prompt_cache_key
    if chain_session_id:
        fields["chain_session_id"] = chain_session_id
    return TurnRequest(messages=messages, tools=tools, model=req.model,
                       max_tokens=req.max_output_tokens, max_tokens_param="max_output_tokens",
                       **client_sampling(req),
                       tool_choice=tool_choice_of(req.tool_choice),
                       output_format=output_format(req),
                       parallel_tool_calls=req.parallel_tool_calls, stream=req.stream,
                       session_fields=fields, id_prefix="resp_")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}.{j}: content of type '{kind}' is not supported "
                           "(text only)", param=f"{where}.{j}.type")
        texts.append(_str(part.get("text"), f"{where}.{j}.text"))
    return "".join(texts)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise APIError(400, f"{where}: must be a string", param=where)
    return value


# ---------------------------------------------------------------- responses
class Rendered:
    """Builds the response object of one turn (and its stored conversation entry)."""

    def __init__(self, req: ResponsesRequest, turn: PreparedTurn) -> None:
        self.req, self.turn = req, turn

    def body(self, status: str, output: list[dict[str, Any]], usage: Usage | None,
             finish: str | None = None) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.turn.request_id, "object": "response", "created_at": self.turn.created,
            "status": status, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if finish == "length"
                                   else None),
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.turn.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "temperature": self.turn.params.temperature, "top_p": self.turn.params.top_p,
            "tool_choice": req.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "store": req.store, "metadata": req.metadata or {}, "user": req.user,
            "usage": usage_json(usage) if usage is not None else None,
        }

    def output(self, choice: ChoiceResult) -> list[dict[str, Any]]:
        items = []
        if choice.reasoning is not None:
            items.append(reasoning_item(new_id("rs_"), choice.reasoning))
        if choice.content:
            items.append(message_item(new_id("msg_"), choice.content, "completed"))
        for call in choice.tool_calls:
            items.append(call_item(new_id("fc_"), call, "completed"))
        return items

    def stored_messages(self, choice: ChoiceResult) -> list[dict[str, Any]]:
        """What this turn adds to the conversation: its input, then its reply."""
        reply: dict[str, Any] = {"role": "assistant", "content": choice.content or None}
        if choice.reasoning:
            reply["reasoning_content"] = choice.reasoning
        if choice.tool_calls:
            reply["tool_calls"] = [{**c, "function": {**c["function"], "arguments":
                                                      parse_arguments(c["function"]["arguments"])}}
                                   for c in choice.tool_calls]
        return input_messages(self.req) + [reply]


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status == \
        "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
    fn = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if status == "completed" else "", "status": status}


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def usage_json(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens or 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


async def complete(service: ChatService, turn: PreparedTurn, req: ResponsesRequest,
                   store: Any) -> dict[str, Any]:
    result = await service.run(turn)
    [choice] = result.choices
    r = Rendered(req, turn)
    body = r.body("incomplete" if choice.finish_reason == "length" else "completed",
                  r.output(choice), result.usage, choice.finish_reason)
    if req.store:
        await store.put(turn.request_id, turn.meta.tenant, req.previous_response_id,
                        r.stored_messages(choice), turn.meta.session_id, body)
    return body


async def stream(service: ChatService, turn: PreparedTurn, req: ResponsesRequest,
                 store: Any) -> AsyncIterator[str]:
    """The Responses stream. The first event waits for the engine's first token, so failures
    before it raise (an HTTP error); later ones end the stream with an ``error`` event."""
    events = service.events(turn)
    seq = iter(range(1 << 62))
    r = Rendered(req, turn)

    def emit(kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        return f"event: {kind}\ndata: " \
               f"{json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    try:
        opened = await anext(events)
        assert isinstance(opened, Opened)
        yield emit("response.created", response=r.body("in_progress", [], None))
        yield emit("response.in_progress", response=r.body("in_progress", [], None))
        output: list[dict[str, Any]] = []
        text_item: dict[str, Any] | None = None
        text = ""
        content, calls = "", []
        finish = "stop"
        thought_item: dict[str, Any] | None = None
        thought = ""
        try:
            async for ev in events:
                if isinstance(ev, ReasoningDelta):
                    if thought_item is None:
                        thought_item = {**reasoning_item(new_id("rs_"), ""), "content": [],
                                        "status": "in_progress"}
                        output.append(thought_item)
                        yield emit("response.output_item.added", output_index=len(output) - 1,
                                   item=dict(thought_item))
                    thought += ev.text
                    yield emit("response.reasoning_text.delta", item_id=thought_item["id"],
                               output_index=output.index(thought_item), content_index=0,
                               delta=ev.text)
                    continue
                if thought_item is not None and thought_item["status"] != "completed":
                    for line in _close_reasoning(emit, output, thought_item, thought):
                        yield line
                if isinstance(ev, TextDelta):
                    if text_item is None:
                        text_item = message_item(new_id("msg_"), "", "in_progress")
                        output.append(text_item)
                        yield emit("response.output_item.added", output_index=len(output) - 1,
                                   item=text_item)
                        yield emit("response.content_part.added", item_id=text_item["id"],
                                   output_index=len(output) - 1, content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []})
                    text += ev.text
                    content += ev.text
                    yield emit("response.output_text.delta", item_id=text_item["id"],
                               output_index=len(output) - 1, content_index=0, delta=ev.text,
                               logprobs=[])
                elif isinstance(ev, ToolCallDelta):
                    for line in _close_text(emit, output, text_item, text):
                        yield line
                    text_item, text = None, ""
                    calls.append(ev.call)
                    item = call_item(new_id("fc_"), ev.call, "in_progress")
                    output.append(item)
                    i = len(output) - 1
                    args = ev.call["function"]["arguments"]
                    yield emit("response.output_item.added", output_index=i, item=item)
                    yield emit("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=i, delta=args)
                    yield emit("response.function_call_arguments.done", item_id=item["id"],
                               output_index=i, arguments=args)
                    item.update(arguments=args, status="completed")
                    yield emit("response.output_item.done", output_index=i, item=item)
                elif isinstance(ev, ChoiceEnd):
                    for line in _close_text(emit, output, text_item, text):
                        yield line
                    text_item, text = None, ""
                    finish = ev.finish_reason
                elif isinstance(ev, StreamUsage):
                    choice = ChoiceResult(0, content, calls, finish, None, [], [],
                                          thought if thought_item is not None else None)
                    body = r.body("incomplete" if finish == "length" else "completed", output,
                                  ev.usage, finish)
                    if req.store:
                        await store.put(turn.request_id, turn.meta.tenant,
                                        req.previous_response_id, r.stored_messages(choice),
                                        turn.meta.session_id, body)
                    yield emit("response.incomplete" if finish == "length"
                               else "response.completed", response=body)
        except Exception as e:  # noqa: BLE001 - the stream started: report in-band
            err = api_error_of(e)
            yield emit("error", code=err.code or err.type, message=err.message,
                       param=err.param)
    finally:
        await events.aclose()


def _close_reasoning(emit: Any, output: list[dict[str, Any]], item: dict[str, Any],
                     text: str) -> list[str]:
    i = output.index(item)
    item.update(status="completed", content=[{"type": "reasoning_text", "text": text}])
    return [emit("response.reasoning_text.done", item_id=item["id"], output_index=i,
                 content_index=0, text=text),
            emit("response.output_item.done", output_index=i, item=item)]


def _close_text(emit: Any, output: list[dict[str, Any]], item: dict[str, Any] | None,
                text: str) -> list[str]:
    if item is None:
        return []
    i = output.index(item)
    part = {"type": "output_text", "text": text, "annotations": []}
    item.update(status="completed", content=[part])
    return [emit("response.output_text.done", item_id=item["id"], output_index=i,
                 content_index=0, text=text, logprobs=[]),
            emit("response.content_part.done", item_id=item["id"], output_index=i,
                 content_index=0, part=part),
            emit("response.output_item.done", output_index=i, item=item)]


def not_found(response_id: str, param: str = "response_id") -> APIError:
    return APIError(404, f"no response with id '{response_id}' found", param=param,
                    code="not_found")

