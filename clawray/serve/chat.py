"""The turn service: a ``TurnRequest`` → prompt ids → engine → parsed result or events.

Every client API's wire module (``openai_chat.py``, ``anthropic_messages.py``) goes through
this one path, so templating, sampling, session metadata, records and errors are written once.
No Ray and no web framework here: the Serve ingress is a thin shell around ``ChatService``, so
the whole request path can be tested in-process and benchmarked without Serve. Heavy CPU work
(chat template + tokenization of ~60 KB agent prompts) runs in a worker thread so the event
loop keeps streaming other requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Mapping, Protocol

from clawray.config import ServingConfig
from clawray.gate.core import ServingTally, routed_side
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
from clawray.serve.auth import LOCAL_TENANT
from clawray.serve.protocol import APIError
from clawray.serve.session_meta import SessionMeta, addressed_user, session_meta
from clawray.serve.structured import structural_tag
from clawray.serve.turns import (
    ChoiceEnd,
    ChoiceResult,
    Opened,
    ReasoningDelta,
    StreamUsage,
    TokenLogprobs,
    TextDelta,
    ToolCallDelta,
    TurnEvent,
    TurnRequest,
    TurnResult,
    Usage,
)
from clawray.models.reasoning import OPEN as THINK_OPEN
from clawray.models.reasoning import ReasoningParser, has_think_tokens, split_reasoning
from clawray.models.segment_cache import SegmentCache
from clawray.models.tool_calls import TOOL_CALL_END, ContentDelta, ToolCallEvent
from clawray.serve.tool_parsers import CLAWRAY_FORMAT, make_tool_format

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
    logprobs: bool = False  # the client asked for log-probs
    client_stops: tuple[str, ...] = ()  # the client's stop strings (params.stop may add ours)
    reasoning: bool = False  # split <think>…</think> off the content
    starts_in_reasoning: bool = False  # the prompt ended inside an open <think>
    tool_format: Any = CLAWRAY_FORMAT  # who reads tool calls (serve/tool_parsers.py)
    one_call: bool = False  # parallel_tool_calls false: the first call only
    gate_side: tuple[str, str] | None = None  # (canary salt, side) while a canary runs


def _base_params(params: SamplingParams) -> SamplingParams:
    """What sampled a request whose adapter the engine did not serve: the base policy."""
    return dataclasses.replace(params, adapter=None, adapter_fallback=False)


class ChatService:
    def __init__(
        self,
        tokenizer: Any,
        policy: PolicyClient,
        served_model: str,
        max_model_len: int,
        cfg: ServingConfig,
        sink: RecordSink,
        routing: Callable[[], dict[str, Any] | None] | None = None,
        tally: ServingTally | None = None,
        sampling_defaults: Mapping[str, float] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # what a request that does not set temperature, top_p or repetition_penalty gets: the
        # model's generation_config.json (ModelInfo.sampling_defaults), else 1.0
        self.sampling_defaults = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0,
                                  **(sampling_defaults or {})}
        self.routing = routing  # the policy gate's routing table, as the replica mirrors it
        self.tally = tally  # the gate's serving signals per canary side (errors, latency)
        self.policy = policy
        self.served_model = served_model
        self.max_model_len = max_model_len
        self.cfg = cfg
        self.sink = sink
        # The repeated system prompt, tools and history of agent sessions tokenize once.
        self.segments = SegmentCache(tokenizer)
        if not self.segments.enabled:
            logger.info("prompt segment cache off: %s", self.segments.reason)
        self._token_texts: dict[int, str] = {}
        self.reasoning = cfg.reasoning_parser == "think" or (
            cfg.reasoning_parser == "auto" and has_think_tokens(tokenizer))
        self.tool_format = make_tool_format(cfg.tool_call_parser, tokenizer)

    def token_text(self, token_id: int) -> str:
        """One token's text (for log-probs), as the tokenizer decodes it alone."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    # ---------------------------------------------------------------- preparing a turn
    async def prepare(self, req: TurnRequest, headers: Mapping[str, str],
                      tenant: str = "local") -> PreparedTurn:
        started_at = time.time()
        fields = addressed_user(self.served_model, req.model, req.session_fields, tenant,
                                self._trusted(tenant))
        if req.n > self.cfg.max_n:
            raise APIError(400, f"n must be at most {self.cfg.max_n}", param="n")
        max_tokens = self._max_tokens(req.max_tokens, req.max_tokens_param)
        messages, tools = req.messages, req.tools
        if req.prompt_ids is None:
            meta = session_meta(headers, fields, messages,
                                self.cfg.default_turn_type, tenant, self._trusted(tenant))
            prompt_ids, in_think = await asyncio.to_thread(self._template, messages, tools)
        else:  # a plain prompt: generated on as is, recorded as a side turn
            meta = dataclasses.replace(session_meta(
                headers, fields, [{"role": "user", "content": req.prompt_text}],
                self.cfg.default_turn_type, tenant, self._trusted(tenant)), turn_type="side")
            prompt_ids, in_think = self._raw_prompt(req.prompt_ids), False
        parse_tools = bool(tools) and req.tool_choice.mode != "none"
        constraint = structural_tag(req.output_format, tools if parse_tools else None,
                                    req.tool_choice, req.parallel_tool_calls,
                                    self.reasoning and in_think, self.cfg.json_whitespace)
        # One tool call at most: unless a constraint already ends the turn after one, generation
        # stops at the end of the first (its closing tag is kept in the text, unlike the
        # client's stop strings, so the call parses).
        # A constrained call is written in clawray's markup whatever the model's own format.
        tool_format = self.tool_format if constraint is None else CLAWRAY_FORMAT
        one_call = parse_tools and not req.parallel_tool_calls and constraint is None
        stops = req.stop + ((TOOL_CALL_END,) if one_call and tool_format is CLAWRAY_FORMAT
                            else ())
        room = self.max_model_len - len(prompt_ids)
        what = "messages" if req.prompt_ids is None else "prompt"
        if room < 1:
            raise APIError(400, f"this model's maximum context length is {self.max_model_len} "
                           f"tokens, but the {what} {'use' if what == 'messages' else 'uses'} "
                           f"{len(prompt_ids)} tokens",
                           param=what, code="context_length_exceeded")
        vocab = len(self.tokenizer)
        bad = [t for t in req.logit_bias if t >= vocab]
        if bad:
            raise APIError(400, f"logit_bias names token ids outside the vocabulary (size "
                           f"{vocab}): {bad[:5]}", param="logit_bias")
        params = SamplingParams(
            max_tokens=min(max_tokens, room),
            temperature=self._default(req.temperature, "temperature"),
            top_p=self._default(req.top_p, "top_p"),
            stop=stops,
            seed=req.seed,
            n=req.n,
            ignore_eos=req.ignore_eos,
            top_logprobs=req.top_logprobs if req.logprobs else 0,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=self._default(req.repetition_penalty, "repetition_penalty"),
            logit_bias=tuple(sorted(req.logit_bias.items())),
            structural_tag=constraint,
            adapter=(adapter := self._adapter_of(meta)),
            adapter_fallback=adapter is not None,
        )
        return PreparedTurn(
            request_id=f"{req.id_prefix}{uuid.uuid4().hex}",
            created=int(time.time()),
            model=req.model or self.served_model,  # "<model>:<user>" echoes as asked
            prompt_ids=prompt_ids,
            params=params,
            meta=meta,
            messages=messages,
            tools=tools,
            parse_tools=parse_tools,
            tool_format=tool_format,
            one_call=one_call,
            client_stops=req.stop,
            include_usage=req.include_usage,
            started_at=started_at,
            logprobs=req.logprobs,
            reasoning=self.reasoning and req.prompt_ids is None,
            starts_in_reasoning=self.reasoning and in_think,
            gate_side=self._gate_side(adapter),
        )

    def _default(self, value: float | None, name: str) -> float:
        return self.sampling_defaults[name] if value is None else value

    def _raw_prompt(self, ids: list[int]) -> list[int]:
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        vocab = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"the prompt holds token ids outside the vocabulary (size "
                           f"{vocab}): {bad[:5]}", param="prompt")
        return list(ids)

    def _max_tokens(self, value: int | None, name: str) -> int:
        if value is None:
            return self.cfg.default_max_tokens
        if value < 1:
            raise APIError(400, f"{name} must be at least 1, got {value}", param=name)
        if value > self.cfg.max_tokens_limit:
            raise APIError(400, f"{name}={value} is larger than this server allows "
                           f"({self.cfg.max_tokens_limit})", param=name)
        return value

    def _template(self, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> tuple[list[int], bool]:
        """The prompt ids, and whether the prompt ends inside an open ``<think>``."""
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:  # a template error is a request problem (e.g. bad roles order)
            raise APIError(400, f"the messages cannot be rendered by the chat template: {e}",
                           param="messages") from None
        return self.segments.encode(text), text.rstrip().endswith(THINK_OPEN)

    # ---------------------------------------------------------------- whole answers
    async def run(self, turn: PreparedTurn) -> TurnResult:
        """Generate every choice of ``turn``, record each, and return them parsed."""
        try:
            outputs = await self._engine_call(self.policy.generate(
                turn.prompt_ids, turn.params, session_key=turn.meta.key))
        except APIError as e:
            self._tally(turn, error=e.status >= 500)
            raise
        self._tally(turn, tokens=sum(len(o.token_ids) for o in outputs))
        choices, completion_tokens = [], 0
        for out in sorted(outputs, key=lambda o: o.index):
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            cut = first_stop(text, turn.client_stops)
            if cut is not None:
                text = text[:cut]
            reasoning = None
            if turn.reasoning:
                reasoning, text = split_reasoning(text, turn.starts_in_reasoning)
            content, calls = (turn.tool_format.parse(text, turn.tools) if turn.parse_tools
                              else (text, []))
            calls = calls[:1] if turn.one_call else calls
            finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
            call_dicts = [_call_json(c) for c in calls]
            stop_string = out.stop_string if out.stop_string in turn.client_stops else None
            choices.append(ChoiceResult(out.index, content, call_dicts, finish, stop_string,
                                        list(out.token_ids), list(out.logprobs), reasoning,
                                        out.top_logprobs))
            completion_tokens += len(out.token_ids)
            if out.fell_back:  # the engine had no adapter for the user: the base served
                turn.params = _base_params(turn.params)
            self._record(turn, out.index, out.token_ids, out.logprobs, finish, out.policy_version,
                         out.policy_version_end, content, call_dicts, out.versions())
        version = max((o.policy_version_end or o.policy_version) for o in outputs)
        return TurnResult(choices, Usage(len(turn.prompt_ids), completion_tokens,
                                         outputs[0].cached_tokens), version)

    # ---------------------------------------------------------------- streaming
    async def events(self, turn: PreparedTurn) -> AsyncIterator[TurnEvent]:
        """The turn as events. The first, ``Opened``, comes once the engine produced a token,
        so a failure before it (overload, length) is still a proper HTTP error; later failures
        raise ``APIError`` from the iterator. Closing the iterator aborts generation; what was
        generated by then is recorded as an aborted turn."""
        states = {i: _ChoiceStream(self.tokenizer, turn, i) for i in range(turn.params.n)}
        completion_tokens = 0
        source = self.policy.stream(turn.prompt_ids, turn.params, session_key=turn.meta.key)
        deltas = _errors_as_api(source)
        try:
            first = await anext(deltas, None)
            cached = first.cached_tokens if first is not None else None
            if first is not None and first.fell_back:
                turn.params = _base_params(turn.params)
            yield Opened(first.policy_version if first is not None else 0, cached)
            async for delta in _chain(first, deltas):
                st = states[delta.index]
                completion_tokens += len(delta.token_ids)
                if turn.logprobs and delta.token_ids:
                    yield TokenLogprobs(delta.index, list(delta.token_ids), list(delta.logprobs),
                                        delta.top_logprobs)
                for ev in st.add(delta):
                    yield ev
                if delta.finish_reason is not None:
                    for ev in st.finish(delta):
                        yield ev
                    stop_string = (delta.stop_string if delta.stop_string in turn.client_stops
                                   else None)
                    yield ChoiceEnd(delta.index, st.finish_reason, stop_string,
                                    st.version_end if st.version_end is not None
                                    else st.version_start)
                    self._record(turn, delta.index, st.ids, st.logprobs, st.finish_reason,
                                 st.version_start, st.version_end, st.content or None, st.calls,
                                 st.versions)
            self._tally(turn, tokens=completion_tokens)
            yield StreamUsage(Usage(len(turn.prompt_ids), completion_tokens, cached))
        except APIError as e:
            self._tally(turn, error=e.status >= 500)
            raise
        finally:
            await _aclose(deltas)
            await _aclose(source)
            for i, st in states.items():
                if st.finish_reason is None and st.ids:  # client went away mid-generation
                    self._record(turn, i, st.ids, st.logprobs, "abort", st.version_start,
                                 st.version_end, st.content or None, st.calls, st.versions)

    def _gate_side(self, adapter: str | None) -> tuple[str, str] | None:
        """While a canary runs: its salt and the side ``adapter`` serves (the candidate, or
        the incumbent to everyone else), for the gate's serving signals."""
        r = self.routing() if self.routing is not None else None
        if not r or not r.get("candidate_adapter"):
            return None
        return r["salt"], "candidate" if adapter == r["candidate_adapter"] else "incumbent"

    def _tally(self, turn: PreparedTurn, *, error: bool = False, tokens: int = 0) -> None:
        """Count a finished request (or one that failed) toward its canary side."""
        if self.tally is not None and turn.gate_side is not None:
            salt, side = turn.gate_side
            self.tally.add(salt, side, error=error, tokens=tokens,
                           seconds=time.time() - turn.started_at)

    async def _engine_call(self, coro: Any) -> Any:
        try:
            return await coro
        except Exception as e:  # noqa: BLE001 - every failure reaches the client as an API error
            raise api_error_of(e) from None

    def _adapter_of(self, meta: SessionMeta) -> str | None:
        """With the policy gate on (its routing table mirrored here): the candidate's adapter
        for a session in its canary (sticky: the session key's bucket), else the incumbent's
        (None: the base model). Otherwise the policy user's own adapter when the engine serves
        one (per-user policies), else None: the shared policy. The colocated ingress sees its
        engine's adapters; the split layout's cannot, so it names the user's adapter and the
        PolicyServer replica falls back to the shared policy if it has none
        (``adapter_fallback``, recorded as served)."""
        r = self.routing() if self.routing is not None else None
        side = routed_side(r, meta.key)
        if side is not None:
            return r[f"{side}_adapter"]
        adapters = getattr(self.policy, "adapters", None)
        if not callable(adapters):
            return meta.policy_user if getattr(self.policy, "names_adapters", False) else None
        return meta.policy_user if meta.policy_user in adapters() else None

    def _trusted(self, tenant: str) -> bool:
        """May this key name the end user whose policy serves it (a trusted app, or no auth)?"""
        return tenant == LOCAL_TENANT or tenant in self.cfg.trusted_app_tenants

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
            policy_user=turn.meta.policy_user,
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

    def __init__(self, tokenizer: Any, turn: PreparedTurn, index: int = 0) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer)
        self.cutter = StopCutter(turn.client_stops)
        self.parser = turn.tool_format.stream(turn.tools) if turn.parse_tools else None
        self.one_call = turn.one_call
        self.thinking = ReasoningParser(turn.starts_in_reasoning) if turn.reasoning else None
        self.reasoning = ""
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.content = ""
        self.calls: list[dict[str, Any]] = []
        self.version_start: int = 0
        self.version_end: int | None = None
        self.versions: list[int] = []
        self.finish_reason: str | None = None

    def add(self, delta: TokenDelta) -> list[TextDelta | ReasoningDelta | ToolCallDelta]:
        if not self.ids:
            self.version_start = delta.policy_version
        self.ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.versions += delta.versions()
        if self.versions and self.versions[-1] != self.version_start:
            self.version_end = self.versions[-1]  # kept if the client goes away mid-stream
        return self._emit(self.cutter.feed(self.detok.add(delta.token_ids)), final=False)

    def finish(self, delta: TokenDelta) -> list[TextDelta | ReasoningDelta | ToolCallDelta]:
        if delta.policy_version_end is not None:  # only the final delta carries it
            self.version_end = delta.policy_version_end
        text = self.cutter.feed(self.detok.finish()) + self.cutter.finish()
        pieces = self._emit(text, final=True)
        self.finish_reason = "tool_calls" if self.calls and delta.finish_reason == "stop" \
            else delta.finish_reason
        return pieces

    def _emit(self, text: str, final: bool) -> list[TextDelta | ReasoningDelta | ToolCallDelta]:
        if self.thinking is None:
            return self._emit_content(text, final)
        pieces = self.thinking.feed(text) if text else []
        if final:
            pieces += self.thinking.finish()
        out: list[TextDelta | ReasoningDelta | ToolCallDelta] = []
        for kind, piece in pieces:
            if kind == "reasoning":
                self.reasoning += piece
                out.append(ReasoningDelta(self.index, piece))
            else:
                out += self._emit_content(piece, False)
        if final:
            out += self._emit_content("", True)
        return out

    def _emit_content(self, text: str, final: bool) -> list[TextDelta | ToolCallDelta]:
        if self.parser is None:
            self.content += text
            return [TextDelta(self.index, text)] if text else []
        events = self.parser.feed(text, self.ids) if text else []
        if final:
            events += self.parser.finish()
        out: list[TextDelta | ToolCallDelta] = []
        for ev in events:
            if isinstance(ev, ContentDelta) and ev.text:
                self.content += ev.text
                out.append(TextDelta(self.index, ev.text))
            elif isinstance(ev, ToolCallEvent) and not (self.one_call and ev.index > 0):
                call = _call_json(ev.call)
                self.calls.append(call)
                out.append(ToolCallDelta(self.index, ev.index, call))
        return out


def _call_json(call: Any) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def api_error_of(e: BaseException) -> APIError:
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
        raise api_error_of(e) from None


async def _chain(first: TokenDelta | None, rest: AsyncIterator[TokenDelta]
                 ) -> AsyncIterator[TokenDelta]:
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
