"""The one internal request model behind every front door, and what a turn produces.

Each client API (OpenAI Chat Completions, Anthropic Messages, …) lives in its own small wire
module that turns its request into a ``TurnRequest`` and renders ``TurnResult`` / the stream of
``TurnEvent``s in its own format. Sampling, chat templating, session metadata, records, auth
and errors are written once, in ``ChatService`` (chat.py), against these types.

Messages and tools are in the chat template's form (OpenAI-style dicts: roles ``system``,
``user``, ``assistant`` with ``tool_calls``, ``tool`` with ``tool_call_id``), which is also what
the TurnRecord keeps, so sessions, next states and judges read every API's turns alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from clawray.serve.structured import AUTO, OutputFormat, ToolChoice


@dataclasses.dataclass
class TurnRequest:
    """One generation request, independent of the API that carried it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    model: str | None = None
    max_tokens: int | None = None  # None: serving.default_max_tokens
    max_tokens_param: str = "max_tokens"  # the API's name for it, for error messages
    # None: not set by the client; the served model's default (its generation_config.json),
    # else 1.0
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    tool_choice: ToolChoice = AUTO  # required / named: constrained decoding
    parallel_tool_calls: bool = True  # False: generation ends with the first tool call
    output_format: OutputFormat | None = None  # a JSON answer (constrained decoding)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = dataclasses.field(default_factory=dict)
    logprobs: bool = False  # report each sampled token's log-prob
    top_logprobs: int = 0  # and this many most likely alternatives
    stream: bool = False
    include_usage: bool = False
    # Session metadata fields the API carries in its body (session_id, user, …).
    session_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    id_prefix: str = "chatcmpl-"  # the API's response id prefix
    # /v1/completions: the prompt as ids, generated on as is (no chat template, ``messages``
    # empty); such a turn is a side turn (recorded, never trained: it has no conversation).
    prompt_ids: list[int] | None = None
    prompt_text: str | None = None  # that prompt's text (derives the session id)


@dataclasses.dataclass
class ChoiceResult:
    """One finished completion, parsed: text and tool calls, with the exact ids behind them."""

    index: int
    content: str | None
    tool_calls: list[dict[str, Any]]  # {"id", "type": "function", "function": {name, arguments}}
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    stop_string: str | None
    token_ids: list[int]
    logprobs: list[float]
    reasoning: str | None = None  # the <think> part (serving.reasoning_parser)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token, when asked


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens the engine's prefix cache served


@dataclasses.dataclass
class TurnResult:
    choices: list[ChoiceResult]
    usage: Usage
    policy_version: int


# ---------------------------------------------------------------- streamed events
@dataclasses.dataclass
class Opened:
    """The engine produced its first token: from here on errors are reported in-band."""

    policy_version: int
    cached_tokens: int | None


@dataclasses.dataclass
class TextDelta:
    index: int
    text: str


@dataclasses.dataclass
class ReasoningDelta:
    """A piece of the reply's reasoning (``<think>…</think>``, without the tags)."""

    index: int
    text: str


@dataclasses.dataclass
class TokenLogprobs:
    """The sampled ids of one engine step and their log-probs (only when the request asked);
    they come before the text they decode to."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclasses.dataclass
class ToolCallDelta:
    """A whole tool call, emitted as soon as the model closed it."""

    index: int
    call_index: int
    call: dict[str, Any]


@dataclasses.dataclass
class ChoiceEnd:
    index: int
    finish_reason: str
    stop_string: str | None
    policy_version: int


@dataclasses.dataclass
class StreamUsage:
    usage: Usage


TurnEvent = Union[Opened, TextDelta, ReasoningDelta, TokenLogprobs, ToolCallDelta, ChoiceEnd,
                  StreamUsage]
