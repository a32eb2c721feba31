"""What a client asks the output to be — a JSON answer, a tool call — as one constraint.

Every API's way of asking (OpenAI ``response_format`` and ``tool_choice: "required"`` / a named
function, the Responses API's ``text.format``, Anthropic's ``tool_choice: any | tool`` and
``output_config.format``) is normalized by its wire module into ``OutputFormat`` and
``ToolChoice`` values, and ``structural_tag`` turns them into one xgrammar structural tag, the
constraint both engines enforce (vLLM's structured outputs; xgrammar's matcher on the
transformers engine). Tool calls are constrained to the chat template's own markup
(``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``), so a constrained turn is recorded,
parsed and trained exactly like a free one.

The structural tag is plain JSON (xgrammar's documented format), so this module does not need
xgrammar; the engine compiles it and a schema it cannot enforce is a 400.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from clawray.models.reasoning import CLOSE as THINK_CLOSE
from clawray.models.reasoning import OPEN as THINK_OPEN
from clawray.models.tool_calls import CALL_MARKUP_END, CALL_SEPARATOR, call_markup_begin
from clawray.serve.protocol import APIError

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class OutputFormat:
    """The answer must be JSON: any object (``schema`` None, OpenAI's ``json_object``) or a value
    matching ``schema`` (``json_schema``)."""

    schema: dict[str, Any] | None = None
    name: str | None = None  # the schema's name, as the client gave it


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """``mode``: ``auto`` (the model decides), ``none`` (no calls), ``required`` (at least one
    call of a declared tool), ``named`` (exactly one call of ``name``)."""

    mode: str = "auto"
    name: str | None = None

    @property
    def forces_call(self) -> bool:
        return self.mode in ("required", "named")


AUTO = ToolChoice()


def tool_choice_of(value: Any, param: str = "tool_choice") -> ToolChoice:
    """OpenAI's ``tool_choice`` (Chat Completions and Responses spellings) as a ToolChoice."""
    if value is None:
        return AUTO
    if isinstance(value, str):
        if value in ("auto", "none", "required"):
            return ToolChoice(value)
        raise APIError(400, f"{param} must be 'auto', 'none', 'required' or a function, got "
                       f"{value!r}", param=param)
    if isinstance(value, dict):
        kind = value.get("type")
        # Chat Completions: {"type": "function", "function": {"name": …}}; Responses: {"type":
        # "function", "name": …}.
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")
        if kind == "function" and isinstance(name, str) and name:
            return ToolChoice("named", name)
        if kind == "allowed_tools":
            raise APIError(400, f"{param} type 'allowed_tools' is not supported; use 'auto', "
                           "'required' or one named function", param=param,
                           code="unsupported_parameter")
    raise APIError(400, f"{param} must be 'auto', 'none', 'required' or "
                   "{'type': 'function', 'function': {'name': …}}", param=param)


def output_format_of(value: Any, param: str) -> OutputFormat | None:
    """OpenAI's ``response_format`` (``{"type": "json_schema", "json_schema": {"name", "schema",
    "strict"}}``) or the Responses API's ``text.format`` (the same fields, flat) as an
    OutputFormat; None for plain text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be an object", param=param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat()
    if kind == "json_schema":
        spec = value.get("json_schema", value)  # Chat Completions nests it; Responses does not
        where = f"{param}.json_schema" if "json_schema" in value else param
        if not isinstance(spec, dict):
            raise APIError(400, f"{where} must be an object", param=where)
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"{where}.name is required", param=f"{where}.name")
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise APIError(400, f"{where}.schema must be a JSON schema object",
                           param=f"{where}.schema")
        return OutputFormat(schema, name)
    raise APIError(400, f"{param}.type must be 'text', 'json_object' or 'json_schema', got "
                   f"{kind!r}", param=f"{param}.type")


def structural_tag(fmt: OutputFormat | None, tools: list[dict[str, Any]] | None,
                   choice: ToolChoice, parallel_tool_calls: bool,
                   in_reasoning: bool = False, whitespace: int | None = 2) -> str | None:
    """The constraint the engine enforces, or None when the output is free.

    - a forced call (``required`` / ``named``): only tool-call markup, at least one call (one
      when named or with ``parallel_tool_calls`` false), each naming a declared tool with
      arguments that match its ``parameters`` schema;
    - a JSON format with tools the model may call (``auto``): a JSON answer *or* tool calls;
    - a JSON format otherwise: the JSON answer;
    - with ``in_reasoning`` (the prompt ends inside ``<think>``) the reasoning runs free up to
      ``</think>`` first;
    - ``whitespace`` bounds each run of whitespace in the JSON (serving.json_whitespace).
    """
    tools = tools or []
    names = [t["function"]["name"] for t in tools]
    if choice.forces_call and not tools:
        raise APIError(400, f"tool_choice '{choice.mode}' needs at least one tool in 'tools'",
                       param="tool_choice")
    if choice.mode == "named" and choice.name not in names:
        raise APIError(400, f"tool_choice names the function '{choice.name}', which is not among "
                       f"the tools ({', '.join(names)})", param="tool_choice")
    calls: dict[str, Any] | None = None
    if choice.mode == "named":
        calls = _call_tag(next(t for t in tools if t["function"]["name"] == choice.name),
                          whitespace)
    elif choice.mode == "required" or (fmt is not None and tools and choice.mode == "auto"):
        calls = {"type": "tags_with_separator", "tags": [_call_tag(t, whitespace) for t in tools],
                 "separator": CALL_SEPARATOR, "at_least_one": True,
                 "stop_after_first": not parallel_tool_calls}
    answer = _json(fmt.schema, whitespace) if fmt is not None else None
    if choice.forces_call:
        body = calls
    elif answer is not None and calls is not None:
        body = {"type": "or", "elements": [answer, calls]}
    else:
        body = answer
    if body is None:
        return None
    if in_reasoning:
        body = {"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "end": THINK_CLOSE,
             "content": {"type": "any_text", "excludes": [THINK_OPEN, THINK_CLOSE]}},
            body]}
    return json.dumps({"type": "structural_tag", "format": body})


def _json(schema: dict[str, Any] | None, whitespace: int | None) -> dict[str, Any]:
    out = {"type": "json_schema", "json_schema": schema if schema is not None else ANY_OBJECT}
    if whitespace is not None:
        out["max_whitespace_cnt"] = whitespace
    return out


def _call_tag(tool: dict[str, Any], whitespace: int | None) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "tag", "begin": call_markup_begin(fn["name"]),
            "content": _json(params, whitespace), "end": CALL_MARKUP_END}
