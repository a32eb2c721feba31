"""The ChatML chat template of the embedded default model (Hermes/Qwen2.5-style tool markup).

Rendering rules:

- every message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; ``content`` may be a
  string, missing/null, or a list of ``{"type": "text", "text": ...}`` parts (text parts are
  concatenated, other parts are dropped: the model reads text only);
- ``tools`` go into the system turn (after the system message's content, if any) inside
  ``<tools></tools>``, one JSON schema per line, with the instruction to answer with
  ``<tool_call>\\n{"name": <name>, "arguments": <json object>}\\n</tool_call>``;
- an assistant message's ``tool_calls`` are rendered as such blocks after its content;
  ``arguments`` given as a dict are rendered as a JSON object, given as a string verbatim
  (OpenAI clients send the JSON text they received);
- consecutive ``tool`` messages are grouped into one ``user`` turn of
  ``<tool_response>\\n...\\n</tool_response>`` blocks;
- ``add_generation_prompt`` appends ``<|im_start|>assistant\\n``.

transformers renders templates with ``trim_blocks`` and ``lstrip_blocks``; the template uses
``{%- -%}`` everywhere so that no stray whitespace reaches the prompt.
"""

from __future__ import annotations

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"

CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is mapping and part.type == 'text' -%}{{- part.text -}}
{%- elif part is string -%}{{- part -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(start=0) -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages and messages[0].role == 'system' -%}
{{- text_of(messages[0].content) + '\n\n' -}}
{%- set ns.start = 1 -%}
{%- endif -%}
{{- '# Tools\n\nYou can call tools to help with the request. The tools are described by the JSON schemas inside <tools></tools>:\n' -}}
{{- '<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>' -}}
{{- '\n\nTo call a tool, answer with its name and a JSON object of arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{"name": <name>, "arguments": <json object>}\n</tool_call>' -}}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages[ns.start:] -%}
{%- if message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + text_of(message.content) -}}
{%- for call in (message.tool_calls or []) -%}
{%- set fn = call.function if call.function is defined else call -%}
{%- if not loop.first or text_of(message.content) -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
{%- if fn.arguments is string -%}{{- fn.arguments -}}
{%- elif fn.arguments is defined and fn.arguments is not none -%}{{- fn.arguments | tojson -}}
{%- else -%}{{- '{}' -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""


def with_default_system(template: str, system: str) -> str:
    """``template`` with ``system`` as the system message of conversations that bring none
    (what many instruct models' own templates do, SmolLM2's among them)."""
    import json

    return ("{%- if not messages or messages[0].role != 'system' -%}"
            "{%- set messages = [{'role': 'system', 'content': " + json.dumps(system)
            + "}] + messages -%}{%- endif -%}\n" + template)
