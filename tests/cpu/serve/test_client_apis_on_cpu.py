"""The other front doors on the running app, driven by the official SDKs: ``POST /v1/messages``
with ``anthropic`` and ``POST /v1/responses`` with ``openai`` — answers, streams, tool use,
server-side conversation state and errors in each API's format, and each turn recorded
token-exactly into the same kind of session as Chat Completions'. On both engines."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.support.common import OTHER_KEY

pytestmark = pytest.mark.ray

TOOLS = [{"name": "ls", "description": "List files in a directory.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}}]


@pytest.fixture(scope="module", params=["hf", "vllm"])
def served(request):
    """Each engine's app in turn (this module's tests hold on both)."""
    return request.getfixturevalue(f"served_{request.param}")


@pytest.fixture(scope="module")
def client(served):
    return anthropic.Anthropic(base_url=served.base_url.removesuffix("/v1"),
                               api_key=served.api_key, max_retries=0)


def _template_ids(tok, messages, tools=None):
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_a_message_is_answered_and_recorded_token_exactly(client, served, tiny_tokenizer):
    m = client.messages.create(model=served.model, max_tokens=16,
                               system="You are terse.",
                               messages=[{"role": "user", "content": "What is 2+2?"}],
                               extra_headers={"X-Session-Id": "anthropic-1"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens")
    [rec] = served.records(session_id="anthropic-1")
    assert rec.record_id == m.id
    assert rec.prompt_ids == _template_ids(tiny_tokenizer, [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"}])
    assert m.usage.output_tokens == len(rec.response_ids)
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == len(rec.prompt_ids)
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == (rec.response_text or "")


def test_a_streamed_message_matches_its_record(client, served):
    with client.messages.stream(model=served.model, max_tokens=24,
                                messages=[{"role": "user", "content": "Tell me a story."}],
                                extra_headers={"X-Session-Id": "anthropic-2"}) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    [rec] = served.records(session_id="anthropic-2")
    assert "".join(pieces) == "".join(b.text for b in final.content if b.type == "text")
    assert final.usage.output_tokens == len(rec.response_ids)
    assert final.id == rec.record_id


def test_tool_results_continue_the_same_session(client, served):
    """A tool_use turn and its tool_result follow-up are one session, as with Chat Completions."""
    first = [{"role": "user", "content": "List /tmp please."}]
    client.messages.create(model=served.model, max_tokens=8, tools=TOOLS, messages=first,
                           metadata={"user_id": "anthropic-user"})
    follow = first + [
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_9", "name": "ls", "input": {"path": "/tmp"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "a.txt b.txt"}]}]
    client.messages.create(model=served.model, max_tokens=8, tools=TOOLS, messages=follow,
                           metadata={"user_id": "anthropic-user"})
    recs = served.records(expected=2, user="anthropic-user")
    assert len(recs) == 2 and recs[0].session_id == recs[1].session_id
    assert recs[1].messages[-1] == {"role": "tool", "tool_call_id": "toolu_9",
                                    "content": "a.txt b.txt"}


def test_errors_come_in_anthropics_shape(client, served):
    bad = anthropic.Anthropic(base_url=served.base_url.removesuffix("/v1"), api_key="wrong",
                              max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=served.model, max_tokens=4,
                            messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=served.model, max_tokens=4, extra_body={"top_k": 3},
                               messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "top_k" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4,
                               messages=[{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------- the Responses API
RESPONSE_TOOLS = [{"type": "function", "name": "ls", "description": "List files in a directory.",
                   "parameters": TOOLS[0]["input_schema"]}]


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served.base_url, api_key=served.api_key, max_retries=0)


def test_a_response_is_answered_recorded_and_kept(oai, served, tiny_tokenizer):
    r = oai.responses.create(model=served.model, instructions="You are terse.",
                             input="What is 2+2?", max_output_tokens=16, temperature=0,
                             extra_headers={"X-Session-Id": "responses-1"})
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    [rec] = served.records(session_id="responses-1")
    assert rec.record_id == r.id
    assert rec.prompt_ids == _template_ids(tiny_tokenizer, [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"}])
    assert r.usage.output_tokens == len(rec.response_ids)
    assert r.usage.input_tokens == len(rec.prompt_ids)
    assert r.output_text == (rec.response_text or "")
    assert oai.responses.retrieve(r.id).id == r.id


def test_previous_response_id_continues_the_conversation_and_its_session(oai, served):
    first = oai.responses.create(model=served.model, input="Hello there.", max_output_tokens=8,
                                 extra_headers={"X-Session-Id": "responses-chain"})
    second = oai.responses.create(model=served.model, input="And then?", max_output_tokens=8,
                                  previous_response_id=first.id)
    recs = served.records(expected=2, session_id="responses-chain")
    assert [r.record_id for r in recs] == [first.id, second.id]
    assert recs[1].messages[0] == {"role": "user", "content": "Hello there."}
    assert recs[1].messages[-1] == {"role": "user", "content": "And then?"}
    assert second.previous_response_id == first.id
    # another key cannot continue it, nor read it
    other = openai.OpenAI(base_url=served.base_url, api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        other.responses.create(model=served.model, input="x", max_output_tokens=4,
                               previous_response_id=first.id)
    assert e.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    oai.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(second.id)


def test_a_streamed_response_matches_its_record(oai, served):
    with oai.responses.stream(model=served.model, input="Tell me a story.",
                              max_output_tokens=24, temperature=0, tools=RESPONSE_TOOLS,
                              extra_headers={"X-Session-Id": "responses-2"}) as s:
        kinds = [ev.type for ev in s]
        final = s.get_final_response()
    [rec] = served.records(session_id="responses-2")
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert final.id == rec.record_id and final.usage.output_tokens == len(rec.response_ids)
    assert final.output_text == (rec.response_text or "")


def test_response_errors_come_in_openais_shape(oai, served):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=served.model, input="hi", reasoning={"effort": "high"})
    assert e.value.body["param"] == "reasoning"
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="no-such-model", input="hi")


def test_plain_completions_whole_and_streamed(oai, served, tiny_tokenizer):
    done = oai.completions.create(model=served.model, prompt=["Once upon a time", "The end"],
                                  max_tokens=8, temperature=0, logprobs=2,
                                  extra_headers={"X-Session-Id": "completions-1"})
    assert done.object == "text_completion" and [c.index for c in done.choices] == [0, 1]
    recs = served.records(expected=2, session_id="completions-1")
    by_prompt = {tuple(r.prompt_ids): r for r in recs}
    rec = by_prompt[tuple(tiny_tokenizer.encode("Once upon a time", add_special_tokens=False))]
    assert rec.turn_type == "side"
    assert done.choices[0].logprobs.token_logprobs == pytest.approx(rec.response_logprobs,
                                                                    abs=1e-4)
    stream = oai.completions.create(model=served.model, prompt="Once upon a time", max_tokens=8,
                                    temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == done.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=served.model, prompt="x", suffix="y")
    assert e.value.body["param"] == "suffix"
