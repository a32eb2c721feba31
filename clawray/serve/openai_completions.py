"""OpenAI (legacy) Completions on the wire: ``POST /v1/completions`` for plain prompts.

The prompt — a string, a list of strings, a list of token ids or a list of such lists — is
generated on as is, without the chat template. Each prompt is one internal turn (so sampling,
auth, errors and records are the chat path's); a request with several prompts answers them all,
choice ``index`` = prompt × n + completion, as OpenAI numbers them. A plain prompt has no
conversation, so its turns are recorded as side turns (kept, never trained).

Log-probs follow this API's shape: ``logprobs: k`` (0–5) returns ``tokens``,
``token_logprobs``, ``top_logprobs`` (k most likely per position, as ``{token: logprob}``) and
``text_offset``, the engine's raw values (the record's). ``echo`` puts the prompt's text before
each completion; ``echo`` with ``logprobs`` (prompt log-probs) and ``suffix`` are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from clawray.serve.chat import ChatService, PreparedTurn, api_error_of
from clawray.serve.openai_chat import fingerprint, sse, usage_json
from clawray.serve.protocol import (
    APIError,
    NULL_MEANS_DEFAULT,
    SESSION_BODY_FIELDS,
    StreamOptions,
    check_id,
    check_logit_bias,
    client_sampling,
    json_object,
    refuse_unsupported,
    validated,
)
from clawray.serve.turns import (
    ChoiceEnd,
    Opened,
    StreamUsage,
    TextDelta,
    TokenLogprobs,
    TurnRequest,
    TurnResult,
    Usage,
)

UNSUPPORTED = {"suffix": (None, ""), "best_of": (None, 1)}
MAX_PROMPTS = 64


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields ignored, as OpenAI's servers do

    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = 16  # OpenAI's default for this API
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: StrictBool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM extra
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False  # vLLM extra

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4 or any(not s for s in items):
            raise ValueError("stop must be up to 4 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(v)


def parse_request(raw: bytes) -> tuple[CompletionRequest, dict[str, Any]]:
    data = json_object(raw)
    session_fields = {k: data.pop(k) for k in SESSION_BODY_FIELDS if k in data}
    for name in ("session_id", "user", "prompt_cache_key"):
        check_id(session_fields.get(name), name)
    for name in (*NULL_MEANS_DEFAULT, "echo", "suffix", "best_of"):
        if name in data and data[name] is None:
            del data[name]
    refuse_unsupported(data, UNSUPPORTED)
    req = validated(CompletionRequest, data, ("prompt",))
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs (the prompt's log-probs) is not supported",
                       param="echo", code="unsupported_parameter")
    return req, session_fields


def prompts_of(req: CompletionRequest, tokenizer: Any) -> list[tuple[list[int], str]]:
    """Each prompt as (ids, text): strings are tokenized without special tokens added, ids
    decoded."""
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        items: list[Any] = [p]
    else:
        items = list(p)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise APIError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append((tokenizer.encode(item, add_special_tokens=False), item))
        else:
            out.append((list(item), tokenizer.decode(item)))
    return out


def to_turn_requests(req: CompletionRequest, session_fields: dict[str, Any],
                     tokenizer: Any) -> list[TurnRequest]:
    stops = () if req.stop is None else ((req.stop,) if isinstance(req.stop, str)
                                         else tuple(req.stop))
    turns = []
    for ids, text in prompts_of(req, tokenizer):
        turns.append(TurnRequest(
            messages=[], model=req.model, max_tokens=req.max_tokens, **client_sampling(req),
            n=req.n, stop=stops, seed=req.seed, ignore_eos=req.ignore_eos,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
            logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            session_fields=dict(session_fields), id_prefix="cmpl-",
            prompt_ids=ids, prompt_text=text))
    return turns


@dataclasses.dataclass
class Prepared:
    """The turns of one request (one per prompt) and what rendering needs."""

    turns: list[PreparedTurn]
    req: CompletionRequest
    prompt_texts: list[str]

    @property
    def first(self) -> PreparedTurn:
        return self.turns[0]


async def prepare(service: ChatService, req: CompletionRequest, session_fields: dict[str, Any],
                  headers: Any, tenant: str) -> Prepared:
    requests = to_turn_requests(req, session_fields, service.tokenizer)
    turns = [await service.prepare(r, headers, tenant) for r in requests]
    return Prepared(turns, req, [r.prompt_text or "" for r in requests])


def logprobs_json(ids: list[int], logprobs: list[float],
                  top: list[list[tuple[int, float]]] | None, token_text: Any,
                  offset: int) -> dict[str, Any]:
    """This API's ``logprobs`` object, text offsets counted from ``offset``."""
    tokens, offsets = [], []
    for tid in ids:
        offsets.append(offset)
        text = token_text(tid)
        tokens.append(text)
        offset += len(text)
    tops = None
    if top is not None:
        tops = [{token_text(t): v for t, v in (top[i] if i < len(top) else [])}
                for i in range(len(ids))]
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": tops,
            "text_offset": offsets}


async def complete(service: ChatService, p: Prepared) -> dict[str, Any]:
    results: list[TurnResult] = await asyncio.gather(*(service.run(t) for t in p.turns))
    n = p.req.n
    choices = []
    usage = Usage(0, 0, None)
    for k, (turn, result) in enumerate(zip(p.turns, results)):
        usage.prompt_tokens += result.usage.prompt_tokens
        usage.completion_tokens += result.usage.completion_tokens
        if result.usage.cached_tokens is not None:
            usage.cached_tokens = (usage.cached_tokens or 0) + result.usage.cached_tokens
        echo = p.prompt_texts[k] if p.req.echo else ""
        for c in result.choices:
            logprobs = (logprobs_json(c.token_ids, c.logprobs, c.top_logprobs,
                                      service.token_text, len(echo))
                        if turn.logprobs else None)
            choices.append({"index": k * n + c.index, "text": echo + (c.content or ""),
                            "logprobs": logprobs, "finish_reason": c.finish_reason})
    return {"id": p.first.request_id, "object": "text_completion", "created": p.first.created,
            "model": p.first.model,
            "system_fingerprint": fingerprint(max(r.policy_version for r in results)),
            "choices": choices, "usage": usage_json(usage)}


async def stream(service: ChatService, p: Prepared) -> AsyncIterator[str]:
    """SSE chunks of every prompt's completions (generated together, sent prompt after prompt),
    then usage (when asked) and ``[DONE]``. The first line waits for the engine's first token (failures before it are
    HTTP errors); later failures end the stream with an error event."""
    first = p.first
    n = p.req.n
    usage = Usage(0, 0, None)

    def chunk(index: int, text: str, finish: str | None, logprobs: Any, version: int) -> str:
        body: dict[str, Any] = {
            "id": first.request_id, "object": "text_completion", "created": first.created,
            "model": first.model, "system_fingerprint": fingerprint(version),
            "choices": [{"index": index, "text": text, "logprobs": logprobs,
                         "finish_reason": finish}]}
        if first.include_usage:
            body["usage"] = None
        return sse(body)

    streams = [service.events(t) for t in p.turns]
    try:
        # Every prompt starts generating now (their tokens queue up while earlier prompts are
        # sent); a failure before the first tokens raises from here, as an HTTP error.
        opened_all = await asyncio.gather(*(anext(events) for events in streams))
        assert all(isinstance(o, Opened) for o in opened_all)
        try:
            for k, (opened, events) in enumerate(zip(opened_all, streams)):
                version = opened.policy_version
                offsets = {i: 0 for i in range(n)}
                pending: dict[int, dict[str, Any]] = {}
                if p.req.echo:
                    for i in range(n):
                        yield chunk(k * n + i, p.prompt_texts[k], None, None, version)
                        offsets[i] = len(p.prompt_texts[k])
                async for ev in events:
                    if isinstance(ev, TokenLogprobs):
                        lp = logprobs_json(ev.token_ids, ev.logprobs, ev.top_logprobs,
                                           service.token_text, offsets[ev.index])
                        offsets[ev.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                        pending[ev.index] = _merge(pending.get(ev.index), lp)
                    elif isinstance(ev, TextDelta):
                        yield chunk(k * n + ev.index, ev.text, None, pending.pop(ev.index, None),
                                    version)
                    elif isinstance(ev, ChoiceEnd):
                        yield chunk(k * n + ev.index, "", ev.finish_reason,
                                    pending.pop(ev.index, None), ev.policy_version)
                    elif isinstance(ev, StreamUsage):
                        usage.prompt_tokens += ev.usage.prompt_tokens
                        usage.completion_tokens += ev.usage.completion_tokens
                        if ev.usage.cached_tokens is not None:
                            usage.cached_tokens = ((usage.cached_tokens or 0)
                                                   + ev.usage.cached_tokens)
            if first.include_usage:
                # the version the non-streamed answer names: the newest that served a prompt
                yield sse({"id": first.request_id, "object": "text_completion",
                           "created": first.created, "model": first.model,
                           "system_fingerprint": fingerprint(
                               max(o.policy_version for o in opened_all)),
                           "choices": [], "usage": usage_json(usage)})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band
            yield sse(api_error_of(e).body())
            yield "data: [DONE]\n\n"
    finally:
        for events in streams:
            await events.aclose()


def _merge(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    if a is None:
        return b
    return {"tokens": a["tokens"] + b["tokens"],
            "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": (None if a["top_logprobs"] is None
                             else a["top_logprobs"] + b["top_logprobs"]),
            "text_offset": a["text_offset"] + b["text_offset"]}
