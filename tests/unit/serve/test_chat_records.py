"""ChatService records a completion that spans a weight swap exactly, streamed or not: the
version it started on, the version it ended on, and the version of every token."""

from __future__ import annotations

from clawray.config import ServingConfig
from clawray.inference.engine import TokenDelta, TokenOutput
from clawray.serve.chat import ChatService
from clawray.serve.protocol import ChatCompletionRequest
from tests.support.common import ListSink

IDS = [40, 41, 42, 43]
VERSIONS = [3, 3, 4, 4]  # the weights changed after the second token


class SwappingPolicy:
    """A policy client whose one completion is sampled half on version 3, half on 4."""

    async def generate(self, prompt_ids, params, session_key=None):
        return [TokenOutput(list(IDS), [-0.5] * 4, "length", 3, 4, token_versions=VERSIONS)]

    async def stream(self, prompt_ids, params, session_key=None):
        for i, (tok, ver) in enumerate(zip(IDS, VERSIONS)):
            last = i == len(IDS) - 1
            yield TokenDelta([tok], [-0.5], 3, "length" if last else None,
                             policy_version_end=4 if last else None, token_versions=[ver])

    async def status(self):
        raise NotImplementedError


def service(tokenizer):
    sink = ListSink()
    return ChatService(tokenizer, SwappingPolicy(), "m", 4096, ServingConfig(), sink), sink


async def prepared(svc, stream: bool):
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                max_tokens=4, stream=stream)
    return await svc.prepare(req, {"x-session-id": "swap-1"}, {})


async def test_a_json_completion_records_every_tokens_version(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer)
    body = await svc.complete(await prepared(svc, stream=False))
    [rec] = sink.records
    assert (rec.policy_version, rec.policy_version_end) == (3, 4)
    assert rec.response_ids == IDS and rec.response_versions == VERSIONS
    assert body["system_fingerprint"] == "clawray-policy-v4"


async def test_a_streamed_completion_keeps_its_end_version(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer)
    lines = [line async for line in svc.stream(await prepared(svc, stream=True))]
    assert lines[-1] == "data: [DONE]\n\n"
    [rec] = sink.records
    assert (rec.policy_version, rec.policy_version_end) == (3, 4)
    assert rec.response_ids == IDS and rec.response_versions == VERSIONS
