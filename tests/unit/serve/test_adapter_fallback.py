"""Per-user adapters where the ingress cannot see the engine (the split layout) or the adapter
leaves the engine at the wrong moment: a request that names its user's adapter with
``adapter_fallback`` is served by the base policy when the engine has no such adapter, and the
record says the base served it."""

from __future__ import annotations

import dataclasses

import pytest

from clawray.config import ServingConfig
from clawray.inference.engine import EngineError, SamplingParams, TokenDelta, TokenOutput
from clawray.serve.chat import ChatService
from clawray.serve.openai_chat import complete, stream, to_turn_request
from clawray.serve.policy_server import HandlePolicy, generate_on, stream_on
from clawray.serve.protocol import ChatCompletionRequest
from tests.support.common import ListSink


class AdapterEngine:
    """Serves ``adapters``; a request for another adapter fails as real engines do. With
    ``evict_on_admit`` the adapter disappears just as the request arrives (an LRU eviction)."""

    def __init__(self, adapters, evict_on_admit=False):
        self._adapters, self.evict, self.calls = dict(adapters), evict_on_admit, []

    def adapters(self):
        return dict(self._adapters)

    def _admit(self, params):
        self.calls.append(params.adapter)
        if self.evict and params.adapter in self._adapters:
            del self._adapters[params.adapter]
        if params.adapter is not None and params.adapter not in self._adapters:
            raise EngineError(f"adapter {params.adapter!r} is not loaded")

    async def generate(self, prompt_ids, params):
        self._admit(params)
        return [TokenOutput([1, 2], [-0.1, -0.2], "length", self._adapters.get(params.adapter, 0))]

    async def generate_stream(self, prompt_ids, params):
        self._admit(params)
        yield TokenDelta([1], [-0.1], 0)
        yield TokenDelta([2], [-0.2], 0, finish_reason="length")


ASK = SamplingParams(max_tokens=2, adapter="ann", adapter_fallback=True)


async def test_the_base_serves_when_the_engine_has_no_such_adapter():
    engine = AdapterEngine({"ann": 3})
    [out] = await generate_on(engine, [5], ASK)
    assert (out.policy_version, out.fell_back, engine.calls) == (3, False, ["ann"])
    [out] = await generate_on(engine, [5], dataclasses.replace(ASK, adapter="bob"))
    assert (out.policy_version, out.fell_back, engine.calls[-1]) == (0, True, None)
    deltas = [d async for d in stream_on(engine, [5], dataclasses.replace(ASK, adapter="bob"))]
    assert [d.fell_back for d in deltas] == [True, True] and engine.calls[-1] is None
    deltas = [d async for d in stream_on(engine, [5], ASK)]
    assert [d.fell_back for d in deltas] == [False, False] and engine.calls[-1] == "ann"
    with pytest.raises(EngineError, match="not loaded"):  # without the fallback: an error
        await generate_on(engine, [5], dataclasses.replace(ASK, adapter="bob",
                                                            adapter_fallback=False))


async def test_an_adapter_evicted_as_the_request_arrives_falls_back_instead_of_failing():
    engine = AdapterEngine({"ann": 3}, evict_on_admit=True)
    [out] = await generate_on(engine, [5], ASK)
    assert out.fell_back and engine.calls == ["ann", None]


class SplitPolicy:
    """What the split layout's ingress holds: a PolicyServer replica behind a handle, whose
    adapters the ingress cannot see."""

    names_adapters = True

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, prompt_ids, params, session_key=None):
        return await generate_on(self.engine, prompt_ids, params)

    def stream(self, prompt_ids, params, session_key=None):
        return stream_on(self.engine, prompt_ids, params)

    async def status(self):
        raise NotImplementedError


@pytest.mark.parametrize("streamed", [False, True])
async def test_the_split_layout_names_the_users_adapter_and_records_what_served(
        tiny_tokenizer, streamed):
    from clawray.serve.auth import tenant_of_key

    app = tenant_of_key("sk-app")
    engine = AdapterEngine({f"{app}/ann": 4})
    sink = ListSink()
    svc = ChatService(tiny_tokenizer, SplitPolicy(engine), "m", 4096,
                      ServingConfig(trusted_app_tenants=[app]), sink)
    for user in ("ann", "bob"):
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=2, stream=streamed)
        turn = await svc.prepare(to_turn_request(req, {"user": user}), {"x-session-id": user},
                                 app)
        if streamed:
            [_ async for _ in stream(svc, turn)]
        else:
            await complete(svc, turn)
    assert engine.calls == [f"{app}/ann", None]  # bob has no adapter: the base served him
    assert [r.sampling["adapter"] for r in sink.records] == [f"{app}/ann", None]
    assert [r.policy_user for r in sink.records] == [f"{app}/ann", f"{app}/bob"]


def test_only_an_app_that_serves_adapters_names_them():
    class Handle:
        def options(self, **kw):
            return self

    assert HandlePolicy(Handle(), names_adapters=True).names_adapters
    assert not HandlePolicy(Handle()).names_adapters
