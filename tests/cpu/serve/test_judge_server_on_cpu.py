"""JudgeCore on the embedded tiny model: one engine call for n votes, teacher log-probs aligned
to the exact response ids, clear errors; and the JudgeServer deployment through Ray Serve."""

from __future__ import annotations

import asyncio
import math
import re
import time

import pytest
import torch

from clawray.config import ClawRayConfig
from clawray.inference.engine import SamplingParams
from clawray.judging.backends import ServerBackend
from clawray.serve.judge_server import JudgeCore, JudgeInputError, JudgeServer
from clawray.judging.opd import inject_hint
from clawray.learner.losses import opd_advantages
from clawray.judging.formats import hint_format, verdict_format
from clawray.judging.parse import parse_hint_vote, tally
from clawray.judging.prompts import TurnContext, build_judge_request

TOOLS = [{"type": "function", "function": {
    "name": "ls", "description": "List files", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}}}}}]
STUDENT = [{"role": "system", "content": "You are a helpful agent."},
           {"role": "user", "content": "Please list the workspace."}]
CTX = TurnContext(history=[], request=[{"role": "user", "content": "2+2?"}], response_text="5",
                  response_tool_calls=[],
                  next_state=[{"role": "user", "content": "That's wrong, try again"}])


class SpyEngine:
    """The real engine, with its generate / prompt_logprobs calls recorded (or overridden)."""

    def __init__(self, engine, logprobs_override=None) -> None:
        self.inner = engine
        self.generate_calls: list[tuple[list[int], SamplingParams]] = []
        self.logprobs_override = logprobs_override

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, prompt_ids, params):
        self.generate_calls.append((list(prompt_ids), params))
        return await self.inner.generate(prompt_ids, params)

    async def prompt_logprobs(self, prompt_ids, response_ids):
        if self.logprobs_override is not None:
            return self.logprobs_override(prompt_ids, response_ids)
        return await self.inner.prompt_logprobs(prompt_ids, response_ids)


@pytest.fixture(scope="module")
def cfg(tiny_model_path) -> ClawRayConfig:
    return ClawRayConfig().inference(engine="hf").model(path=str(tiny_model_path))


@pytest.fixture(scope="module")
def core(cfg):
    core = JudgeCore(cfg)
    yield core
    asyncio.run(core.engine.shutdown())


def manual_prompt_ids(tokenizer, messages, tools=None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def test_embedded_default_judge_is_the_policy_model(core, tiny_model_path):
    assert core.info.path == tiny_model_path
    status = await core.status()
    assert status["engine"] == "hf" and status["max_model_len"] == core.max_model_len


async def test_judge_samples_n_votes_from_one_engine_call(cfg, core):
    spy = SpyEngine(core.engine)
    judge = JudgeCore(cfg, engine=spy, tokenizer=core.tokenizer)
    req = build_judge_request("prm", CTX)
    outputs = await judge.judge(req.messages, 3, 0.6, 16)
    assert len(outputs) == 3 and all(isinstance(t, str) for t in outputs)
    assert len(spy.generate_calls) == 1
    prompt_ids, params = spy.generate_calls[0]
    assert params.n == 3 and params.temperature == 0.6 and params.max_tokens == 16
    assert prompt_ids == manual_prompt_ids(core.tokenizer, req.messages)
    result = tally(outputs)  # the tiny model writes no verdicts: parse failures, score 0
    assert result.parse_failures + len(result.votes) == 3


async def test_a_constrained_judge_ends_every_output_with_one_verdict(core):
    """The untrained tiny model never writes a verdict box by itself; under the PRM format
    (judge.constrained) every output it samples ends in one, and under the OPD format every
    positive verdict carries a hint: no vote is lost to the parser."""
    req = build_judge_request("prm", CTX)
    free = tally(await core.judge(req.messages, 4, 1.0, 48))
    assert free.parse_failures == 4  # the control: the same call unconstrained
    outputs = await core.judge(req.messages, 4, 1.0, 48,
                               structural_tag=verdict_format((1, -1, 0), 48))
    result = tally(outputs)
    assert result.parse_failures == 0 and len(result.votes) == 4, outputs
    assert all(re.fullmatch(r"[^\\]*\\boxed\{(1|-1|0)\}", t) for t in outputs), outputs
    hints = [parse_hint_vote(t) for t in await core.judge(
        build_judge_request("opd", CTX).messages, 4, 1.0, 64,
        structural_tag=hint_format(64, hint_max_chars=16))]
    assert all(vote in (1, -1) and (hint is not None) == (vote == 1) for vote, hint in hints), hints


async def test_judge_decodes_outputs_without_special_tokens(core):
    outputs = await core.judge(STUDENT, 2, 0.0, 24)
    prompt_ids = manual_prompt_ids(core.tokenizer, STUDENT)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=24)
    raw = await core.engine.generate(prompt_ids, params)
    expected = [core.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in raw]
    assert outputs == expected
    assert all("<|im_end|>" not in t for t in outputs)


async def test_teacher_logprobs_score_exact_response_ids_under_the_hinted_prompt(core):
    tok = core.tokenizer
    student_ids = manual_prompt_ids(tok, STUDENT, TOOLS)
    [sample] = await core.engine.generate(student_ids, SamplingParams(temperature=1.0,
                                                                       max_tokens=12, seed=7))
    response_ids = sample.token_ids
    hinted = inject_hint(STUDENT, "Use the ls tool on '.'.")
    teacher = await core.teacher_logprobs(hinted, TOOLS, response_ids)
    assert len(teacher) == len(response_ids)
    assert all(math.isfinite(x) and x <= 0 for x in teacher)
    hinted_ids = manual_prompt_ids(tok, hinted, TOOLS)
    assert "[User's hint / instruction]" in tok.decode(hinted_ids)
    assert teacher == await core.engine.prompt_logprobs(hinted_ids, response_ids)
    # Without a hint the teacher (here the policy model itself) is the student: the OPD
    # advantage is zero on every token, which only holds if positions line up exactly.
    same = await core.teacher_logprobs(STUDENT, TOOLS, response_ids)
    adv = opd_advantages(torch.tensor(same), torch.tensor(sample.logprobs))
    assert adv.abs().max().item() < 1e-4


async def test_teacher_logprobs_length_mismatch_is_an_error(cfg, core):
    spy = SpyEngine(core.engine, logprobs_override=lambda p, r: [0.0] * (len(r) - 1))
    judge = JudgeCore(cfg, engine=spy, tokenizer=core.tokenizer)
    with pytest.raises(RuntimeError, match="align one-to-one"):
        await judge.teacher_logprobs(STUDENT, None, [10, 11, 12])


async def test_too_long_prompts_give_clear_errors(tiny_model_path):
    small = JudgeCore(ClawRayConfig().inference(engine="hf")
                      .model(path=str(tiny_model_path), max_model_len=64))
    try:
        assert small.max_model_len == 64
        req = build_judge_request("prm", CTX)
        with pytest.raises(JudgeInputError, match="context window is 64"):
            await small.judge(req.messages, 3, 0.6, 16)
        prompt_len = len(small.template(STUDENT))
        assert prompt_len < 64
        with pytest.raises(JudgeInputError, match="exceeds the judge model's context window"):
            await small.teacher_logprobs(STUDENT, None, [10] * (65 - prompt_len))
    finally:
        await small.engine.shutdown()


@pytest.mark.ray
def test_judge_server_deployment_through_serve(served, cfg, tiny_tokenizer):
    from ray import serve

    app = JudgeServer.options(ray_actor_options={"num_cpus": 0}).bind(cfg.to_dict())
    handle = serve.run(app, name="judge-test", route_prefix=None)
    try:
        req = build_judge_request("prm", CTX)
        outputs = handle.judge.remote(req.messages, 2, 0.6, 8).result(timeout_s=60)
        assert len(outputs) == 2 and all(isinstance(t, str) for t in outputs)
        ids = tiny_tokenizer.encode("Hello there", add_special_tokens=False)
        teacher = handle.teacher_logprobs.remote(STUDENT, None, ids).result(timeout_s=60)
        assert len(teacher) == len(ids) and all(math.isfinite(x) for x in teacher)

        async def through_backend():
            backend = ServerBackend(serve.get_app_handle("judge-test"))
            return (await backend.complete(req, 3, 0.6, 8),
                    await backend.teacher_logprobs(STUDENT, None, ids))

        votes, again = asyncio.run(through_backend())
        assert len(votes) == 3 and again == teacher
        assert handle.status.remote().result(timeout_s=30)["engine"] == "hf"
    finally:
        serve.delete("judge-test")


def test_a_judge_call_its_caller_gave_up_on_stops_on_the_judge_server(served, cfg):
    """A voter's timeout cancels its call (``VoterPool._call``); the JudgeServer stops the call
    too instead of running it to the end. Its engine here takes an hour a call, so a call
    still running 120 s after its caller gave up is one nobody cancelled (a generous deadline,
    not a time to beat: an uncancelled call would run on past it whatever the machine)."""
    from ray import serve

    slow = cfg.copy_with(inference={"engine": "fixed_latency", "fixed_latency_s": 3600.0})
    app = JudgeServer.options(ray_actor_options={"num_cpus": 0}).bind(slow.to_dict())
    serve.run(app, name="judge-slow", route_prefix=None)

    async def give_up() -> float:
        handle = serve.get_app_handle("judge-slow")
        backend = ServerBackend(handle)
        call = asyncio.create_task(backend.complete(build_judge_request("prm", CTX), 3, 0.6, 8))
        deadline = time.monotonic() + 120
        while (await handle.status.remote())["running"] == 0:
            assert time.monotonic() < deadline, "the judge call never started"
            await asyncio.sleep(0.05)
        call.cancel()  # what asyncio.wait_for does to it at the voter's timeout
        with pytest.raises(asyncio.CancelledError):
            await call
        gave_up = time.monotonic()
        while (await handle.status.remote())["running"] > 0:
            assert time.monotonic() - gave_up < 120, \
                "the JudgeServer still runs a call its caller gave up on"
            await asyncio.sleep(0.05)
        return time.monotonic() - gave_up

    try:
        stopped_after = asyncio.run(give_up())
        print(f"the abandoned judge call stopped {stopped_after:.2f} s after its caller gave up")
    finally:
        serve.delete("judge-slow")
