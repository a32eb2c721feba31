"""HFEngine with per-user LoRA adapters: each request samples from its own adapter, requests of
different adapters decode in one batch and still match each adapter merged on its own,
versions are per adapter, an adapter evicted from memory is read back from disk, unknown
adapters are clear errors."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from clawray.inference import EngineError, SamplingParams
from tests.support.lora import merged, random_lora
from tests.unit.inference.test_hf_engine import PROMPT, engine_of, reference_greedy

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


def adapter(model, seed: int):
    return random_lora(model, seed, targets=("q_proj", "o_proj", "up_proj"), scale=0.3,
                       scaling=1.5)


def raw_logprobs(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


async def test_each_request_samples_from_its_own_adapter_in_one_batch(tiny_qwen3):
    a, b = adapter(tiny_qwen3, 1), adapter(tiny_qwen3, 2)
    want = {"alice": reference_greedy(merged(tiny_qwen3, a), PROMPT, 10),
            "bob": reference_greedy(merged(tiny_qwen3, b), PROMPT, 10),
            None: reference_greedy(tiny_qwen3, PROMPT, 10)}
    assert len({tuple(v) for v in want.values()}) == 3  # the adapters do change the policy
    async with engine_of(tiny_qwen3, max_loras=4) as engine:
        assert await engine.load_adapter("alice", a, version=3) == []
        await engine.load_adapter("bob", b, version=7)
        users = ["alice", None, "bob", "alice", "bob", None]
        outs = await asyncio.gather(*[
            engine.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, adapter=u))
            for u in users])
        sampled = await engine.generate(PROMPT, SamplingParams(max_tokens=16, seed=4,
                                                                adapter="alice"))
        st = await engine.status()
        # finished requests no longer hold their adapters
        assert await engine.unload_adapter("bob") and engine.adapters() == {"alice": 3}
    for user, out in zip(users, outs):
        assert out[0].token_ids == want[user], user
    assert [o[0].policy_version for o in outs] == [3, 0, 7, 3, 7, 0]
    # log-probs are the adapter's own raw distribution
    got = torch.tensor(sampled[0].logprobs)
    assert torch.allclose(got, raw_logprobs(merged(tiny_qwen3, a), PROMPT, sampled[0].token_ids),
                          atol=1e-4)
    assert st.extra["adapters"] == {"alice": 3, "bob": 7}


async def test_replacing_an_adapter_mid_request_reports_the_new_version(tiny_qwen3):
    a1, a2 = adapter(tiny_qwen3, 1), adapter(tiny_qwen3, 5)
    async with engine_of(tiny_qwen3, max_loras=2) as engine:
        await engine.load_adapter("alice", a1, version=1)
        stream = engine.generate_stream(PROMPT, SamplingParams(max_tokens=200, temperature=0.0,
                                                               adapter="alice"))
        first = await stream.__anext__()
        await engine.load_adapter("alice", a2, version=2)
        rest = [d async for d in stream]
        after = await engine.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0,
                                                             adapter="alice"))
    assert first.policy_version == 1 and rest[-1].policy_version_end == 2
    assert after[0].policy_version == 2
    assert after[0].token_ids == reference_greedy(merged(tiny_qwen3, a2), PROMPT, 10)


async def test_unknown_adapters_and_engines_without_adapters_fail_clearly(tiny_qwen3):
    async with engine_of(tiny_qwen3) as engine:
        with pytest.raises(EngineError, match="serves no LoRA adapters"):
            await engine.generate(PROMPT, SamplingParams(max_tokens=2, adapter="alice"))
        with pytest.raises(EngineError, match="serves no LoRA adapters"):
            await engine.load_adapter("alice", adapter(tiny_qwen3, 1), version=1)
    async with engine_of(tiny_qwen3, max_loras=1) as engine:
        with pytest.raises(EngineError, match="not loaded"):
            await engine.generate(PROMPT, SamplingParams(max_tokens=2, adapter="carol"))
        with pytest.raises(EngineError, match="not a LoRA payload"):
            await engine.load_adapter("alice", {"format": "x"}, version=1)
        a = adapter(tiny_qwen3, 1)
        await engine.load_adapter("alice", a, version=1)
        # one slot: bob evicts alice (not in use) from memory; she is still served, read back
        # from the engine's disk store on her next request (which in turn evicts bob)
        assert await engine.load_adapter("bob", adapter(tiny_qwen3, 2), version=4) == ["alice"]
        assert engine.resident_adapters() == ["bob"]
        assert engine.adapters() == {"bob": 4, "alice": 1}
        back = await engine.generate(PROMPT, dataclasses.replace(GREEDY, adapter="alice"))
        assert back[0].token_ids == reference_greedy(merged(tiny_qwen3, a), PROMPT, 10)
        assert back[0].policy_version == 1 and engine.resident_adapters() == ["alice"]
        ok = await engine.generate(PROMPT, GREEDY)  # the engine serves on
        assert await engine.unload_adapter("bob") and await engine.unload_adapter("alice")
        assert engine.adapters() == {}
        with pytest.raises(EngineError, match="not loaded"):  # unloaded means gone
            await engine.generate(PROMPT, SamplingParams(max_tokens=2, adapter="alice"))
    assert ok[0].finish_reason == "length"
    with pytest.raises(ValueError, match="adapter"):
        SamplingParams(adapter="")
