"""The Trainer behind the policy gate (gate.enabled): each version it publishes is a candidate
(served as its own adapter, to its canary only); when the candidate is rejected the trainer
restarts from the incumbent's weights, drops the rows the abandoned version sampled, and its
versions continue after the abandoned ones."""

from __future__ import annotations

import time

import pytest
import ray

from clawray.config import ClawRayConfig
from tests.support.common import API_KEY
from tests.support.serving import DONE_SESSIONS_IDLE_S, chat_session, side_app

pytestmark = pytest.mark.ray
APP = "gated"


@pytest.fixture(scope="module")
def gated_app(served, tmp_path_factory):
    from ray import serve

    cfg = (ClawRayConfig()
           .inference(engine="hf", max_loras=4)
           .serving(api_keys=[API_KEY], record_sink=["hub", "jsonl"], default_max_tokens=8,
                    replica_num_cpus=0.5,
                    records_path=str(tmp_path_factory.mktemp("gated-records") / "r.jsonl"))
           .sessions(idle_timeout_s=DONE_SESSIONS_IDLE_S, feedback_window_s=0, flush_interval_s=0.1)
           .judge(num_voters=1, timeout_s=20)
           .buffer(path=str(tmp_path_factory.mktemp("gated-samples")), seal_age_s=0.1,
                   lease_s=60)
           .training(app=APP, lora_rank=4, lora_alpha=8, zero_stage=0, batch_size=32,
                     min_batch=1, take_timeout_s=3, lr=1e-3, learner_num_cpus=0.5,
                     sync_timeout_s=60, checkpoint_dir=str(tmp_path_factory.mktemp("ck")))
           .gate(enabled=True, dir=str(tmp_path_factory.mktemp("gate")), canary_share=1.0,
                 shadow_max_tokens=16))
    client = side_app(served, cfg, APP)
    yield cfg.check(), client
    serve.delete(APP)
    try:
        ray.kill(ray.get_actor(f"{APP}:gate", namespace="clawray"))
    except ValueError:
        pass


def _session(client) -> str:
    return chat_session(client, turns=2)


def _wait_rows(buffer, n: int) -> None:
    deadline = time.time() + 60
    while ray.get(buffer.stats.remote())["available"] < n:
        assert time.time() < deadline, ray.get(buffer.stats.remote())
        time.sleep(0.3)


def test_a_rejected_candidates_line_is_abandoned_and_training_restarts_from_the_incumbent(
        gated_app):
    from clawray.gate.actor import get_policy_gate
    from clawray.gate.core import adapter_name
    from clawray.records import read_jsonl_records
    from clawray.sessions.pipeline import attach_live_pipeline
    from clawray.training.trainer import Trainer
    from clawray.weights.control import get_app_control

    cfg, client = gated_app
    buffer = attach_live_pipeline(cfg, APP).buffer
    for _ in range(2):
        _session(client)
    _wait_rows(buffer, 4)
    trainer = Trainer(config=cfg.to_dict())
    gate = get_policy_gate(APP)
    try:
        r = trainer.train()
        assert r["gate"] == "candidate" and r["policy_version"] == 1
        deadline = time.time() + 120  # shadow evaluation on the built-in prompts
        while (st := ray.get(gate.status.remote()))["phase"] != "canary":
            assert st["phase"] == "shadow" and time.time() < deadline, st["events"][-3:]
            time.sleep(0.5)
        # canary_share 1.0: every session is now served by the candidate's adapter
        control = get_app_control(APP)  # every replica mirrors the routing before we ask
        # The gate's status says "canary" as soon as it decides, before it has pushed the
        # canary's routing to the control actor: wait for that table, then for the replicas.
        deadline = time.time() + 30
        while (ctl := ray.get(control.status.remote()))["routing"].get(
                "candidate_adapter") != adapter_name(1):
            assert time.time() < deadline, ctl["routing"]
            time.sleep(0.2)
        ray.get(control.wait_routing.remote(ctl["routing_seq"]))
        sid = _session(client)
        deadline = time.time() + 30  # the JSONL sink writes from a thread of its own
        while len(recs := [x for x in read_jsonl_records(cfg.serving_cfg.records_path)
                           if x.session_id == sid]) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(recs) == 2 and all(x.sampling["adapter"] == adapter_name(1) for x in recs)
        assert all(x.policy_version == 1 for x in recs)
        _wait_rows(buffer, 2)
        ev = ray.get(gate.reject.remote("test: the operator rejects it"))
        assert ev["event"] == "rejected" and ev["abandoned"] == [1]

        r = trainer.train()
        assert r["gate_restarted_from"] == 0  # the incumbent: the base model
        assert "optimizer_steps" not in r  # the rows version 1 sampled are dropped
        assert ray.get(buffer.stats.remote())["available"] == 0
        assert ray.get(gate.status.remote())["published"] == 1

        _session(client)  # served by the incumbent again
        _wait_rows(buffer, 2)
        r = trainer.train()
        assert r["gate"] == "candidate" and r["policy_version"] == 2
        st = ray.get(gate.status.remote())
        assert st["candidate"] == 2 and st["abandoned"] == [1] and st["line"] == 1
        # the operator's dashboard reads the gate's series (deployments/grafana/clawray.json)
        from tests.support.metrics import dashboard_series, wait_for_series

        gate_series = {s for s in dashboard_series() if s.startswith("ray_clawray_gate_")}
        assert gate_series and wait_for_series(gate_series) == set()
    finally:
        trainer.stop()
