"""ChatService records a completion that spans a weight swap exactly, streamed or not: the
version it started on, the version it ended on, and the version of every token."""

from __future__ import annotations

import pytest

from clawray.config import ServingConfig
from clawray.inference.engine import TokenDelta, TokenOutput
from clawray.serve.chat import ChatService
from clawray.serve.openai_chat import complete, stream, to_turn_request
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
    return await svc.prepare(to_turn_request(req, {}), {"x-session-id": "swap-1"})


async def test_a_json_completion_records_every_tokens_version(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer)
    body = await complete(svc, await prepared(svc, stream=False))
    [rec] = sink.records
    assert (rec.policy_version, rec.policy_version_end) == (3, 4)
    assert rec.response_ids == IDS and rec.response_versions == VERSIONS
    assert body["system_fingerprint"] == "clawray-policy-v4"


async def test_a_streamed_completion_keeps_its_end_version(tiny_tokenizer):
    svc, sink = service(tiny_tokenizer)
    lines = [line async for line in stream(svc, await prepared(svc, stream=True))]
    assert lines[-1] == "data: [DONE]\n\n"
    [rec] = sink.records
    assert (rec.policy_version, rec.policy_version_end) == (3, 4)
    assert rec.response_ids == IDS and rec.response_versions == VERSIONS


class LogprobPolicy:
    """Four tokens, each with its log-prob and two alternatives."""

    TOP = [[(40, -0.5), (7, -1.5)], [(41, -0.4), (8, -2.0)], [(9, -0.1), (42, -2.5)],
           [(43, -0.3), (10, -1.9)]]

    async def generate(self, prompt_ids, params, session_key=None):
        assert params.top_logprobs == 2
        return [TokenOutput(list(IDS), [-0.5, -0.4, -2.5, -0.3], "length", 3,
                            top_logprobs=self.TOP)]

    async def stream(self, prompt_ids, params, session_key=None):
        lps = [-0.5, -0.4, -2.5, -0.3]
        for i, tok in enumerate(IDS):
            last = i == len(IDS) - 1
            yield TokenDelta([tok], [lps[i]], 3, "length" if last else None,
                             top_logprobs=[self.TOP[i]])

    async def status(self):
        raise NotImplementedError


async def test_logprobs_are_the_records_exactly_whole_and_streamed(tiny_tokenizer):
    import json

    sink = ListSink()
    svc = ChatService(tiny_tokenizer, LogprobPolicy(), "m", 4096, ServingConfig(), sink)
    for stream_it in (False, True):
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4, stream=stream_it, logprobs=True,
                                    top_logprobs=2)
        turn = await svc.prepare(to_turn_request(req, {}), {"x-session-id": "lp"})
        if stream_it:
            lines = [x async for x in stream(svc, turn)]
            content = [e for x in lines[:-1]
                       for e in (json.loads(x[6:])["choices"][0]["logprobs"] or {})
                       .get("content", [])]
        else:
            content = (await complete(svc, turn))["choices"][0]["logprobs"]["content"]
        rec = sink.records[-1]
        assert [e["logprob"] for e in content] == rec.response_logprobs
        assert [e["token"] for e in content] == [tiny_tokenizer.decode([t]) for t in IDS]
        assert [[a["logprob"] for a in e["top_logprobs"]] for e in content] == \
            [[v for _, v in top] for top in LogprobPolicy.TOP]
        assert all(e["bytes"] == list(e["token"].encode()) for e in content)


async def test_the_record_names_whose_policy_served_it(tiny_tokenizer):
    """A trusted app's end user, or else the key (tenant): per-user policies train from it."""
    from clawray.serve.auth import tenant_of_key

    app, other = tenant_of_key("sk-app"), tenant_of_key("sk-other")
    sink = ListSink()
    svc = ChatService(tiny_tokenizer, SwappingPolicy(), "m", 4096,
                      ServingConfig(trusted_app_tenants=[app]), sink)
    for tenant in (app, other):
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4)
        await complete(svc, await svc.prepare(to_turn_request(req, {"user": "ann"}),
                                              {"x-session-id": "s"}, tenant))
    assert [(r.tenant, r.user, r.policy_user) for r in sink.records] == [
        (app, "ann", f"{app}/ann"), (other, "ann", other)]


class AdapterPolicy(SwappingPolicy):
    """A policy whose engine serves one user's adapter; it remembers each request's params."""

    def __init__(self, adapters):
        self._adapters, self.params = adapters, []

    def adapters(self):
        return self._adapters

    async def generate(self, prompt_ids, params, session_key=None):
        self.params.append(params)
        return await super().generate(prompt_ids, params, session_key)


async def test_a_user_with_an_adapter_is_served_by_it_and_others_by_the_base(tiny_tokenizer):
    from clawray.serve.auth import tenant_of_key

    app = tenant_of_key("sk-app")
    policy = AdapterPolicy({f"{app}/ann": 4})
    sink = ListSink()
    svc = ChatService(tiny_tokenizer, policy, "m", 4096,
                      ServingConfig(trusted_app_tenants=[app]), sink)
    for user in ("ann", "bob"):
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4)
        await complete(svc, await svc.prepare(to_turn_request(req, {"user": user}),
                                              {"x-session-id": user}, app))
    assert [p.adapter for p in policy.params] == [f"{app}/ann", None]
    # the record says which adapter sampled the turn
    assert [r.sampling["adapter"] for r in sink.records] == [f"{app}/ann", None]


async def test_a_client_may_address_its_own_users_policy_as_model_colon_user(tiny_tokenizer):
    """``model: "<served>:<user>"`` (Ray Serve LLM's adapter naming): a trusted app names one
    of its end users, any other key only its own tenant id; anything else is refused in the
    API's error format, and the response echoes the model as asked."""
    from clawray.serve.auth import tenant_of_key
    from clawray.serve.protocol import APIError

    app, other = tenant_of_key("sk-app"), tenant_of_key("sk-other")
    policy = AdapterPolicy({f"{app}/ann": 4, other: 2})
    sink = ListSink()
    svc = ChatService(tiny_tokenizer, policy, "m", 4096,
                      ServingConfig(trusted_app_tenants=[app]), sink)

    async def ask(model, tenant, fields=None):
        req = ChatCompletionRequest(model=model, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4)
        return await complete(svc, await svc.prepare(to_turn_request(req, fields or {}),
                                                     {"x-session-id": "s"}, tenant))

    body = await ask("m:ann", app)
    assert body["model"] == "m:ann" and policy.params[-1].adapter == f"{app}/ann"
    assert (sink.records[-1].user, sink.records[-1].policy_user) == ("ann", f"{app}/ann")
    await ask("m:bob", app)  # an end user without an adapter yet: the shared policy
    assert policy.params[-1].adapter is None and sink.records[-1].policy_user == f"{app}/bob"
    await ask(f"m:{other}", other)  # a plain key addresses its own policy by its tenant id
    assert policy.params[-1].adapter == other
    served = len(policy.params)
    for model, tenant, fields, status in (
            ("m:ann", other, None, 403),  # a plain key cannot reach an app's end user
            (f"m:{app}/ann", other, None, 403),
            (f"m:{other}", app, {"user": "ann"}, 400),  # model and user disagree
            ("m:", app, None, 404), ("n:ann", app, None, 404), ("other", app, None, 404),
            ("m:" + "x" * 501, app, None, 400)):
        with pytest.raises(APIError) as e:
            await ask(model, tenant, fields)
        assert e.value.status == status and e.value.param == "model", (model, e.value.message)
    assert len(policy.params) == served  # nothing refused reached the engine
