"""``POST /v1/completions`` on the embedded model (transformers engine, in process): plain
prompts generated on as is (no chat template), several prompts in one request, token-id
prompts, ``echo``, log-probs in this API's shape equal to the record's, a stream that adds up
to the whole answer, side-turn records, and precise 400s."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.inference.hf_engine import HFEngine
from clawray.serve import openai_completions as oc
from clawray.serve.chat import ChatService
from clawray.serve.policy_server import LocalPolicy
from clawray.serve.protocol import APIError
from tests.support.common import ListSink


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return HFEngine.from_path(tiny_model_path, max_model_len=512)


@pytest.fixture()
def svc(engine, tiny_tokenizer):
    sink = ListSink()
    service = ChatService(tiny_tokenizer, LocalPolicy(engine), "m", 512, ServingConfig(), sink)
    return service, sink


async def run(service, body: dict, headers=None) -> dict:
    req, fields = oc.parse_request(json.dumps({"model": "m", **body}).encode())
    return await oc.complete(service, await oc.prepare(service, req, fields, headers or {},
                                                       "local"))


async def test_a_plain_prompt_is_generated_on_as_is_and_recorded_as_a_side_turn(
        svc, tiny_tokenizer):
    service, sink = svc
    body = await run(service, {"prompt": "The capital of France is", "max_tokens": 8,
                               "temperature": 0, "logprobs": 2})
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    [rec] = sink.records
    assert rec.prompt_ids == tiny_tokenizer.encode("The capital of France is",
                                                   add_special_tokens=False)
    assert rec.turn_type == "side" and rec.messages == []
    assert choice["text"] == tiny_tokenizer.decode(rec.response_ids, skip_special_tokens=True)
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == rec.response_logprobs
    assert lp["tokens"] == [tiny_tokenizer.decode([t]) for t in rec.response_ids]
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    # greedy: the sampled token is the most likely one
    assert all(max(t.values()) == pytest.approx(v) for t, v in
               zip(lp["top_logprobs"], lp["token_logprobs"]))
    assert lp["text_offset"][0] == 0
    assert body["usage"]["prompt_tokens"] == len(rec.prompt_ids)
    assert body["usage"]["completion_tokens"] == len(rec.response_ids)


async def test_several_prompts_and_token_prompts(svc, tiny_tokenizer):
    service, sink = svc
    ids = tiny_tokenizer.encode("Hello", add_special_tokens=False)
    body = await run(service, {"prompt": ["one two", "three"], "n": 2, "max_tokens": 4,
                               "seed": 1})
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len(sink.records) == 4
    body = await run(service, {"prompt": [ids, ids], "max_tokens": 4, "temperature": 0})
    assert body["choices"][0]["text"] == body["choices"][1]["text"]
    body2 = await run(service, {"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert body2["choices"][0]["text"] == body["choices"][0]["text"]
    body3 = await run(service, {"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert body3["choices"][0]["text"] == body["choices"][0]["text"]


async def test_echo_puts_the_prompt_first(svc):
    service, _ = svc
    plain = await run(service, {"prompt": "Once upon", "max_tokens": 5, "temperature": 0})
    echoed = await run(service, {"prompt": "Once upon", "max_tokens": 5, "temperature": 0,
                                 "echo": True})
    assert echoed["choices"][0]["text"] == "Once upon" + plain["choices"][0]["text"]


async def test_the_stream_adds_up_to_the_whole_answer(svc):
    service, sink = svc
    body = {"prompt": ["a b c", "d e"], "max_tokens": 12, "temperature": 0, "logprobs": 1,
            "stream": True, "stream_options": {"include_usage": True}}
    req, fields = oc.parse_request(json.dumps(body).encode())
    lines = [x async for x in oc.stream(service, await oc.prepare(service, req, fields, {},
                                                                   "local"))]
    assert lines[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(x[6:]) for x in lines[:-1]]
    usage = chunks[-1]["usage"]
    texts, lps, finish = {}, {}, {}
    for c in chunks[:-1]:
        [ch] = c["choices"]
        texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
        if ch["logprobs"]:
            lps.setdefault(ch["index"], []).extend(ch["logprobs"]["token_logprobs"])
        if ch["finish_reason"]:
            finish[ch["index"]] = ch["finish_reason"]
    whole = await run(service, {**body, "stream": False, "stream_options": None})
    for c in whole["choices"]:
        assert texts[c["index"]] == c["text"] and finish[c["index"]] == c["finish_reason"]
        # equal up to float noise: the two runs batch the prompts' decode steps differently
        assert lps[c["index"]] == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-4)
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"]
    # every chunk names the policy version, the usage chunk too (as OpenAI's)
    assert {c["system_fingerprint"] for c in chunks} == {whole["system_fingerprint"]}


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], [99999]]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "word " * 600}, "prompt"),
    ({}, "prompt"),
])
async def test_bad_requests_are_400_naming_the_field(svc, body, param):
    service, _ = svc
    with pytest.raises(APIError) as e:
        await run(service, body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
