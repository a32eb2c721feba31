"""The policy gate on the running app (transformers engine): a degenerate candidate is rejected
at shadow evaluation before any user sees it; a healthy one is canaried on a sticky share of
sessions (its adapter serves them, the incumbent the rest), promoted on its canary evidence,
then rolled back to the base by the operator without any trainer; every decision is in the
log."""

from __future__ import annotations

import json
import time

import openai
import pytest
import ray
import torch

from tests.support.lora import random_lora

pytestmark = pytest.mark.ray


def wait_for(fn, what: str, timeout_s: float = 120.0):
    deadline = time.time() + timeout_s
    while True:
        value = fn()
        if value:
            return value
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_the_gate_rejects_canaries_promotes_and_rolls_back(served, tiny_model_path, tmp_path,
                                                          capsys):
    from transformers import AutoModelForCausalLM

    from clawray.config import GateConfig
    from clawray.apps.cli import main
    from clawray.gate.actor import start_policy_gate
    from clawray.gate.core import adapter_name, canary_bucket, merge_serving
    from clawray.weights.control import start_app_control

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32)
    cfg = GateConfig(dir=str(tmp_path), canary_share=0.5, canary_min_turns=4, canary_looks=1,
                     canary_margin=0.5, shadow_max_tokens=24)
    gate = start_policy_gate(served.app_name, cfg)
    control = start_app_control(served.app_name)
    client = openai.OpenAI(base_url=served.base_url, api_key=served.api_key, max_retries=0)

    def status():
        return ray.get(gate.status.remote())

    def ask(session: str) -> object:
        client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": f"Hello! {session}"}],
            max_tokens=4, temperature=0.0, extra_headers={"X-Session-Id": session})
        return served.records(session_id=session)[-1]

    try:
        # 1. a candidate that talks gibberish never reaches a user
        bad = random_lora(base, 1, scale=1.0)
        assert ray.get(gate.propose.remote(1, [ray.put(bad)]))["event"] == "candidate"
        st = wait_for(lambda: (s := status())["phase"] is None and s, "the shadow verdict")
        last = st["events"][-1]
        assert last["event"] == "rejected" and "readable replies" in last["reason"], last
        shadow = last["evidence"]
        assert shadow["n"] == 10 and shadow["candidate_health"]["readable_rate"] < 0.8
        assert shadow["incumbent_health"]["readable_rate"] == 1.0  # the base, same prompts
        assert st["abandoned"] == [1] and st["line"] == 1 and st["incumbent"] == 0
        # the gate drops the rejected adapter right after its verdict (the status can be read
        # between the two: the gate actor answers while it awaits the control actor)
        wait_for(lambda: adapter_name(1) not in ray.get(control.status.remote())["adapters"],
                 "the rejected candidate's adapter to leave the replicas", timeout_s=30)

        # 2. a healthy candidate passes shadow evaluation and serves its canary only
        good = random_lora(base, 2, scale=0.01)
        ray.get(gate.propose.remote(2, [ray.put(good)]))
        st = wait_for(lambda: (s := status())["phase"] == "canary" and s, "the canary")
        routing = st["routing"]
        assert routing["candidate_adapter"] == adapter_name(2) and routing["share"] == 0.5
        ray.get(control.wait_routing.remote(ray.get(control.status.remote())["routing_seq"]))
        sessions = [f"gate-s{i}" for i in range(12)]
        first = {s: ask(s) for s in sessions}
        again = {s: ask(s) for s in sessions}
        arms = {s: r.sampling["adapter"] for s, r in first.items()}
        assert set(arms.values()) == {adapter_name(2), None}  # both sides serve
        assert all(again[s].sampling["adapter"] == arms[s] for s in sessions)  # sticky
        for s, r in first.items():  # the replica routes as the gate's rule says
            in_canary = canary_bucket(r.session_key(), routing["salt"]) < routing["share"]
            assert (arms[s] == adapter_name(2)) == in_canary, s
            assert r.policy_version == (2 if in_canary else 0)
        # the replicas report what each side served (requests, errors, seconds per token)
        n_c = 2 * sum(a == adapter_name(2) for a in arms.values())

        def tally():
            m = merge_serving(ray.get(control.serving_reports.remote()), routing["salt"])
            return m["candidate"]["requests"] + m["incumbent"]["requests"] >= 24 and m
        m = wait_for(tally, "the replicas' serving reports")
        assert (m["candidate"]["requests"], m["incumbent"]["requests"]) == (n_c, 24 - n_c)
        assert m["candidate"]["errors"] == 0 and m["candidate"]["timed"] == n_c

        # 3. the canary's judged turns promote it; everyone is then served by it
        events = ray.get(gate.observe.remote([(2, 1.0, None)] * 4 + [(0, 1.0, None)] * 4))
        assert [e["event"] for e in events] == ["promoted"]
        assert events[0]["evidence"]["candidate"]["serving"]["requests"] == n_c
        st = status()
        assert st["incumbent"] == 2 and st["candidate"] is None
        ray.get(control.wait_routing.remote(ray.get(control.status.remote())["routing_seq"]))
        assert all(ask(f"gate-after-{i}").sampling["adapter"] == adapter_name(2)
                   for i in range(3))

        # 4. the operator rolls back to the base (`clawray gate`, through Ray): immediate, no
        # trainer involved
        capsys.readouterr()
        assert main(["gate", "rollback", "0", "--app", served.app_name]) == 0
        ev = json.loads(capsys.readouterr().out)
        assert ev["event"] == "rolled_back" and ev["replicas"]
        assert ask("gate-rolled-back").sampling["adapter"] is None
        assert main(["gate", "status", "--app", served.app_name]) == 0
        st = json.loads(capsys.readouterr().out)
        assert st["incumbent"] == 0 and st["abandoned"] == [1, 2] and st["line"] == 2

        # 5. every decision is in the log, in order
        log = [json.loads(line) for line in
               (tmp_path / served.app_name / "decisions.jsonl").read_text().splitlines()]
        assert [e["event"] for e in log] == ["candidate", "rejected", "candidate", "canary",
                                             "promoted", "rolled_back"]
        assert log[-1]["reason"].startswith("operator (")  # who did it
        assert [e["seq"] for e in log] == list(range(1, 7))
    finally:
        ray.get(control.set_routing.remote(None))
        for v in (1, 2):
            ray.get(control.delete_adapter.remote(adapter_name(v)))
        ray.kill(gate)
