"""HFEngine on a real (tiny, random) transformers Qwen3: sampling, streaming, scheduling."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
import time

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from clawray.inference import Engine, EngineError, EngineOverloaded, HFEngine, SamplingParams
from tests.unit.inference.conftest import VOCAB

PROMPT = [3, 17, 42, 99, 7, 250, 11]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@contextlib.asynccontextmanager
async def engine_of(model, **kw):
    engine = HFEngine(model, eos_token_ids=kw.pop("eos_token_ids", []), **kw)
    try:
        yield engine
    finally:
        await engine.shutdown()


async def wait_for(predicate, timeout: float = 60.0) -> None:
    """Until ``predicate()`` holds; a generous deadline against a hang, not a time to beat."""
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def letters(ids: list[int]) -> str:
    """A stand-in detokenizer: one letter per id."""
    return "".join(chr(ord("a") + i % 26) for i in ids)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt):].tolist()


async def test_engine_satisfies_protocol(tiny_qwen3):
    async with engine_of(tiny_qwen3) as engine:
        assert isinstance(engine, Engine)
        st = await engine.status()
        assert (st.engine, st.running, st.waiting, st.policy_version) == ("hf", 0, 0, 0)


async def test_greedy_equals_transformers_generate_and_is_deterministic(tiny_qwen3):
    expected = reference_greedy(tiny_qwen3, PROMPT, GREEDY.max_tokens)
    async with engine_of(tiny_qwen3) as engine:
        first = await engine.generate(PROMPT, GREEDY)
        # Again, batched with other requests of different lengths.
        many = await asyncio.gather(
            *[engine.generate(PROMPT[: 3 + i % 4], GREEDY) for i in range(5)],
            engine.generate(PROMPT, GREEDY),
        )
    assert first[0].token_ids == expected
    assert first[0].finish_reason == "length"
    assert many[-1][0].token_ids == expected


async def test_logprobs_equal_prompt_logprobs(tiny_qwen3):
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=5)
    async with engine_of(tiny_qwen3) as engine:
        out, _ = await asyncio.gather(
            engine.generate(PROMPT, params), engine.generate([1, 2, 3, 4, 5, 6, 7, 8, 9], params)
        )
        ids, lps = out[0].token_ids, out[0].logprobs
        scored = await engine.prompt_logprobs(PROMPT, ids)
    assert len(lps) == len(ids) == len(scored) == 24
    assert torch.allclose(torch.tensor(lps), torch.tensor(scored), atol=1e-4)
    # Both are the raw distribution (temperature 1, no top-p) of one plain forward pass.
    with torch.no_grad():
        logits = tiny_qwen3(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1]
    raw = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(torch.tensor(lps), raw, atol=1e-4)


async def test_top_logprobs_are_the_raw_distributions_best(tiny_qwen3):
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3, top_logprobs=3)
    async with engine_of(tiny_qwen3) as engine:
        [out] = await engine.generate(PROMPT, params)
        streamed = [d async for d in engine.generate_stream(PROMPT, params)]
    assert len(out.top_logprobs) == len(out.token_ids) == 6
    with torch.no_grad():
        logits = tiny_qwen3(torch.tensor([PROMPT + out.token_ids])).logits[0, len(PROMPT) - 1:-1]
    values, ids = torch.log_softmax(logits, -1).topk(3)
    for i, top in enumerate(out.top_logprobs):
        assert [t for t, _ in top] == ids[i].tolist()
        assert torch.allclose(torch.tensor([v for _, v in top]), values[i], atol=1e-4)
        if out.token_ids[i] in ids[i].tolist():  # the sampled token's two values agree
            assert abs(dict(top)[out.token_ids[i]] - out.logprobs[i]) < 1e-5
    assert [t for d in streamed for t in d.top_logprobs or []] == out.top_logprobs


async def test_penalties_and_logit_bias_shape_greedy_choices_exactly(tiny_qwen3):
    """Each greedy choice is the argmax of the penalized, biased logits (computed here from a
    plain forward pass); log-probs stay those of the raw model."""
    params = SamplingParams(max_tokens=10, temperature=0, presence_penalty=0.7,
                            frequency_penalty=1.3, repetition_penalty=1.5,
                            logit_bias=((5, 3.0), (17, -100.0)))
    async with engine_of(tiny_qwen3) as engine:
        [out] = await engine.generate(PROMPT, params)
        [plain] = await engine.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0))
    assert out.token_ids != plain.token_ids and 17 not in out.token_ids
    with torch.no_grad():
        logits = tiny_qwen3(torch.tensor([PROMPT + out.token_ids])).logits[0].float()
    for i, tok in enumerate(out.token_ids):
        row = logits[len(PROMPT) - 1 + i].clone()
        row[5] += 3.0
        row[17] -= 100.0
        seen = torch.tensor(sorted(set(PROMPT) | set(out.token_ids[:i])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.5, row[seen] * 1.5)
        counts = torch.bincount(torch.tensor(out.token_ids[:i] or [0]), minlength=row.shape[0])
        if not i:
            counts.zero_()
        row -= counts * 1.3 + (counts > 0).float() * 0.7
        assert int(row.argmax()) == tok, i
    raw = torch.log_softmax(logits[len(PROMPT) - 1:-1], -1)
    raw = raw.gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(torch.tensor(out.logprobs), raw, atol=1e-4)


async def test_chunked_prefill_gives_the_same_logprobs_as_one_chunk(tiny_qwen3):
    response = [5, 80, 13, 400, 2, 9, 77, 301, 64, 128, 1]
    async with engine_of(tiny_qwen3, prefill_chunk=4) as chunked:
        small = await chunked.prompt_logprobs(PROMPT, response)
        gen_small = await chunked.generate(PROMPT * 3, GREEDY)
    async with engine_of(tiny_qwen3) as whole:
        big = await whole.prompt_logprobs(PROMPT, response)
        gen_big = await whole.generate(PROMPT * 3, GREEDY)
    assert torch.allclose(torch.tensor(small), torch.tensor(big), atol=1e-4)
    assert gen_small[0].token_ids == gen_big[0].token_ids


async def test_seed_reproducible_regardless_of_concurrent_requests(tiny_qwen3):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=42)
    async with engine_of(tiny_qwen3) as engine:
        alone = await engine.generate(PROMPT, params)
        crowd = await asyncio.gather(
            *[engine.generate(PROMPT[:4] + [i], SamplingParams(max_tokens=20)) for i in range(6)],
            engine.generate(PROMPT, params),
        )
        other_seed = await engine.generate(PROMPT, SamplingParams(max_tokens=16, seed=43))
    assert crowd[-1][0].token_ids == alone[0].token_ids
    assert other_seed[0].token_ids != alone[0].token_ids


async def test_stream_yields_the_same_ids_one_token_at_a_time(tiny_qwen3):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7)
    async with engine_of(tiny_qwen3) as engine:
        out = await engine.generate(PROMPT, params)
        deltas = [d async for d in engine.generate_stream(PROMPT, params)]
    assert [t for d in deltas for t in d.token_ids] == out[0].token_ids
    assert [lp for d in deltas for lp in d.logprobs] == pytest.approx(out[0].logprobs, abs=1e-6)
    assert all(len(d.token_ids) == 1 for d in deltas)
    assert [d.finish_reason for d in deltas] == [None] * 9 + ["length"]


async def test_n_completions_are_indexed_distinct_and_scored_consistently(tiny_qwen3):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3)
    async with engine_of(tiny_qwen3) as engine:
        outs = await engine.generate(PROMPT, params)
        again = await engine.generate(PROMPT, params)
        streamed = [d async for d in engine.generate_stream(PROMPT, params)]
        scored = [await engine.prompt_logprobs(PROMPT, o.token_ids) for o in outs]
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 3
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    for o in outs:
        assert [t for d in streamed if d.index == o.index for t in d.token_ids] == o.token_ids
    for o, s in zip(outs, scored):
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(s), atol=1e-4)


async def test_stop_string_finishes_with_stop_and_keeps_generated_ids(tiny_qwen3):
    async with engine_of(tiny_qwen3, decode=letters) as engine:
        free = (await engine.generate(PROMPT, GREEDY))[0].token_ids
        text = letters(free)
        stop = text[4:6]  # completed by token 5 (or earlier, if it occurs before)
        cut = text.find(stop) + len(stop)
        out = (await engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                            stop=("zzzzzz", stop))))[0]
    assert out.finish_reason == "stop" and out.stop_string == stop
    assert out.token_ids == free[:cut]
    assert len(out.logprobs) == len(out.token_ids)


async def test_max_tokens_and_context_clamp_finish_with_length(tiny_qwen3):
    async with engine_of(tiny_qwen3, max_model_len=32) as engine:
        out = (await engine.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0)))[0]
        assert (len(out.token_ids), out.finish_reason) == (5, "length")
        clamped = (await engine.generate(list(range(1, 30)), SamplingParams(max_tokens=100)))[0]
        assert (len(clamped.token_ids), clamped.finish_reason) == (3, "length")


async def test_eos_id_is_included_with_its_logprob(tiny_qwen3):
    free = reference_greedy(tiny_qwen3, PROMPT, 12)
    at = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)
    async with engine_of(tiny_qwen3, eos_token_ids=[free[at]]) as engine:
        out = (await engine.generate(PROMPT, GREEDY))[0]
        scored = await engine.prompt_logprobs(PROMPT, out.token_ids)
    assert out.finish_reason == "stop" and out.stop_string is None
    assert out.token_ids == free[: at + 1] and out.token_ids[-1] == free[at]
    assert out.logprobs[-1] == pytest.approx(scored[-1], abs=1e-4)


async def test_eos_ids_come_from_the_tokenizer():
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"hi": 0, "<|im_end|>": 1, "<unk>": 2}, unk_token="<unk>"))
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, eos_token_id=None,
    )
    engine = HFEngine(Qwen3ForCausalLM(config), tok, max_model_len=64)
    try:
        assert 1 in engine.eos_token_ids and 2 not in engine.eos_token_ids
    finally:
        await engine.shutdown()


async def test_sixteen_concurrent_requests_and_short_beats_long(tiny_qwen3):
    finished: list[str] = []

    async def run(name: str, prompt: list[int], max_tokens: int):
        out = await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=1))
        finished.append(name)
        return out

    async with engine_of(tiny_qwen3, max_running=16) as engine:
        long = asyncio.create_task(run("long", PROMPT, 400))
        await wait_for(lambda: _running_at_least(engine, 1))
        others = [
            asyncio.create_task(run(f"r{i}", PROMPT[: 2 + i % 5] + [i], 10 + i)) for i in range(15)
        ]
        results = await asyncio.gather(long, *others)
        st = await engine.status()
    assert finished[-1] == "long" and len(finished) == 16
    lengths = [400] + [10 + i for i in range(15)]
    assert [len(r[0].token_ids) for r in results] == lengths
    assert st.running == 0


async def test_long_prompt_prefill_is_interleaved_with_other_requests(tiny_qwen3):
    order: list[str] = []

    async def run(name: str, prompt: list[int], max_tokens: int):
        await engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        order.append(name)

    async with engine_of(tiny_qwen3, prefill_chunk=32) as engine:
        long = asyncio.create_task(run("long-prompt", [i % VOCAB for i in range(2000)], 1))
        await wait_for(lambda: _running_at_least(engine, 1))
        await asyncio.gather(long, run("short", PROMPT, 5))
    assert order == ["short", "long-prompt"]


async def _running_at_least(engine: HFEngine, n: int) -> bool:
    return (await engine.status()).running >= n


async def _idle(engine: HFEngine) -> bool:
    st = await engine.status()
    return st.running == 0 and st.waiting == 0


async def test_closing_a_stream_aborts_and_frees_the_slot(tiny_qwen3):
    async with engine_of(tiny_qwen3) as engine:
        stream = engine.generate_stream(PROMPT, SamplingParams(max_tokens=3000))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        await wait_for(lambda: _idle(engine))
        steps = (await engine.status()).extra["steps"]
        await asyncio.sleep(0.1)
        assert (await engine.status()).extra["steps"] == steps  # nothing keeps generating


async def test_dropping_a_stream_without_aclose_also_frees_the_slot(tiny_qwen3):
    async with engine_of(tiny_qwen3) as engine:
        async for _ in engine.generate_stream(PROMPT, SamplingParams(max_tokens=3000)):
            break  # the generator is finalized by the event loop's asyncgen hook
        await wait_for(lambda: _idle(engine))


async def test_cancelling_generate_aborts_and_frees_the_slot(tiny_qwen3):
    async with engine_of(tiny_qwen3) as engine:
        task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=3000, n=2)))
        await wait_for(lambda: _running_at_least(engine, 2))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: _idle(engine))


async def test_full_waiting_queue_raises_engine_overloaded(tiny_qwen3):
    async with engine_of(tiny_qwen3, max_running=1, max_waiting=1) as engine:
        params = SamplingParams(max_tokens=3000)
        running = asyncio.create_task(engine.generate(PROMPT, params))
        waiting = asyncio.create_task(engine.generate(PROMPT, params))
        await wait_for(lambda: _waiting_is(engine, 1))
        with pytest.raises(EngineOverloaded, match="overloaded"):
            await engine.generate(PROMPT, params)
        with pytest.raises(EngineError, match="max_running"):
            await engine.generate(PROMPT, SamplingParams(n=2))
        assert isinstance(EngineOverloaded("x"), EngineError)
        for t in (running, waiting):
            t.cancel()
        await asyncio.gather(running, waiting, return_exceptions=True)
        await wait_for(lambda: _idle(engine))


async def _waiting_is(engine: HFEngine, n: int) -> bool:
    return (await engine.status()).waiting == n


async def test_load_weights_mid_generation_sets_policy_version_end(tiny_qwen3):
    model = copy.deepcopy(tiny_qwen3)
    g = torch.Generator().manual_seed(5)
    new_weights = {
        k: v + 0.05 * torch.randn(v.shape, generator=g)
        for k, v in model.state_dict().items() if "mlp" in k
    }
    # The scheduler thread generates on while the event loop gets to load_weights: on a busy
    # machine it could reach the 400th token first. So its first decoding step (one input id
    # per sequence; the prefill feeds the prompt) waits until the swap is queued: the swap
    # lands between two steps of this request, however slow the machine.
    queued = threading.Event()

    def hold_first_decode(_module, args):
        if args[0].shape[-1] == 1 and not queued.is_set():
            assert queued.wait(60), "the weight swap was never queued"

    hook = model.get_input_embeddings().register_forward_pre_hook(hold_first_decode)
    async with engine_of(model) as engine:
        stream = engine.generate_stream(PROMPT, SamplingParams(max_tokens=400, temperature=0.0))
        deltas = [await stream.__anext__()]
        swap = asyncio.create_task(engine.load_weights(new_weights, policy_version=1))
        await asyncio.sleep(0)  # the task runs first: load_weights has queued the swap
        queued.set()
        await swap
        hook.remove()
        deltas += [d async for d in stream]
        after = (await engine.generate(PROMPT, GREEDY))[0]
        scored = await engine.prompt_logprobs(PROMPT, after.token_ids)
        st = await engine.status()
    assert sum(len(d.token_ids) for d in deltas) == 400
    assert deltas[-1].finish_reason == "length"
    assert {d.policy_version for d in deltas} == {0} and deltas[-1].policy_version_end == 1
    assert (after.policy_version, after.policy_version_end) == (1, None)
    assert after.token_ids == reference_greedy(model, PROMPT, 12)  # the new weights are in use
    assert torch.allclose(torch.tensor(after.logprobs), torch.tensor(scored), atol=1e-4)
    assert st.policy_version == 1


async def test_bad_state_dict_is_rejected_and_changes_nothing(tiny_qwen3):
    model = copy.deepcopy(tiny_qwen3)
    before = model.state_dict()["lm_head.weight"].clone()
    async with engine_of(model) as engine:
        with pytest.raises(EngineError, match="unknown"):
            await engine.load_weights(
                {"lm_head.weight": torch.zeros_like(before), "nope": before}, 5
            )
        with pytest.raises(EngineError, match="shape"):
            await engine.load_weights({"lm_head.weight": torch.zeros(3, 3)}, 5)
        assert (await engine.status()).policy_version == 0
        assert (await engine.generate(PROMPT, GREEDY))[0].finish_reason == "length"
    assert torch.equal(model.state_dict()["lm_head.weight"], before)


async def test_pause_holds_generation_and_resume_continues(tiny_qwen3):
    async with engine_of(tiny_qwen3) as engine:
        await engine.pause()
        task = asyncio.create_task(engine.generate(PROMPT, GREEDY))
        await asyncio.sleep(0.2)
        st = await engine.status()
        assert st.paused and not task.done() and st.extra["tokens_generated"] == 0
        await engine.resume()
        out = await asyncio.wait_for(task, 60)  # a deadline against a hang
    assert len(out[0].token_ids) == GREEDY.max_tokens


async def test_prompt_errors_are_reported_before_generation(tiny_qwen3):
    async with engine_of(tiny_qwen3, max_model_len=16) as engine:
        with pytest.raises(EngineError, match="context window"):
            await engine.generate(list(range(1, 17)), GREEDY)
        with pytest.raises(EngineError, match="empty"):
            await engine.generate([], GREEDY)
        with pytest.raises(EngineError, match="vocabulary"):
            await engine.generate([1, VOCAB], GREEDY)
        with pytest.raises(EngineError, match="tokenizer"):
            await engine.generate(PROMPT, SamplingParams(stop=("x",)))
        with pytest.raises(EngineError, match="context window"):
            await engine.prompt_logprobs(list(range(1, 10)), list(range(1, 10)))
        assert await engine.prompt_logprobs(PROMPT, []) == []


async def test_failing_forward_fails_only_its_request(tiny_qwen3):
    model = copy.deepcopy(tiny_qwen3)
    poison = 499

    def explode(_module, args):
        if (args[0] == poison).any():
            raise RuntimeError("boom")

    model.get_input_embeddings().register_forward_pre_hook(explode)
    async with engine_of(model) as engine:
        bad, good = await asyncio.gather(
            engine.generate([1, 2, poison], GREEDY),
            engine.generate(PROMPT, GREEDY),
            return_exceptions=True,
        )
        assert isinstance(bad, EngineError) and "boom" in str(bad)
        assert len(good[0].token_ids) == GREEDY.max_tokens
        await wait_for(lambda: _idle(engine))


async def test_shutdown_fails_in_flight_requests(tiny_qwen3):
    engine = HFEngine(tiny_qwen3, eos_token_ids=[])
    task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_tokens=3000)))
    await wait_for(lambda: _running_at_least(engine, 1))
    await engine.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        await task
    with pytest.raises(EngineError, match="shut down"):
        await engine.generate(PROMPT, GREEDY)


async def test_failing_detokenizer_fails_only_the_request_that_needs_it(tiny_qwen3):
    def broken(ids: list[int]) -> str:
        raise ValueError("cannot decode")

    async with engine_of(tiny_qwen3, decode=broken) as engine:
        with_stop = SamplingParams(max_tokens=12, temperature=0.0, stop=("x",), n=2)
        bad, good = await asyncio.gather(
            engine.generate(PROMPT, with_stop), engine.generate(PROMPT, GREEDY),
            return_exceptions=True,
        )
        assert isinstance(bad, EngineError) and "cannot decode" in str(bad)
        assert len(good[0].token_ids) == GREEDY.max_tokens
        await wait_for(lambda: _idle(engine))



async def test_ignore_eos_keeps_sampling_past_eos(tiny_qwen3):
    free = reference_greedy(tiny_qwen3, PROMPT, 12)
    at = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)
    async with engine_of(tiny_qwen3, eos_token_ids=[free[at]]) as engine:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out = (await engine.generate(PROMPT, params))[0]
    assert out.finish_reason == "length" and out.token_ids == free
