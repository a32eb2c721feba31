"""What the real OpenClaw agent sends in its ``openai-responses`` and ``anthropic-messages``
modes (tests/fixtures/openclaw/, captured by scripts/openclaw_capture.py) is accepted, becomes
the conversation it means, and derives one session per conversation."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.serve import anthropic_messages as am
from clawray.serve import openai_responses as orr
from clawray.serve.chat import ChatService
from tests.support.common import FIXTURES, ListSink

MODES = {"openai_responses": lambda raw: orr.to_turn_request(orr.parse_request(raw), [], None),
         "anthropic_messages": lambda raw: am.to_turn_request(am.parse_request(raw))}


def turn_request(name: str):
    capture = json.loads((FIXTURES / name).read_text())
    return MODES[name.rsplit("_t", 1)[0]](json.dumps(capture["body"]).encode())


@pytest.mark.parametrize("mode", sorted(MODES))
async def test_every_openclaw_request_is_accepted_and_keeps_one_session(mode, tiny_tokenizer):
    svc = ChatService(tiny_tokenizer, None, "clawray-tiny", 100_000, ServingConfig(), ListSink())
    names = sorted(p.name for p in FIXTURES.glob(f"{mode}_t*_req*.json"))
    assert len(names) == 3, names
    turns = [await svc.prepare(turn_request(n), {}, "key-oc") for n in names]
    assert len({t.meta.key for t in turns}) == 1  # one conversation, one derived session
    system = turns[0].messages[0]
    assert system["role"] == "system" and "OpenClaw" in system["content"]
    assert all(t.tools and len(t.tools) == len(turns[0].tools) for t in turns)
    # the follow-up carries the tool call and its result, paired by id
    last = turns[-1].messages
    [call_msg] = [m for m in last if m.get("tool_calls")]
    [result] = [m for m in last if m["role"] == "tool"]
    call = call_msg["tool_calls"][0]
    assert call["function"] == {"name": "ls", "arguments": {"path": "."}}
    assert result["tool_call_id"] == call["id"] and "AGENTS.md" in result["content"]
    # each request's prompt extends the previous turn's conversation (history is resent)
    first_user = next(m for m in turns[0].messages if m["role"] == "user")
    assert all(first_user in t.messages for t in turns)
