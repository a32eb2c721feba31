"""Per-user policies through the running app (the transformers engine): a user's adapter,
published on the app's control channel, serves that user's requests and only theirs; a key
that is not a trusted app cannot reach it by naming the user; deleting it returns the user to
the shared policy. Greedy ids are checked against the adapter merged into its own copy of the
model. ``model: "<model>:<user>"`` addresses the same adapter, for the caller's own user
only."""

from __future__ import annotations

import openai
import ray
import pytest
import torch

from tests.support.common import OTHER_KEY
from tests.support.lora import merged, random_lora, reference_greedy

pytestmark = pytest.mark.ray
PROMPT = "Tell me about trees."


def test_a_users_adapter_serves_that_user_only(served, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from clawray.serve.auth import tenant_of_key
    from clawray.weights.publisher import WeightPublisher

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    payload = random_lora(base, 7, scale=0.3)
    ann = f"{tenant_of_key(served.api_key)}/ann"
    publisher = WeightPublisher(served.app_name, lora=False, timeout_s=60)
    done = publisher.publish_adapter(ann, payload, version=1)
    assert done["replicas"] and set(done["replicas"].values()) == {1}
    assert publisher.status()["adapters"] == {ann: 1}

    def ask(key: str, user: str | None, marker: str, model: str = served.model):
        client = openai.OpenAI(base_url=served.base_url, api_key=key, max_retries=0)
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"{PROMPT} {marker}"}],
            max_tokens=8, temperature=0.0, extra_headers={"X-Session-Id": marker},
            **({"user": user} if user else {}))
        assert r.model == model
        [rec] = served.records(session_id=marker)
        return rec

    try:
        recs = {"ann": ask(served.api_key, "ann", "pu-ann"),
                "bob": ask(served.api_key, "bob", "pu-bob"),
                # OTHER_KEY is not a trusted app: naming "ann" does not reach her policy
                "other": ask(OTHER_KEY, "ann", "pu-other")}
        assert recs["ann"].sampling["adapter"] == ann and recs["ann"].policy_user == ann
        assert recs["bob"].sampling["adapter"] is None
        assert recs["other"].sampling["adapter"] is None
        assert recs["other"].policy_user == tenant_of_key(OTHER_KEY)
        tuned = merged(base, payload)
        for name, model in (("ann", tuned), ("bob", base), ("other", base)):
            r = recs[name]
            assert r.response_ids == reference_greedy(model, r.prompt_ids, len(r.response_ids)), name
        assert recs["ann"].policy_version == 1  # the adapter's version
        # Ray Serve LLM's naming: "<model>:<user>", the caller's own user only
        named = ask(served.api_key, None, "pu-ann-named", f"{served.model}:ann")
        assert named.sampling["adapter"] == ann and named.response_ids == reference_greedy(
            tuned, named.prompt_ids, len(named.response_ids))
        with pytest.raises(openai.PermissionDeniedError, match="only its own policy"):
            ask(OTHER_KEY, None, "pu-other-named", f"{served.model}:ann")
    finally:
        assert publisher.delete_adapter(ann)
    assert publisher.status()["adapters"] == {}
    again = ask(served.api_key, "ann", "pu-ann-after")
    assert again.sampling["adapter"] is None


def test_the_split_layout_serves_a_users_adapter_from_every_policy_replica(
        served, tiny_model_path, tmp_path_factory):
    """Split layout (an ingress in front of two PolicyServer replicas): the ingress cannot see
    the replicas' adapters, names the user's adapter with a fallback; every replica loads the
    published adapter, so the user's requests are served by it whichever replica takes them,
    another user's by the base; and the policy gate's routing reaches the ingress."""
    from ray import serve
    from transformers import AutoModelForCausalLM

    from clawray.config import ClawRayConfig
    from clawray.serve.auth import tenant_of_key
    from clawray.weights.control import start_app_control
    from clawray.weights.publisher import WeightPublisher
    from tests.support.common import Served
    from tests.support.serving import side_app

    app = "split-adapters"
    records = tmp_path_factory.mktemp(app) / "turns.jsonl"
    cfg = (ClawRayConfig()
           .inference(engine="hf", max_loras=4)
           .serving(api_keys=[served.api_key], record_sink=["jsonl"], records_path=str(records),
                    layout="split", policy_replicas=2, replica_num_cpus=0.5,
                    trusted_app_tenants=[tenant_of_key(served.api_key)]))
    client = side_app(served, cfg, app)
    split = Served(served.base_url, served.api_key, served.model, records, app)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()
    payload = random_lora(base, 11, scale=0.3)
    ann = f"{tenant_of_key(served.api_key)}/ann"
    publisher = WeightPublisher(app, lora=False, timeout_s=90)
    control = start_app_control(app)
    try:
        done = publisher.publish_adapter(ann, payload, version=3, min_replicas=2)
        assert len(done["replicas"]) == 2 and set(done["replicas"].values()) == {3}
        tuned = merged(base, payload)

        def ask(user: str, sid: str):
            client.chat.completions.create(
                model=served.model, messages=[{"role": "user", "content": f"{PROMPT} {sid}"}],
                max_tokens=8, temperature=0.0, user=user, extra_headers={"X-Session-Id": sid})
            [rec] = split.records(session_id=sid)
            return rec

        for i in range(4):  # sessions spread over both replicas (session affinity)
            rec = ask("ann", f"split-ann-{i}")
            assert rec.sampling["adapter"] == ann and rec.policy_version == 3
            assert rec.response_ids == reference_greedy(tuned, rec.prompt_ids,
                                                        len(rec.response_ids))
        rec = ask("bob", "split-bob")  # no adapter: the replica falls back to the base
        assert rec.sampling["adapter"] is None
        assert rec.response_ids == reference_greedy(base, rec.prompt_ids, len(rec.response_ids))
        # the gate's routing table reaches the split ingress (its own mirror of the channel)
        routing = {"incumbent": 3, "incumbent_adapter": ann, "candidate": None,
                   "candidate_adapter": None, "share": 0.0, "salt": ""}
        seq = ray.get(control.set_routing.remote(routing))
        ray.get(control.wait_routing.remote(seq, 30.0))
        rec = ask("bob", "split-bob-routed")
        assert rec.sampling["adapter"] == ann and rec.policy_version == 3
    finally:
        ray.get(control.set_routing.remote(None))
        serve.delete(app)
