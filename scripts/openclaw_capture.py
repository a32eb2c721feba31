"""Capture what the real OpenClaw agent sends in its ``openai-responses`` and
``anthropic-messages`` modes (the Chat Completions captures are in tests/fixtures/openclaw/).

A recording stub answers on 127.0.0.1 in each API's streaming format — a short text, or, when
the user asks to list files, a call of OpenClaw's ``ls`` tool — and saves every request as
``{"path", "headers", "body"}`` (authorization headers removed, local paths replaced). Then
OpenClaw runs two turns per mode in a throwaway ``HOME``: a greeting, and a turn whose tool call
makes OpenClaw send a follow-up with the tool's result.

    eval "$(../shared/tools/openclaw/setup.sh)"
    .venv/bin/python scripts/openclaw_capture.py --out tests/fixtures/openclaw

Needs only the standard library (and ``openclaw`` on PATH).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

TEXT = "Hello from the stub."
TOOL_ARGS = {"path": "."}
DROP_HEADERS = {"authorization", "x-api-key", "host", "content-length"}


def wants_tool(body: dict[str, Any]) -> bool:
    """The last user text asks to list files, and no tool result answered it yet."""
    text = json.dumps(body)
    last_user = text.rfind("list the files")
    return last_user >= 0 and "function_call_output" not in text[last_user:] \
        and "tool_result" not in text[last_user:]


def sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def responses_stream(body: dict[str, Any]) -> list[bytes]:
    rid, seq = "resp_" + uuid.uuid4().hex, iter(range(10_000))
    base = {"id": rid, "object": "response", "created_at": int(time.time()),
            "model": body.get("model"), "output": [], "status": "in_progress",
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
            "incomplete_details": None, "usage": None}
    out = [sse("response.created", {"type": "response.created", "sequence_number": next(seq),
                                    "response": base})]
    if wants_tool(body):
        item = {"type": "function_call", "id": "fc_stub1", "call_id": "call_stub1",
                "name": "ls", "arguments": json.dumps(TOOL_ARGS), "status": "completed"}
        out += [sse("response.output_item.added", {
                    "type": "response.output_item.added", "sequence_number": next(seq),
                    "output_index": 0, "item": {**item, "arguments": "",
                                                "status": "in_progress"}}),
                sse("response.function_call_arguments.done", {
                    "type": "response.function_call_arguments.done",
                    "sequence_number": next(seq), "item_id": "fc_stub1", "output_index": 0,
                    "arguments": item["arguments"]}),
                sse("response.output_item.done", {
                    "type": "response.output_item.done", "sequence_number": next(seq),
                    "output_index": 0, "item": item})]
    else:
        part = {"type": "output_text", "text": TEXT, "annotations": []}
        item = {"type": "message", "id": "msg_stub1", "status": "completed",
                "role": "assistant", "content": [part]}
        out += [sse("response.output_item.added", {
                    "type": "response.output_item.added", "sequence_number": next(seq),
                    "output_index": 0, "item": {**item, "content": [],
                                                "status": "in_progress"}}),
                sse("response.content_part.added", {
                    "type": "response.content_part.added", "sequence_number": next(seq),
                    "item_id": "msg_stub1", "output_index": 0, "content_index": 0,
                    "part": {**part, "text": ""}}),
                sse("response.output_text.delta", {
                    "type": "response.output_text.delta", "sequence_number": next(seq),
                    "item_id": "msg_stub1", "output_index": 0, "content_index": 0,
                    "delta": TEXT, "logprobs": []}),
                sse("response.output_text.done", {
                    "type": "response.output_text.done", "sequence_number": next(seq),
                    "item_id": "msg_stub1", "output_index": 0, "content_index": 0,
                    "text": TEXT, "logprobs": []}),
                sse("response.content_part.done", {
                    "type": "response.content_part.done", "sequence_number": next(seq),
                    "item_id": "msg_stub1", "output_index": 0, "content_index": 0,
                    "part": part}),
                sse("response.output_item.done", {
                    "type": "response.output_item.done", "sequence_number": next(seq),
                    "output_index": 0, "item": item})]
    done = {**base, "status": "completed", "output": [item],
            "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
    out.append(sse("response.completed", {"type": "response.completed",
                                          "sequence_number": next(seq), "response": done}))
    return out


def messages_stream(body: dict[str, Any]) -> list[bytes]:
    mid = "msg_" + uuid.uuid4().hex
    start = {"id": mid, "type": "message", "role": "assistant", "content": [],
             "model": body.get("model"), "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": 10, "output_tokens": 1}}
    out = [sse("message_start", {"type": "message_start", "message": start})]
    if wants_tool(body):
        out += [sse("content_block_start", {
                    "type": "content_block_start", "index": 0, "content_block": {
                        "type": "tool_use", "id": "toolu_stub1", "name": "ls", "input": {}}}),
                sse("content_block_delta", {
                    "type": "content_block_delta", "index": 0, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(TOOL_ARGS)}}),
                sse("content_block_stop", {"type": "content_block_stop", "index": 0})]
        stop = "tool_use"
    else:
        out += [sse("content_block_start", {"type": "content_block_start", "index": 0,
                                            "content_block": {"type": "text", "text": ""}}),
                sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                            "delta": {"type": "text_delta", "text": TEXT}}),
                sse("content_block_stop", {"type": "content_block_stop", "index": 0})]
        stop = "end_turn"
    out += [sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": stop, "stop_sequence": None},
                                  "usage": {"output_tokens": 5}}),
            sse("message_stop", {"type": "message_stop"})]
    return out


class Recorder(http.server.BaseHTTPRequestHandler):
    captured: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
        headers = {k.lower(): v for k, v in self.headers.items()
                   if k.lower() not in DROP_HEADERS}
        self.captured.append({"path": self.path, "headers": headers, "body": body})
        if self.path.endswith("/responses"):
            chunks = responses_stream(body)
        elif self.path.endswith("/messages"):
            chunks = messages_stream(body)
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for c in chunks:
            self.wfile.write(c)
            self.wfile.flush()


def config(port: int, api: str) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}" + ("" if api == "anthropic-messages" else "/v1")
    return {"agents": {"defaults": {"model": {"primary": "clawray/clawray-tiny"}}},
            "plugins": {"enabled": False},
            "models": {"mode": "merge", "providers": {"clawray": {
                "baseUrl": base, "apiKey": "sk-local", "timeoutSeconds": 300, "api": api,
                "models": [{"id": "clawray-tiny", "name": "clawray", "reasoning": False,
                            "input": ["text"],
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                            "contextWindow": 32000, "maxTokens": 64}]}}}}


def scrub(obj: Any, home: str) -> Any:
    text = json.dumps(obj)
    text = text.replace(home, "/home/user").replace(str(Path.home()), "/home/user")
    text = re.sub(r"/tmp/[A-Za-z0-9_.-]+", "/home/user", text)
    return json.loads(text)


def run_mode(api: str, port: int, out: Path, session: str) -> list[Path]:
    home = tempfile.mkdtemp(prefix="oc-home-")
    (Path(home) / ".openclaw").mkdir()
    (Path(home) / ".openclaw" / "openclaw.json").write_text(json.dumps(config(port, api)))
    env = {**os.environ, "HOME": home, "NO_UPDATE_NOTIFIER": "1"}
    Recorder.captured.clear()
    written = []
    for turn, message in enumerate(["Hello, what is 2+2?", "Please list the files here."], 1):
        start = len(Recorder.captured)
        run = subprocess.run(["openclaw", "agent", "--local", "--session-id", session,
                              "--message", message, "--json"], env=env, cwd=home,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=300)
        if run.returncode != 0:
            raise SystemExit(f"openclaw failed ({api}, turn {turn}): {run.stderr[-2000:]}")
        for i, req in enumerate(Recorder.captured[start:], 1):
            name = f"{api.replace('-', '_')}_t{turn}_req{i}.json"
            path = out / name
            path.write_text(json.dumps(scrub(req, home), indent=1, ensure_ascii=False) + "\n")
            written.append(path)
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("tests/fixtures/openclaw"))
    p.add_argument("--modes", nargs="+", default=["openai-responses", "anthropic-messages"])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    for api in args.modes:
        for path in run_mode(api, server.server_address[1], args.out, f"cap-{api}"):
            print("wrote", path)
    server.shutdown()


if __name__ == "__main__":
    main()
