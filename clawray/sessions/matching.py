"""Finding a turn's reply (and what followed it) in a later request's history.

Agent apps resend the whole conversation each turn, but not byte for byte: OpenClaw rewrites
tool-call ids (``call_stub1`` → ``callstub1``), re-serializes tool arguments, may trim
whitespace, and ends every request with an ephemeral "internal context" user message that is
rebuilt each time and never kept in the history. So messages are compared by a canonical
fingerprint that ignores ids, whitespace runs and JSON formatting, and a turn's reply is found
by (reply, the message it answered) rather than by position from the end.

Clients also rewrite the reply itself when they keep it: they strip ``<think>`` blocks, or drop
the text next to tool calls. A turn's reply is recognized in any of those forms, so a normal
continuation is never taken for a regenerate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

from clawray.records import TurnRecord


def canonical(msg: dict[str, Any]) -> str:
    """A stable text form of a message: role, normalized text, tool calls without ids."""
    content = msg.get("content")
    if isinstance(content, list):  # content parts (records are normalized, tests may not be)
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    text = " ".join(str(content or "").split())
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call)
        calls.append([fn.get("name"), _canonical_args(fn.get("arguments"))])
    return json.dumps([msg.get("role"), text, calls], ensure_ascii=False, separators=(",", ":"))


def fingerprint(msg: dict[str, Any]) -> bytes:
    return hashlib.blake2b(canonical(msg).encode(), digest_size=12).digest()


def _canonical_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return " ".join(args.split())
    return json.dumps(args, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def reply_message(record: TurnRecord) -> dict[str, Any]:
    """The assistant message a client will put in its history for this turn."""
    msg: dict[str, Any] = {"role": "assistant", "content": record.response_text or ""}
    if record.tool_calls:
        msg["tool_calls"] = record.tool_calls
    return msg


_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


def reply_forms(record: TurnRecord) -> list[dict[str, Any]]:
    """The reply as clients keep it: verbatim, without ``<think>`` blocks, and (with tool
    calls) without the text next to them."""
    msg = reply_message(record)
    forms = [msg]
    text = msg["content"]
    bare = _THINK.sub("", text)
    if bare != text:
        forms.append({**msg, "content": bare})
    if record.tool_calls and text.strip():
        forms.append({**msg, "content": ""})
    return forms


def conversation_turn(record: TurnRecord) -> int:
    """The turn's position in its conversation: 1 + the assistant messages before it (arrival
    order does not matter, and two replies to one request share a position)."""
    return 1 + sum(m.get("role") == "assistant" for m in record.messages)


@dataclasses.dataclass
class Fingerprinted:
    """A turn record with the fingerprints the matching needs, computed once."""

    record: TurnRecord
    hashes: list[bytes]
    replies: frozenset[bytes]  # every form of the reply a client may keep (reply_forms)

    @classmethod
    def of(cls, record: TurnRecord) -> "Fingerprinted":
        return cls(record, [fingerprint(m) for m in record.messages],
                   frozenset(fingerprint(m) for m in reply_forms(record)))

    @property
    def request_start(self) -> int:
        """Index of the first message after the last assistant message (the user's request)."""
        msgs = self.record.messages
        for i in range(len(msgs) - 1, -1, -1):
            if msgs[i].get("role") == "assistant":
                return i + 1
        return 1 if msgs and msgs[0].get("role") == "system" else 0


@dataclasses.dataclass
class Match:
    index: int  # position of the reply in the later request's messages
    ephemeral_tail: bool  # the earlier request's last message was not kept in the history
    next_state: list[dict[str, Any]]


def find_reply(earlier: Fingerprinted, later: Fingerprinted) -> Match | None:
    """Where ``earlier``'s reply sits in ``later``'s history, and the messages after it.

    The reply must directly follow the message it answered: the earlier request's last message,
    or, when that one was ephemeral (not kept), the one before it. The next state is what
    follows the reply up to the next assistant message (a later turn's reply is not part of
    this turn's next state, whichever record arrives first), minus a trailing ephemeral
    message when the client uses them and the request ends there. An empty next state (the
    later request adds nothing after the reply) is no match.
    """
    hp, hr = earlier.hashes, later.hashes
    for j, ephemeral in ((len(hp), False), (len(hp) - 1, True)):
        if j < 1:
            continue
        answered = hp[j - 1]
        for i in range(len(hr) - 1, 0, -1):
            if hr[i] in earlier.replies and hr[i - 1] == answered:
                after = later.record.messages[i + 1:]
                cut = next((k for k, m in enumerate(after) if m.get("role") == "assistant"),
                           None)
                if cut is not None:  # kept history: no ephemeral message before a reply
                    after = after[:cut]
                elif ephemeral and after and after[-1].get("role") == "user":
                    after = after[:-1]
                if not after:
                    return None
                return Match(i, ephemeral, list(after))
    return None


def same_request(a: Fingerprinted, b: Fingerprinted) -> bool:
    """True when both turns answered the same conversation state (ephemeral tails aside)."""
    ha, hb = a.hashes, b.hashes
    if ha == hb:
        return True
    return len(ha) == len(hb) and ha[:-1] == hb[:-1] and _ends_ephemeral(a, b)


def _ends_ephemeral(a: Fingerprinted, b: Fingerprinted) -> bool:
    ma, mb = a.record.messages[-1], b.record.messages[-1]
    return ma.get("role") == mb.get("role") == "user" and len(a.hashes) >= 2


def rewinds(earlier: Fingerprinted, later: Fingerprinted) -> bool:
    """``later`` resends ``earlier``'s conversation up to its request but not its reply.

    That is what a regenerate (same request again) or an edit (the request rewritten) looks
    like. Call it only when ``find_reply`` found no match.
    """
    u = earlier.request_start
    if u == 0:  # the conversation's first request, without a system prompt: the first message
        # itself may be the edit; a later first-turn request (no reply kept) rewinds it
        later_msgs = later.record.messages
        return bool(later_msgs) and not any(m.get("role") == "assistant" for m in later_msgs)
    if len(later.hashes) < u or later.hashes[:u] != earlier.hashes[:u]:
        return False
    return not (earlier.replies & set(later.hashes[u:]))
