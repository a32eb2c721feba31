"""The chat-completions service: request → prompt ids → engine → OpenAI response or SSE stream.

No Ray and no web framework here: the Serve ingress is a thin shell around ``ChatService``, so
the whole request path can be tested in-process and benchmarked without Serve. Heavy CPU work
(chat template + tokenization of ~60 KB agent prompts) runs in a worker thread so the event
loop keeps streaming other requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Mapping, Protocol

from clawray.config import ServingConfig
from clawray.inference.engine import (
    EngineError,
    EngineInternalError,
    EngineOverloaded,
    EngineStatus,
    EngineUnavailable,
    SamplingParams,
    TokenDelta,
    TokenOutput,
)
from clawray.records import RecordSink, TurnRecord
from clawray.serve.detokenize import IncrementalDetokenizer, StopCutter, first_stop
from clawray.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    normalize_messages,
    normalize_tools,
)
from clawray.serve.session_meta import SessionMeta, session_meta
from clawray.models.segment_cache import SegmentCache
from clawray.models.tool_calls import (
    ContentDelta,
    StreamingToolCallParser,
    ToolCallEvent,
    parse_tool_calls,
)

logger = logging.getLogger(__name__)


class PolicyClient(Protocol):
    """How the ingress reaches the engine: in-process, or through a Serve handle."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       session_key: str | None = None) -> list[TokenOutput]: ...

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               session_key: str | None = None) -> AsyncIterator[TokenDelta]: ...

    async def status(self) -> EngineStatus: ...


@dataclasses.dataclass
class PreparedTurn:
    request_id: str
    created: int
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    meta: SessionMeta
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    include_usage: bool
    started_at: float = 0.0


class ChatService:
    def __init__(
        self,
        tokenizer: Any,
        policy: PolicyClient,
        served_model: str,
        max_model_len: int,
        cfg: ServingConfig,
        sink: RecordSink,
    ) -> None:
        self.tokenizer = tokenizer
        self.policy = policy
        self.served_model = served_model
        self.max_model_len = max_model_len
        self.cfg = cfg
        self.sink = sink
        # The repeated system prompt, tools and history of agent sessions tokenize once.
        self.segments = SegmentCache(tokenizer)
        if not self.segments.enabled:
            logger.info("prompt segment cache off: %s", self.segments.reason)

    # ---------------------------------------------------------------- preparing a turn
    async def prepare(
        self, req: ChatCompletionRequest, headers: Mapping[str, str],
        body_fields: Mapping[str, Any], tenant: str = "local",
    ) -> PreparedTurn:
        started_at = time.time()
        if req.model not in (None, "", self.served_model):
            raise APIError(404, f"the model '{req.model}' does not exist; this server serves "
                           f"'{self.served_model}'", param="model", code="model_not_found")
        if req.n > self.cfg.max_n:
            raise APIError(400, f"n must be at most {self.cfg.max_n}", param="n")
        if req.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice 'required' and named tool choices are not supported "
                           "(no constrained decoding yet); use 'auto' or 'none'", param="tool_choice")
        max_tokens = self._max_tokens(req)
        messages = normalize_messages(req.messages)
        tools = normalize_tools(req.tools)
        meta = session_meta(headers, body_fields, messages, self.cfg.default_turn_type, tenant)
        prompt_ids = await asyncio.to_thread(self._template, messages, tools)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} "
                           f"tokens, but the messages use {len(prompt_ids)} tokens",
                           param="messages", code="context_length_exceeded")
        params = SamplingParams(
            max_tokens=min(max_tokens, room),
            temperature=req.temperature,
            top_p=req.top_p,
            stop=req.stop_list(),
            seed=req.seed,
            n=req.n,
            ignore_eos=req.ignore_eos,
        )
        return PreparedTurn(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.served_model,
            prompt_ids=prompt_ids,
            params=params,
            meta=meta,
            messages=messages,
            tools=tools,
            parse_tools=bool(tools) and req.tool_choice != "none",
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            started_at=started_at,
        )

    def _max_tokens(self, req: ChatCompletionRequest) -> int:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        value = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if value is None:
            return self.cfg.default_max_tokens
        if value < 1:
            raise APIError(400, f"{name} must be at least 1, got {value}", param=name)
        if value > self.cfg.max_tokens_limit:
            raise APIError(400, f"{name}={value} is larger than this server allows "
                           f"({self.cfg.max_tokens_limit})", param=name)
        return value

    def _template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # a template error is a request problem (e.g. bad roles order)
            raise APIError(400, f"the messages cannot be rendered by the chat template: {e}",
                           param="messages") from None
        return self.segments.encode(text)

    # ---------------------------------------------------------------- non-streaming
    async def complete(self, turn: PreparedTurn) -> dict[str, Any]:
        outputs = await self._engine_call(self.policy.generate(
            turn.prompt_ids, turn.params, session_key=turn.meta.key))
        choices, completion_tokens = [], 0
        for out in sorted(outputs, key=lambda o: o.index):
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            cut = first_stop(text, turn.params.stop)
            if cut is not None:
                text = text[:cut]
            content, calls = (parse_tool_calls(text) if turn.parse_tools else (text, []))
            finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [_call_json(c) for c in calls]
            choices.append({"index": out.index, "message": message, "finish_reason": finish,
                            "logprobs": None})
            completion_tokens += len(out.token_ids)
            self._record(turn, out.index, out.token_ids, out.logprobs, finish, out.policy_version,
                         out.policy_version_end, content, message.get("tool_calls", []),
                         out.versions())
        version = max((o.policy_version_end or o.policy_version) for o in outputs)
        return {
            "id": turn.request_id,
            "object": "chat.completion",
            "created": turn.created,
            "model": turn.model,
            "system_fingerprint": f"clawray-policy-v{version}",
            "choices": choices,
            "usage": _usage(len(turn.prompt_ids), completion_tokens, outputs[0].cached_tokens),
        }

    # ---------------------------------------------------------------- streaming
    async def stream(self, turn: PreparedTurn) -> AsyncIterator[str]:
        """SSE lines of a streamed completion; closing the iterator aborts generation."""
        states = {i: _ChoiceStream(self.tokenizer, turn) for i in range(turn.params.n)}
        version = None
        completion_tokens = 0
        cached = None
        source = self.policy.stream(turn.prompt_ids, turn.params,
                                    session_key=turn.meta.key)
        deltas = _errors_as_api(source)
        # Wait for the first token before the first byte, so engine errors (overload, length)
        # still become a proper HTTP error status in the ingress.
        try:
            first = await anext(deltas, None)
        except BaseException:
            await _aclose(source)
            raise
        try:
            for i in states:
                yield _sse(self._chunk(turn, i, {"role": "assistant", "content": ""}, None, version))
            async for delta in _chain(first, deltas):
                if version is None:
                    version = delta.policy_version
                if cached is None:
                    cached = delta.cached_tokens
                st = states[delta.index]
                completion_tokens += len(delta.token_ids)
                for piece in st.add(delta):
                    yield _sse(self._chunk(turn, delta.index, piece, None, version))
                if delta.finish_reason is not None:
                    for piece in st.finish(delta):
                        yield _sse(self._chunk(turn, delta.index, piece, None, version))
                    yield _sse(self._chunk(turn, delta.index, {}, st.finish_reason, version))
                    self._record(turn, delta.index, st.ids, st.logprobs, st.finish_reason,
                                 st.version_start, st.version_end, st.content or None, st.calls,
                                 st.versions)
            if turn.include_usage:
                yield _sse({"id": turn.request_id, "object": "chat.completion.chunk",
                            "created": turn.created, "model": turn.model, "choices": [],
                            "usage": _usage(len(turn.prompt_ids), completion_tokens, cached)})
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, end the stream
            yield _sse(_api_error_of(e).body())
            yield "data: [DONE]\n\n"
        finally:
            await _aclose(deltas)
            await _aclose(source)
            for i, st in states.items():
                if st.finish_reason is None and st.ids:  # client went away mid-generation
                    self._record(turn, i, st.ids, st.logprobs, "abort", st.version_start,
                                 st.version_end, st.content or None, st.calls, st.versions)

    def _chunk(self, turn: PreparedTurn, index: int, delta: dict[str, Any], finish: str | None,
               version: int | None) -> dict[str, Any]:
        chunk = {
            "id": turn.request_id,
            "object": "chat.completion.chunk",
            "created": turn.created,
            "model": turn.model,
            "system_fingerprint": f"clawray-policy-v{version if version is not None else 0}",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if turn.include_usage:
            chunk["usage"] = None
        return chunk

    async def _engine_call(self, coro: Any) -> Any:
        try:
            return await coro
        except Exception as e:  # noqa: BLE001 - every failure reaches the client as an API error
            raise _api_error_of(e) from None

    # ---------------------------------------------------------------- records
    def _record(self, turn: PreparedTurn, index: int, ids: list[int], logprobs: list[float],
                finish: str, version: int, version_end: int | None, content: str | None,
                tool_calls: list[dict[str, Any]], versions: list[int]) -> None:
        record = TurnRecord(
            record_id=turn.request_id if index == 0 else f"{turn.request_id}#{index}",
            session_id=turn.meta.session_id,
            session_id_source=turn.meta.source,
            turn_type=turn.meta.turn_type,
            session_done=turn.meta.session_done,
            model=turn.model,
            prompt_ids=turn.prompt_ids,
            response_ids=list(ids),
            response_logprobs=list(logprobs),
            finish_reason=finish,
            policy_version=version,
            policy_version_end=version_end,
            messages=turn.messages,
            tools=turn.tools,
            sampling=dataclasses.asdict(turn.params),
            response_text=content,
            tool_calls=tool_calls,
            choice_index=index,
            created_at=turn.created,
            finished_at=time.time(),
            started_at=turn.started_at,
            retry=turn.meta.retry,
            response_versions=list(versions),
            tenant=turn.meta.tenant,
            user=turn.meta.user,
        )
        try:
            self.sink.put(record)
        except Exception:  # a broken sink must never break serving; it is logged loudly
            logger.exception("record sink failed for %s (session %s)", record.record_id,
                             record.session_id)


class _ChoiceStream:
    """Per-choice streaming state: ids, detokenizer, stop cutting, tool-call parsing."""

    def __init__(self, tokenizer: Any, turn: PreparedTurn) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.cutter = StopCutter(turn.params.stop)
        self.parser = StreamingToolCallParser() if turn.parse_tools else None
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.content = ""
        self.calls: list[dict[str, Any]] = []
        self.version_start: int = 0
        self.version_end: int | None = None
        self.versions: list[int] = []
        self.finish_reason: str | None = None

    def add(self, delta: TokenDelta) -> list[dict[str, Any]]:
        if not self.ids:
            self.version_start = delta.policy_version
        self.ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.versions += delta.versions()
        if self.versions and self.versions[-1] != self.version_start:
            self.version_end = self.versions[-1]  # kept if the client goes away mid-stream
        return self._emit(self.cutter.feed(self.detok.add(delta.token_ids)), final=False)

    def finish(self, delta: TokenDelta) -> list[dict[str, Any]]:
        if delta.policy_version_end is not None:  # only the final delta carries it
            self.version_end = delta.policy_version_end
        text = self.cutter.feed(self.detok.finish()) + self.cutter.finish()
        pieces = self._emit(text, final=True)
        self.finish_reason = "tool_calls" if self.calls and delta.finish_reason == "stop" \
            else delta.finish_reason
        return pieces

    def _emit(self, text: str, final: bool) -> list[dict[str, Any]]:
        if self.parser is None:
            self.content += text
            return [{"content": text}] if text else []
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        out = []
        for ev in events:
            if isinstance(ev, ContentDelta) and ev.text:
                self.content += ev.text
                out.append({"content": ev.text})
            elif isinstance(ev, ToolCallEvent):
                call = _call_json(ev.call)
                self.calls.append(call)
                out.append({"tool_calls": [{"index": ev.index, **call}]})
        return out


def _call_json(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _usage(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the engine's prefix cache served."""
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached or 0}}


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _api_error_of(e: BaseException) -> APIError:
    """The HTTP error of a failed engine call: the client's fault is 400 (a retry fails the
    same way); everything else is retryable: overload 429, an engine (or, split, a PolicyServer
    replica) that cannot serve 503, an internal failure 500 — each with OpenAI's error object,
    and ``Retry-After`` where waiting helps. Ray re-raises a replica's exception as a subclass
    of it (``RayTaskError(EngineOverloaded)``), so ``isinstance`` sees through the hop."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineOverloaded):
        return APIError(429, f"the server is overloaded, retry shortly: {_cause(e)}",
                        type="server_error", code="server_overloaded", headers={"Retry-After": "1"})
    if isinstance(e, EngineUnavailable) or _ray_unavailable(e):
        return APIError(503, f"the model server cannot serve right now: {_cause(e)}",
                        type="server_error", code="engine_unavailable",
                        headers={"Retry-After": "5"})
    if isinstance(e, EngineInternalError):
        return APIError(500, f"the engine failed this request, retry it: {_cause(e)}",
                        type="server_error", code="engine_error")
    if isinstance(e, EngineError):
        return APIError(400, _cause(e), code="engine_error")
    logger.error("request failed with an internal error", exc_info=e)
    return APIError(500, f"internal error ({type(e).__name__}); retry the request",
                    type="server_error", code="internal_error")


def _cause(e: BaseException) -> str:
    """The message of an engine error, without Ray's traceback wrapper around it."""
    cause = getattr(e, "cause", None)
    return str(cause if isinstance(cause, BaseException) else e)


def _ray_unavailable(e: BaseException) -> bool:
    """A Serve handle call that found no live replica, a dead actor or a full queue."""
    try:
        import ray.exceptions as rex
        from ray.serve.exceptions import BackPressureError
    except ImportError:  # no Ray: nothing of Ray's to recognize
        return False
    return isinstance(e, (rex.RayActorError, rex.ActorUnavailableError, BackPressureError))


async def _errors_as_api(source: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    try:
        async for item in source:
            yield item
    except Exception as e:  # noqa: BLE001 - every failure reaches the client as an API error
        raise _api_error_of(e) from None


async def _chain(first: TokenDelta | None, rest: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def _aclose(it: Any) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # closing an aborted stream must not mask the original outcome
            logger.debug("closing the engine stream raised", exc_info=True)
