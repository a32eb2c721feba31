"""OpenAI Chat Completions on the wire: ``POST /v1/chat/completions``.

The request models and their validation are in ``protocol.py``; this module turns a validated
request into the internal ``TurnRequest`` and renders a turn as a ``chat.completion`` object or
a stream of ``chat.completion.chunk`` SSE events ending in ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from clawray.serve.chat import ChatService, PreparedTurn, api_error_of
from clawray.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    client_sampling,
    normalize_messages,
    normalize_tools,
)
from clawray.serve.structured import output_format_of, tool_choice_of
from clawray.serve.turns import (
    ChoiceEnd,
    Opened,
    ReasoningDelta,
    StreamUsage,
    TokenLogprobs,
    TextDelta,
    ToolCallDelta,
    TurnRequest,
    TurnResult,
    Usage,
)


def to_turn_request(req: ChatCompletionRequest, session_fields: dict[str, Any]) -> TurnRequest:
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    uses_new = req.max_completion_tokens is not None
    return TurnRequest(
        messages=normalize_messages(req.messages),
        tools=normalize_tools(req.tools),
        model=req.model,
        max_tokens=req.max_completion_tokens if uses_new else req.max_tokens,
        max_tokens_param="max_completion_tokens" if uses_new else "max_tokens",
        **client_sampling(req),
        n=req.n,
        stop=req.stop_list(),
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        tool_choice=tool_choice_of(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        output_format=output_format_of(req.response_format, "response_format"),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        stream=req.stream,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        session_fields=dict(session_fields),
        id_prefix="chatcmpl-",
    )


def completion_body(turn: PreparedTurn, result: TurnResult,
                    token_text: Any = None) -> dict[str, Any]:
    """A ``chat.completion`` object (``token_text``: id → text, for log-probs)."""
    choices = []
    for c in result.choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.reasoning is not None:
            message["reasoning_content"] = c.reasoning
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        logprobs = (logprobs_json(c.token_ids, c.logprobs, c.top_logprobs, token_text)
                    if turn.logprobs else None)
        choices.append({"index": c.index, "message": message, "finish_reason": c.finish_reason,
                        "logprobs": logprobs})
    return {
        "id": turn.request_id,
        "object": "chat.completion",
        "created": turn.created,
        "model": turn.model,
        "system_fingerprint": fingerprint(result.policy_version),
        "choices": choices,
        "usage": usage_json(result.usage),
    }


async def complete(service: ChatService, turn: PreparedTurn) -> dict[str, Any]:
    return completion_body(turn, await service.run(turn), service.token_text)


async def stream(service: ChatService, turn: PreparedTurn) -> AsyncIterator[str]:
    """SSE lines of a streamed completion. The first line waits for the engine's first token,
    so failures before it raise (and become an HTTP error); failures after it end the stream
    with an error event and ``[DONE]``. Closing the iterator aborts generation."""
    events = service.events(turn)
    try:
        opened = await anext(events)
        assert isinstance(opened, Opened)
        version = opened.policy_version

        pending: dict[int, list[dict[str, Any]]] = {}  # token log-probs not yet sent

        def chunk(index: int, delta: dict[str, Any], finish: str | None) -> str:
            logprobs = None
            if turn.logprobs and (pending.get(index) or finish is not None or delta):
                logprobs = {"content": pending.pop(index, []), "refusal": None}
            body: dict[str, Any] = {
                "id": turn.request_id, "object": "chat.completion.chunk",
                "created": turn.created, "model": turn.model,
                "system_fingerprint": fingerprint(version),
                "choices": [{"index": index, "delta": delta, "finish_reason": finish,
                             "logprobs": logprobs}],
            }
            if turn.include_usage:
                body["usage"] = None
            return sse(body)

        for i in range(turn.params.n):
            yield chunk(i, {"role": "assistant", "content": ""}, None)
        try:
            async for ev in events:
                if isinstance(ev, TokenLogprobs):  # sent with the next chunk of this choice
                    pending.setdefault(ev.index, []).extend(logprobs_json(
                        ev.token_ids, ev.logprobs, ev.top_logprobs,
                        service.token_text)["content"])
                elif isinstance(ev, TextDelta):
                    yield chunk(ev.index, {"content": ev.text}, None)
                elif isinstance(ev, ReasoningDelta):
                    yield chunk(ev.index, {"reasoning_content": ev.text}, None)
                elif isinstance(ev, ToolCallDelta):
                    yield chunk(ev.index, {"tool_calls": [{"index": ev.call_index, **ev.call}]},
                                None)
                elif isinstance(ev, ChoiceEnd):
                    yield chunk(ev.index, {}, ev.finish_reason)
                elif isinstance(ev, StreamUsage) and turn.include_usage:
                    yield sse({"id": turn.request_id, "object": "chat.completion.chunk",
                               "created": turn.created, "model": turn.model,
                               "system_fingerprint": fingerprint(version), "choices": [],
                               "usage": usage_json(ev.usage)})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, end the stream
            yield sse(api_error_of(e).body())
            yield "data: [DONE]\n\n"
    finally:
        await events.aclose()


def logprobs_json(ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]] | None, token_text: Any) -> dict[str, Any]:
    """OpenAI's ``logprobs`` object: every sampled token with its (raw) log-prob and, when
    asked, its most likely alternatives; the values are the record's, exactly."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = token_text(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for i, (tid, lp) in enumerate(zip(ids, logprobs)):
        alternatives = top[i] if top is not None and i < len(top) else []
        content.append({**entry(tid, lp), "top_logprobs": [entry(t, v) for t, v in alternatives]})
    return {"content": content, "refusal": None}


def fingerprint(version: int) -> str:
    return f"clawray-policy-v{version}"


def usage_json(u: Usage) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the engine's prefix cache served."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens or 0}}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"
