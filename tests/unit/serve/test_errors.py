"""Error semantics of the chat path: which failures the client should retry (5xx, 429 with
Retry-After) and which it caused (400); a failure after the stream started ends it with an SSE
error event and ``[DONE]``; ``null`` is the default where OpenAI accepts it; a field this server
does not implement is refused by name instead of being silently ignored."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.inference.engine import (
    EngineError,
    EngineInternalError,
    EngineOverloaded,
    EngineUnavailable,
    TokenDelta,
)
from clawray.serve.chat import ChatService
from clawray.serve.openai_chat import complete, stream, to_turn_request, api_error_of
from clawray.serve.protocol import APIError, ChatCompletionRequest, parse_request
from tests.support.common import ListSink


@pytest.mark.parametrize("exc, status, kind, code, retry_after", [
    (EngineError("prompt too long"), 400, "invalid_request_error", "engine_error", None),
    (EngineOverloaded("queue full"), 429, "server_error", "server_overloaded", "1"),
    (EngineUnavailable("shut down"), 503, "server_error", "engine_unavailable", "5"),
    (EngineInternalError("decode step failed"), 500, "server_error", "engine_error", None),
    (KeyError("a bug"), 500, "server_error", "internal_error", None),
])
def test_engine_failures_map_to_retryable_or_client_errors(exc, status, kind, code, retry_after):
    e = api_error_of(exc)
    assert (e.status, e.type, e.code, e.headers.get("Retry-After")) == (
        status, kind, code, retry_after)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_an_engine_error_raised_in_a_policy_replica_keeps_its_meaning():
    """Split layout: Ray re-raises the PolicyServer's exception as RayTaskError(cause)."""
    from ray.exceptions import ActorDiedError, RayTaskError

    for cause, status in ((EngineOverloaded("queue full"), 429),
                          (EngineInternalError("step failed"), 500), (EngineError("long"), 400)):
        wrapped = RayTaskError("generate", "Traceback ...", cause).as_instanceof_cause()
        e = api_error_of(wrapped)
        assert e.status == status and "Traceback" not in e.message, e.message
    assert api_error_of(ActorDiedError()).status == 503


class FailingPolicy:
    """Streams two tokens, then fails as ``exc``."""

    def __init__(self, exc):
        self.exc = exc

    async def generate(self, prompt_ids, params, session_key=None):
        raise self.exc

    async def stream(self, prompt_ids, params, session_key=None):
        for tok in (40, 41):
            yield TokenDelta([tok], [-0.5], 0, None)
        raise self.exc

    async def status(self):
        raise NotImplementedError


@pytest.mark.parametrize("exc, status", [(EngineInternalError("decode step failed"), 500),
                                         (RuntimeError("a bug of ours"), 500),
                                         (EngineUnavailable("the engine died"), 503)])
async def test_a_failure_mid_stream_ends_with_an_error_event_and_done(tiny_tokenizer, exc,
                                                                       status):
    sink = ListSink()
    svc = ChatService(tiny_tokenizer, FailingPolicy(exc), "m", 4096, ServingConfig(), sink)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                max_tokens=8, stream=True)
    turn = await svc.prepare(to_turn_request(req, {}), {"x-session-id": "s"})
    lines = [line async for line in stream(svc, turn)]
    assert lines[-1] == "data: [DONE]\n\n"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and error["code"] in ("engine_error",
                                                                 "internal_error",
                                                                 "engine_unavailable")
    assert status == api_error_of(exc).status
    # the two tokens served before the failure are kept as an aborted turn
    [rec] = sink.records
    assert rec.response_ids == [40, 41] and rec.finish_reason == "abort"
    # the same failure before any token: a proper HTTP error, nothing recorded
    with pytest.raises(APIError) as e:
        await complete(svc, turn)
    assert e.value.status == status


def _parse(body):
    return parse_request(json.dumps({"messages": [{"role": "user", "content": "x"}], **body})
                         .encode())


def test_null_means_the_default_where_openai_accepts_it():
    req, _ = _parse({"stream": None, "temperature": None, "top_p": None, "n": None,
                     "stop": None, "seed": None, "max_tokens": None, "tools": None,
                     "stream_options": None, "tool_choice": None, "model": None})
    assert (req.stream, req.temperature, req.top_p, req.n) == (False, 1.0, 1.0, 1)


@pytest.mark.parametrize("field, value", [
    ("audio", {"voice": "x"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"})])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(APIError) as e:
        _parse({field: value})
    assert (e.value.status, e.value.param, e.value.code) == (400, field, "unsupported_parameter")
    assert field in e.value.message


@pytest.mark.parametrize("field, value", [
    ("logprobs", False), ("logprobs", None), ("parallel_tool_calls", True),
    ("response_format", {"type": "text"}), ("response_format", None), ("presence_penalty", 0), ("frequency_penalty", 0.0),
    ("logit_bias", {}), ("top_logprobs", 0), ("user", "u1")])
def test_the_values_that_ask_for_nothing_are_accepted(field, value):
    _parse({field: value})


@pytest.mark.parametrize("body, param", [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                                         ({"logprobs": "yes"}, "logprobs"),
                                         ({"presence_penalty": 2.5}, "presence_penalty"),
                                         ({"frequency_penalty": -3}, "frequency_penalty"),
                                         ({"repetition_penalty": 0}, "repetition_penalty"),
                                         ({"logit_bias": {"abc": 1}}, "logit_bias"),
                                         ({"logit_bias": {"5": 101}}, "logit_bias")])
def test_bad_logprobs_settings_are_refused(body, param):
    with pytest.raises(APIError) as e:
        _parse(body)
    assert (e.value.status, e.value.param) == (400, param)
