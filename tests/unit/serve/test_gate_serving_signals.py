"""The policy gate's serving signals on the chat path: while a canary runs, each finished
request counts toward the side that served it (its adapter), with its seconds per generated
token; a request failing with a server error counts as an error of that side, a client error
(4xx) does not; without a canary nothing is counted."""

from __future__ import annotations

import pytest

from clawray.config import ServingConfig
from clawray.gate.core import ServingTally, canary_bucket
from clawray.inference.engine import EngineError, EngineInternalError, TokenDelta, TokenOutput
from clawray.serve.chat import ChatService
from clawray.serve.openai_chat import complete, stream, to_turn_request
from clawray.serve.protocol import APIError, ChatCompletionRequest
from tests.support.common import ListSink

ROUTING = {"incumbent": 0, "incumbent_adapter": None, "candidate": 3,
           "candidate_adapter": "~gate/v3", "share": 0.5, "salt": "canary-v3"}


class Policy:
    """Serves every adapter; requests for adapter ``failing`` fail with ``fail`` (a broken
    candidate)."""

    def __init__(self, fail=None, failing=None):
        self.fail, self.failing, self.adapters_seen = fail, failing, []

    async def generate(self, prompt_ids, params, session_key=None):
        self.adapters_seen.append(params.adapter)
        if self.fail is not None and params.adapter == self.failing:
            raise self.fail
        return [TokenOutput([40, 41, 42, 43], [-0.1] * 4, "length", 0)]

    async def stream(self, prompt_ids, params, session_key=None):
        self.adapters_seen.append(params.adapter)
        for tok in (40, 41):
            yield TokenDelta([tok], [-0.1], 0, None)
        if self.fail is not None and params.adapter == self.failing:
            raise self.fail
        yield TokenDelta([42], [-0.1], 0, "length")

    async def status(self):
        raise NotImplementedError


def sessions_on_each_side(n):
    """Session ids whose session keys (the tenant's, as the service derives them) fall in the
    canary, and ones that do not."""
    from clawray.serve.auth import LOCAL_TENANT
    from clawray.serve.session_meta import session_meta

    def key(sid):
        return session_meta({"x-session-id": sid}, {}, [{"role": "user", "content": "hi"}],
                            "main", LOCAL_TENANT, False).key

    ids = [f"s{k}" for k in range(200)]
    cand = [i for i in ids if canary_bucket(key(i), ROUTING["salt"]) < ROUTING["share"]][:n]
    inc = [i for i in ids if canary_bucket(key(i), ROUTING["salt"]) >= ROUTING["share"]][:n]
    return cand, inc


async def ask(svc, session, streamed=False):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                max_tokens=4, stream=streamed)
    turn = await svc.prepare(to_turn_request(req, {}), {"x-session-id": session})
    if streamed:
        return [line async for line in stream(svc, turn)]
    return await complete(svc, turn)


async def test_finished_requests_count_toward_the_side_that_served_them(tiny_tokenizer):
    tally = ServingTally()
    policy = Policy()
    svc = ChatService(tiny_tokenizer, policy, "m", 4096, ServingConfig(), ListSink(),
                      routing=lambda: ROUTING, tally=tally)
    cand, inc = sessions_on_each_side(3)
    for s in cand + inc:
        await ask(svc, s)
    await ask(svc, cand[0], streamed=True)
    t = tally.snapshot()["canary-v3"]
    assert t["candidate"]["requests"] == 4 and t["incumbent"]["requests"] == 3
    assert t["candidate"]["timed"] == 4 and t["candidate"]["errors"] == 0
    assert t["candidate"]["s_per_token"] > 0
    assert policy.adapters_seen.count("~gate/v3") == 4  # the side is the adapter that served


@pytest.mark.parametrize("streamed", [False, True])
async def test_server_errors_count_against_their_side_and_client_errors_do_not(tiny_tokenizer,
                                                                               streamed):
    cand, inc = sessions_on_each_side(2)
    tally = ServingTally()
    svc = ChatService(tiny_tokenizer, Policy(EngineInternalError("step failed"), "~gate/v3"), "m",
                      4096, ServingConfig(), ListSink(), routing=lambda: ROUTING, tally=tally)
    for s in cand + inc:
        if streamed:
            await ask(svc, s, streamed=True)  # the error ends the stream as an event
        elif s in cand:
            with pytest.raises(APIError):
                await ask(svc, s)
        else:
            await ask(svc, s)
    t = tally.snapshot()["canary-v3"]
    assert (t["candidate"]["requests"], t["candidate"]["errors"]) == (2, 2)
    assert (t["incumbent"]["requests"], t["incumbent"]["errors"]) == (2, 0)
    client = ServingTally()
    svc = ChatService(tiny_tokenizer, Policy(EngineError("bad request"), "~gate/v3"), "m", 4096,
                      ServingConfig(), ListSink(), routing=lambda: ROUTING, tally=client)
    with pytest.raises(APIError) as e:
        await ask(svc, cand[0])
    assert e.value.status == 400
    assert client.snapshot()["canary-v3"]["candidate"]["errors"] == 0


async def test_nothing_is_counted_without_a_canary(tiny_tokenizer):
    tally = ServingTally()
    no_canary = {**ROUTING, "candidate": None, "candidate_adapter": None, "share": 0.0,
                 "salt": ""}
    svc = ChatService(tiny_tokenizer, Policy(), "m", 4096, ServingConfig(), ListSink(),
                      routing=lambda: no_canary, tally=tally)
    await ask(svc, "s1")
    assert tally.snapshot() == {} and tally.changes == 0
