"""A model's generation_config.json sets the sampling defaults of a request that does not set
them (``vllm serve``'s ``--generation-config auto``), in every API; what a client sets wins."""

from __future__ import annotations

import json

import pytest

from clawray.config import ServingConfig
from clawray.models.loader import ModelInfo, ModelLoadError, sampling_defaults
from clawray.serve import anthropic_messages, openai_chat, openai_completions, openai_responses
from clawray.serve.chat import ChatService
from clawray.serve.protocol import ChatCompletionRequest
from tests.support.common import ListSink

MODEL = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}


def test_the_sampling_settings_of_a_generation_config_are_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 8192, "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "max_new_tokens": 64, **MODEL}))
    assert ModelInfo.from_path(tmp_path).sampling_defaults == MODEL
    assert sampling_defaults({"do_sample": False, "temperature": 0.7})["temperature"] == 0.0
    assert sampling_defaults({}) == {}


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5},
                                 {"repetition_penalty": "high"}, {"temperature": True}])
def test_a_setting_outside_its_range_is_refused_naming_it(bad):
    with pytest.raises(ModelLoadError, match=next(iter(bad))):
        sampling_defaults(bad)


def _requests(tokenizer, **sampling):
    """One request per API, with ``sampling`` in each one's own spelling."""
    msgs = [{"role": "user", "content": "hi"}]
    rep = {k: v for k, v in sampling.items() if k == "repetition_penalty"}
    return {
        "chat": openai_chat.to_turn_request(ChatCompletionRequest(
            model="m", messages=msgs, **sampling), {}),
        "completions": openai_completions.to_turn_requests(openai_completions.CompletionRequest(
            model="m", prompt=[5, 6, 7], **sampling), {}, tokenizer)[0],
        "responses": openai_responses.to_turn_request(openai_responses.ResponsesRequest(
            model="m", input="hi", **{k: v for k, v in sampling.items() if k not in rep}),
            [], None),
        "messages": anthropic_messages.to_turn_request(anthropic_messages.MessagesRequest(
            model="m", max_tokens=4, messages=msgs,
            **{k: v for k, v in sampling.items() if k not in rep})),
    }


async def _params(tokenizer, turn, defaults):
    svc = ChatService(tokenizer, None, "m", 4096, ServingConfig(), ListSink(),
                      sampling_defaults=defaults)
    return (await svc.prepare(turn, {"x-session-id": "s-1"})).params


async def test_unset_settings_take_the_models_defaults_in_every_api(tiny_tokenizer):
    for api, turn in _requests(tiny_tokenizer).items():
        p = await _params(tiny_tokenizer, turn, MODEL)
        assert (p.temperature, p.top_p) == (0.2, 0.9), api
        assert p.repetition_penalty == 1.1, api
        plain = await _params(tiny_tokenizer, turn, None)  # a model without defaults
        assert (plain.temperature, plain.top_p, plain.repetition_penalty) == (1.0, 1.0, 1.0)


async def test_what_the_client_sets_wins_and_null_means_unset(tiny_tokenizer):
    for api, turn in _requests(tiny_tokenizer, temperature=0.0, top_p=0.5).items():
        p = await _params(tiny_tokenizer, turn, MODEL)
        assert (p.temperature, p.top_p) == (0.0, 0.5), api
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                      "temperature": None}).encode()
    from clawray.serve.protocol import parse_request

    req, fields = parse_request(raw)
    p = await _params(tiny_tokenizer, openai_chat.to_turn_request(req, fields), MODEL)
    assert p.temperature == 0.2
