"""Request bodies of ``bench/serving.py``: what an agent sends, with a small ``max_tokens``.

Scenarios:

- ``stream``: a short agent turn (system prompt of ~1.5 KB, two tool schemas, one user
  message) with ``stream: true`` and ``stream_options.include_usage``, as OpenClaw sends it;
- ``json``: the same body without streaming;
- ``openclaw-stream``: a real captured OpenClaw request (``tests/fixtures/openclaw``: a ~48 KB
  system prompt, 12 tools, ~60 KB in all), streaming. Here chat templating and tokenization
  cost real CPU in every setup, as they do in production.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

OPENCLAW_FIXTURE = "session_s1_t2.json"

SYSTEM_PROMPT = (
    "You are a coding agent running in the user's terminal. You can read files and run shell "
    "commands through the tools you are given. Work step by step: look before you change "
    "anything, keep edits small, and explain what you did in one or two sentences at the end. "
    "Never run commands that delete data outside the working directory. When a command fails, "
    "read its error output and try a different approach instead of repeating it. Prefer the "
    "project's own scripts (make, npm run, pytest) over ad-hoc commands. Keep answers short; "
    "the user reads them in a narrow terminal window.\n\n"
    "Runtime: agent=main | session=bench-1 | os=linux | shell=bash | cwd=/home/user/project\n"
    "Workspace notes: the repository uses Python 3.11 with a virtualenv in .venv; tests live "
    "in tests/ and run with pytest; the web UI lives in ui/ and builds with npm. Large files "
    "(over 1 MB) should be inspected with head or grep rather than read in full. The user "
    "prefers unified diffs when you show changes, and short commit messages in the imperative "
    "mood. If you are unsure what the user wants, ask one precise question instead of guessing."
)

TOOLS = [
    {"type": "function", "function": {
        "name": "read", "description": "Read a text file from the workspace.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the workspace."},
            "offset": {"type": "integer", "description": "First line to read (1-based)."},
            "limit": {"type": "integer", "description": "Maximum number of lines."}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "exec", "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "The command line to run."},
            "timeout_s": {"type": "number", "description": "Kill the command after this long."}},
            "required": ["command"]}}},
]


def fixtures_dir() -> Path:
    """The repository's ``tests/fixtures/openclaw``, or ``$CLAWRAY_FIXTURES``."""
    default = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "openclaw"
    return Path(os.environ.get("CLAWRAY_FIXTURES", default))


def agent_turn(model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                     {"role": "user", "content": "Which file in this project is the largest? "
                                                 "List the top-level files first."}],
        "tools": TOOLS, "tool_choice": "auto", "max_completion_tokens": max_tokens,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def openclaw_turn(model: str, max_tokens: int) -> dict[str, Any] | None:
    path = fixtures_dir() / OPENCLAW_FIXTURE
    if not path.is_file():
        return None
    body = json.loads(path.read_text())["body"]
    return {**body, "model": model, "max_completion_tokens": max_tokens}


def make_bodies(scenarios: list[str], model: str, max_tokens: int, folder: Path,
                log: Callable[[str], None] = print) -> dict[str, Path]:
    """Write the body of each scenario to ``folder``; returns scenario -> file."""
    out = {}
    for name in scenarios:
        if name == "stream":
            body = agent_turn(model, max_tokens, stream=True)
        elif name == "json":
            body = agent_turn(model, max_tokens, stream=False)
        elif name == "openclaw-stream":
            body = openclaw_turn(model, max_tokens)
            if body is None:
                log(f"skipping openclaw-stream: no fixture {OPENCLAW_FIXTURE} in {fixtures_dir()}")
                continue
        else:
            raise SystemExit(f"unknown scenario {name!r}: use stream, json, openclaw-stream")
        path = folder / f"body-{name}.json"
        path.write_text(json.dumps(body))
        out[name] = path
    return out


def describe(path: Path) -> dict[str, Any]:
    """What a body holds, without the long text (for the results file)."""
    body = json.loads(path.read_text())
    return {"bytes": path.stat().st_size, "model": body.get("model"),
            "messages": [m["role"] for m in body["messages"]],
            "tools": [t["function"]["name"] for t in body.get("tools") or []],
            "stream": body.get("stream", False), "stream_options": body.get("stream_options"),
            "max_completion_tokens": body.get("max_completion_tokens"),
            "tool_choice": body.get("tool_choice")}


def agent_session(model: str, max_tokens: int) -> list[tuple[str, dict[str, Any]]]:
    """A short agent session for a model whose window is below OpenClaw's ~18k-token prompts
    (SmolLM2: 8,192): the agent turn, then three requests that each add the agent's step to
    the history (a ``read`` call and its result, an ``exec`` call and its listing, a final
    answer and the user's next question), each a prefix of the next, as an agent sends them.
    ``(name, streamed body)`` pairs, greedy."""
    first = agent_turn(model, max_tokens, stream=True)
    readme = "\n".join(f"{i}. The project keeps its {w} in {w}/ and documents it in docs/{w}.md."
                       for i, w in enumerate(("tests", "scripts", "ui", "data", "docs"), 1))
    listing = "\n".join(f"-rw-r--r-- 1 user user {size:>8} Dec  6 01:00 {name}"
                        for name, size in (("README.md", 4_812), ("Makefile", 1_204),
                                           ("pyproject.toml", 2_950), ("data.csv", 8_402_113),
                                           ("setup.cfg", 611), ("LICENSE", 11_357)))

    def call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}]}

    steps = [
        [call(1, "read", {"path": "README.md"}),
         {"role": "tool", "tool_call_id": "call_1", "content": readme}],
        [call(2, "exec", {"command": "ls -la"}),
         {"role": "tool", "tool_call_id": "call_2", "content": listing}],
        [{"role": "assistant", "content": "The largest top-level file is data.csv (8.4 MB); "
          "the others are under 12 KB."},
         {"role": "user", "content": "Thanks. How many lines does data.csv have?"}],
    ]
    out = [("turn1", {**first, "temperature": 0})]
    messages = list(first["messages"])
    for i, step in enumerate(steps, 2):
        messages = [*messages, *step]
        out.append((f"turn{i}", {**first, "messages": messages, "temperature": 0}))
    return out
