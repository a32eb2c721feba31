"""FixedLatencyEngine: the model-free engine used by serving benchmarks and protocol tests."""

from __future__ import annotations

import asyncio
import time

import pytest

from clawray.inference import (
    Engine,
    EngineError,
    EngineOverloaded,
    FixedLatencyEngine,
    SamplingParams,
)


async def test_satisfies_the_engine_protocol():
    assert isinstance(FixedLatencyEngine(), Engine)


async def test_concurrent_requests_overlap_their_latency():
    """Each request waits its latency, and all wait at once: every one of 20 has started
    before any finishes (an engine that served them one by one would finish the first first)."""
    engine = FixedLatencyEngine(latency_s=0.1)
    starts, ends = [], []

    async def one():
        starts.append(time.monotonic())
        out = await engine.generate([1, 2], SamplingParams())
        ends.append(time.monotonic())
        return out

    outs = await asyncio.gather(*[one() for _ in range(20)])
    assert len(outs) == 20 and min(ends) - min(starts) >= 0.1  # the latency was waited
    assert max(starts) < min(ends)


async def test_fixed_tokens_are_returned_and_cut_to_max_tokens():
    engine = FixedLatencyEngine(latency_s=0, tokens=[5, 6, 7, 8])
    full = (await engine.generate([1], SamplingParams()))[0]
    cut = (await engine.generate([1], SamplingParams(max_tokens=2)))[0]
    assert (full.token_ids, full.finish_reason) == ([5, 6, 7, 8], "stop")
    assert (cut.token_ids, cut.finish_reason) == ([5, 6], "length")
    clamped = FixedLatencyEngine(latency_s=0, tokens=[5, 6, 7, 8], max_model_len=4)
    assert (await clamped.generate([1, 2], SamplingParams()))[0].token_ids == [5, 6]


async def test_seeded_replies_are_reproducible_and_logprobs_match_prompt_logprobs():
    engine = FixedLatencyEngine(latency_s=0, response_len=12, vocab_size=100)
    a = await engine.generate([1, 2, 3], SamplingParams(seed=1, n=2))
    b = await engine.generate([1, 2, 3], SamplingParams(seed=1, n=2))
    c = await engine.generate([1, 2, 3], SamplingParams(seed=2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].token_ids != a[1].token_ids != c[0].token_ids
    assert [o.index for o in a] == [0, 1]
    assert all(0 <= t < 100 for t in a[0].token_ids) and len(a[0].token_ids) == 12
    assert await engine.prompt_logprobs([1, 2, 3], a[0].token_ids) == a[0].logprobs
    assert all(lp < 0 for lp in a[0].logprobs)


async def test_stream_yields_one_delta_per_token_and_finishes_each_completion():
    engine = FixedLatencyEngine(latency_s=0, tokens=[5, 6, 7])
    deltas = [d async for d in engine.generate_stream([1], SamplingParams(n=2))]
    for i in (0, 1):
        mine = [d for d in deltas if d.index == i]
        assert [d.token_ids[0] for d in mine] == [5, 6, 7]
        assert [d.finish_reason for d in mine] == [None, None, "stop"]


async def running(engine: FixedLatencyEngine, n: int = 1) -> None:
    """Until ``n`` requests are in flight (a request counts itself as it starts, in the same
    step that reads its policy version). The caller's next line runs before the loop does
    anything else, so those requests are still in flight then, however slow the machine."""
    deadline = time.monotonic() + 30
    while (await engine.status()).running < n:
        assert time.monotonic() < deadline, f"{n} request(s) never started"
        await asyncio.sleep(0)


async def test_weight_load_during_a_request_sets_policy_version_end():
    engine = FixedLatencyEngine(latency_s=0.1)
    task = asyncio.create_task(engine.generate([1], SamplingParams()))
    await running(engine)
    await engine.load_weights({}, policy_version=4)
    out = (await task)[0]
    later = (await engine.generate([1], SamplingParams()))[0]
    assert (out.policy_version, out.policy_version_end) == (0, 4)
    assert (later.policy_version, later.policy_version_end) == (4, None)
    assert (await engine.status()).policy_version == 4


async def test_pause_holds_requests_until_resume():
    engine = FixedLatencyEngine(latency_s=0)
    await engine.pause()
    task = asyncio.create_task(engine.generate([1], SamplingParams()))
    await asyncio.sleep(0.05)
    st = await engine.status()
    assert st.paused and st.running == 1 and not task.done()
    await engine.resume()
    await asyncio.wait_for(task, 30)  # a deadline against a hang, not a time to beat
    assert (await engine.status()).running == 0


async def test_errors_overload_and_shutdown():
    engine = FixedLatencyEngine(latency_s=0.2, max_model_len=8, max_running=1)
    with pytest.raises(EngineError, match="context window"):
        await engine.generate(list(range(8)), SamplingParams())
    with pytest.raises(EngineError, match="context window"):
        await engine.prompt_logprobs([1, 2], list(range(7)))
    first = asyncio.create_task(engine.generate([1], SamplingParams()))
    await running(engine)
    with pytest.raises(EngineOverloaded):
        await engine.generate([1], SamplingParams())
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert (await engine.status()).running == 0
    await engine.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        await engine.generate([1], SamplingParams())
