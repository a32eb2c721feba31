"""OpenAI chat-completions wire models: request validation and normalization.

The ingress parses bodies itself (size limit first, then JSON, then these models) so every
bad input becomes an OpenAI-format error with a precise message instead of a framework 422/500.
Unknown top-level fields are accepted and ignored, as OpenAI-compatible servers do, except the
session metadata fields, which are read and stripped before generation.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError, field_validator

Role = Literal["system", "developer", "user", "assistant", "tool"]

# Body fields that carry session metadata (see session_meta.py); never generated on.
SESSION_BODY_FIELDS = ("session_id", "turn_type", "session_done", "prompt_cache_key", "user")
MAX_ID_CHARS = 500  # session ids and user ids
# Fields OpenAI (and vLLM) accept as null, meaning "the default".
NULL_MEANS_DEFAULT = ("stream", "stream_options", "temperature", "top_p", "n", "stop", "seed",
                      "max_tokens", "max_completion_tokens", "tools", "tool_choice",
                      "ignore_eos", "model", "logprobs", "top_logprobs",
                      "parallel_tool_calls", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "logit_bias", "response_format")
# Fields this server does not implement yet, and the values that ask for nothing: any other
# value is refused with a 400 naming the field instead of being silently ignored.
UNSUPPORTED = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


class APIError(Exception):
    """An error the client should see, rendered in OpenAI's JSON error format."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        }


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Open):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Open):
    include_usage: bool = False


class ChatCompletionRequest(_Open):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM extra
    logit_bias: dict[str, float] | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM-compatible extras
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 8 or any(not s for s in items):
            raise ValueError("stop must be up to 8 non-empty strings")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return check_logit_bias(v)

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


SAMPLING_DEFAULTED = ("temperature", "top_p", "repetition_penalty")


def client_sampling(req: BaseModel) -> dict[str, Any]:
    """The request's ``temperature``, ``top_p`` and ``repetition_penalty`` where the client
    set them (a null counts as unset), else None: the served model's defaults then apply."""
    return {name: getattr(req, name) if name in req.model_fields_set else None
            for name in SAMPLING_DEFAULTED if name in type(req).model_fields}


def check_logit_bias(v: dict[str, float] | None) -> dict[str, float] | None:
    """OpenAI's ``logit_bias``: token-id keys, biases in [-100, 100], at most 300."""
    for key, bias in (v or {}).items():
        if not key.isdigit():
            raise ValueError(f"keys must be token ids, got {key!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"biases must be in [-100, 100], got {bias} for {key}")
    if v and len(v) > 300:
        raise ValueError("at most 300 token biases")
    return v


def parse_request(raw: bytes) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """Decode and validate a body; returns the request and the stripped session fields."""
    data = json_object(raw)
    session_fields = {k: data.pop(k) for k in SESSION_BODY_FIELDS if k in data}
    for name in ("session_id", "user", "prompt_cache_key"):
        check_id(session_fields.get(name), name)
    for name in NULL_MEANS_DEFAULT:
        if name in data and data[name] is None:
            del data[name]
    refuse_unsupported(data, UNSUPPORTED)
    return validated(ChatCompletionRequest, data, ("messages",)), session_fields


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 saying what is wrong with it."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    return data


def refuse_unsupported(data: dict[str, Any], unsupported: dict[str, tuple[Any, ...]]) -> None:
    """400 naming the first field whose value asks for something not built (any value other
    than those listed, which ask for nothing)."""
    for name, nothing in unsupported.items():
        if name in data and not any(data[name] == v and type(data[name]) is type(v)
                                    for v in nothing):
            raise APIError(400, f"'{name}' is not supported by this server yet (send it "
                           f"{_nothing(nothing)} or leave it out)", param=name,
                           code="unsupported_parameter")


def validated(model: type[BaseModel], data: dict[str, Any], required: tuple[str, ...]) -> Any:
    """``model`` from ``data``; a missing required field or a bad value is a 400 naming it."""
    for name in required:
        if name not in data:
            raise APIError(400, f"'{name}' is required", param=name)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise APIError(400, f"invalid value for '{loc}': {err['msg']}", param=loc) from None


def _nothing(values: tuple[Any, ...]) -> str:
    shown = [json.dumps(v) for v in values]
    return " or ".join(shown)


def check_id(value: Any, name: str) -> None:
    if value is None:
        return
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a string", param=name)
    if len(str(value)) > MAX_ID_CHARS:
        raise APIError(400, f"'{name}' is longer than {MAX_ID_CHARS} characters", param=name)


def normalize_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them.

    ``developer`` becomes ``system``; content-part arrays become their concatenated text (only
    text parts are supported); tool-call arguments given as JSON strings are parsed to objects
    when they are valid JSON (so the template renders one canonical form).
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": _text_of(m.content, i)}
        if m.tool_calls:
            if role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages may have tool_calls",
                               param=f"messages.{i}.tool_calls")
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": parse_arguments(tc.function.arguments)},
                }
                for tc in m.tool_calls
            ]
        if role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        reasoning = (m.model_extra or {}).get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning:
            msg["reasoning_content"] = reasoning  # templates that render past reasoning use it
        if m.name:
            msg["name"] = m.name
        out.append(msg)
    return out


def normalize_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def _text_of(content: str | list[ContentPart] | None, i: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400,
                f"messages[{i}]: content part of type {part.type!r} is not supported (text only)",
                param=f"messages.{i}.content",
            )
        texts.append(part.text)
    return "".join(texts)


def parse_arguments(arguments: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


class FeedbackRequest(BaseModel):
    """``POST /v1/feedback``: a thumbs up/down for one response or a whole session."""

    model_config = ConfigDict(extra="forbid")

    response_id: str | None = Field(None, max_length=200)
    session_id: str | None = Field(None, max_length=MAX_ID_CHARS)
    # the end user whose session it is, when requests named one (``user`` / ``X-User-Id``)
    user: str | None = Field(None, max_length=MAX_ID_CHARS)
    rating: Literal["up", "down"] | int
    text: str | None = Field(None, max_length=8000)

    @field_validator("rating")
    @classmethod
    def _rating(cls, v: str | int) -> str | int:
        if v not in ("up", "down", 1, -1):
            raise ValueError("rating must be 'up', 'down', 1 or -1")
        return v

    def value(self) -> int:
        return 1 if self.rating in ("up", 1) else -1


def parse_feedback(raw: bytes) -> FeedbackRequest:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    try:
        req = FeedbackRequest.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "body"
        raise APIError(400, f"invalid value for '{loc}': {err['msg']}", param=loc) from None
    if not (req.response_id or req.session_id):
        raise APIError(400, "give 'response_id' (one turn) or 'session_id' (a whole session)",
                       param="response_id")
    return req
