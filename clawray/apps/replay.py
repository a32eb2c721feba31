"""``clawray replay``: serve the embedded default and replay an agent session through it.

Starts local Ray + the Serve app, runs a 3-turn agent session through the official ``openai``
SDK (streaming, tools, a tool-call round trip, session headers), then reads the recorded
TurnRecords back and checks they are token-exact, and reads the judged training samples the
session produced from the Parquet sample log (the heuristic rule judge is the CPU default).
Writes ``summary.json``, ``turns.jsonl`` and ``samples/`` into ``--out``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
from openai import OpenAI

from clawray.apps.launch import start_serving
from clawray.config import ClawRayConfig
from clawray.models.loader import load_tokenizer, policy_model_info
from clawray.records import read_jsonl_records
from clawray.samples import SCHEMA
from clawray.sessions.pipeline import attach_live_pipeline

LS_TOOL = {
    "type": "function",
    "function": {
        "name": "ls",
        "description": "List files in a directory.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]},
    },
}

IDLE_S = 3.0
USER_TURNS = [
    "Hello, what is 2+2?",
    "Thanks. Please CALL_TOOL and list the workspace.",
    "Great, that is all for now.",
]


def run_replay(cfg: ClawRayConfig, records_dir: Path) -> int:
    records_dir.mkdir(parents=True, exist_ok=True)
    records_path = records_dir / "turns.jsonl"
    records_path.unlink(missing_ok=True)
    samples_path = records_dir / "samples"
    cfg = cfg.copy_with(serving={"record_sink": ["jsonl", "hub"], "records_path": str(records_path)},
                        sessions={"feedback_window_s": 0.0, "idle_timeout_s": IDLE_S},
                        buffer={"path": str(samples_path), "seal_age_s": 0.2})
    base_url = start_serving(cfg, blocking=False)
    info = policy_model_info(cfg)
    keys = cfg.serving_cfg.resolved_api_keys()
    client = OpenAI(base_url=base_url, api_key=keys[0] if keys else "none", max_retries=0)
    session = f"replay-{int(time.time())}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful agent. Use tools when asked."}]
    print(f"clawray replay: model {info.name} at {base_url}, session {session}")
    for text in USER_TURNS:
        messages.append({"role": "user", "content": text})
        for _ in range(3):  # a tool call is answered by a tool result and a follow-up request
            reply, calls = _stream_turn(client, info.name, messages, session)
            print(f"  user: {text!r}\n  assistant: {reply!r}" + (f" tool_calls={calls}" if calls else ""))
            messages.append({"role": "assistant", "content": reply or None,
                             **({"tool_calls": calls} if calls else {})})
            if not calls:
                break
            for c in calls:
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": json.dumps(["README.md", "src/", "tests/"])})
    records = _wait_for_records(records_path, expected=len(
        [m for m in messages if m["role"] == "assistant"]))
    tok = load_tokenizer(info.path)
    exact = all(_token_exact(tok, r) for r in records)
    # Like OpenClaw, the demo never says the session is done: the idle timeout ends it.
    print(f"  (waiting {IDLE_S:g} s for the session's idle timeout to finalize its last turn)")
    time.sleep(IDLE_S)
    samples = _read_samples(cfg, samples_path, session, expected=len(records))
    for row in samples:
        print(f"  sample turn {row['turn']}: {row['judge_status']:<13} reward {row['reward']:+.0f}"
              f"  votes {row['votes']}  mask {'on' if any(row['loss_mask']) else 'off'}"
              f"  {len(row['prompt_ids'])}+{len(row['response_ids'])} tokens")
    summary = {"session": session, "turns": len(records), "token_exact": exact,
               "records": str(records_path),
               "policy_versions": sorted({r.policy_version for r in records}),
               "tool_calls": sum(len(r.tool_calls) for r in records),
               "samples": len(samples), "samples_path": str(samples_path),
               "trainable_samples": sum(1 for r in samples if any(r["loss_mask"])),
               "rewards": [r["reward"] for r in samples]}
    (records_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0 if records and exact and len(samples) == len(records) else 1


def _read_samples(cfg: ClawRayConfig, path: Path, session: str, expected: int,
                  timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The session's rows in the sample log, once the hubs have written them."""
    pipe = attach_live_pipeline(cfg, "clawray")
    deadline = time.time() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.time() < deadline:
        pipe.flush()
        table = ds.dataset(str(path), format="parquet", schema=SCHEMA).to_table()
        rows = sorted((r for r in table.to_pylist() if r["session_id"] == session),
                      key=lambda r: r["turn"])
        if len(rows) >= expected:
            break
        time.sleep(0.3)
    return rows


def _stream_turn(client: Any, model: str, messages: list[dict[str, Any]], session: str
                 ) -> tuple[str, list[dict[str, Any]]]:
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=[LS_TOOL], tool_choice="auto", stream=True,
        stream_options={"include_usage": True}, max_completion_tokens=64, temperature=0,
        extra_headers={"X-Session-Id": session, "X-Turn-Type": "main"})
    text, calls = "", {}
    for chunk in stream:
        for choice in chunk.choices:
            d = choice.delta
            text += d.content or ""
            for tc in d.tool_calls or []:
                calls[tc.index] = {"id": tc.id, "type": "function",
                                   "function": {"name": tc.function.name,
                                                "arguments": tc.function.arguments}}
    return text, [calls[i] for i in sorted(calls)]


def _token_exact(tok: Any, r: Any) -> bool:
    """The prompt ids are the template applied to the request; one log-prob per response id."""
    text = tok.apply_chat_template(r.messages, tools=r.tools, add_generation_prompt=True,
                                   tokenize=False)
    return (tok.encode(text, add_special_tokens=False) == r.prompt_ids
            and len(r.response_ids) == len(r.response_logprobs) > 0)


def _wait_for_records(path: Path, expected: int, timeout_s: float = 30.0) -> list:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        records = read_jsonl_records(path)
        if len(records) >= expected:
            return records
        time.sleep(0.2)
    return read_jsonl_records(path)
