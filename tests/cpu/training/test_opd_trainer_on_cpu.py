"""OPD and Combine through the live app, end to end: a user corrects a reply, the judge writes
a hint from the correction (the rule judge, ``judge.teacher: server``), the app's JudgeServer
scores the reply's sampled ids under the hinted prompt (the teacher log-probs), the hub writes
``opd`` and ``combine`` rows, and the Trainer's learner trains on them and publishes a version
the replica serves."""

from __future__ import annotations

import math
import uuid

import pytest
import torch

from clawray.config import ClawRayConfig
from clawray.judging.opd import inject_hint
from tests.support.common import API_KEY, Served
from tests.support.serving import DONE_SESSIONS_IDLE_S, side_app

pytestmark = pytest.mark.ray
APP = "opd"
SYS = {"role": "system", "content": "You are an agent."}
ASK = {"role": "user", "content": "List the files in the current folder."}
CORRECTION = "That's wrong, use the ls tool on the current folder and show me the names."


@pytest.fixture(scope="module")
def opd_app(served, tmp_path_factory):
    from ray import serve

    cfg = (ClawRayConfig()
           .inference(engine="hf")
           .serving(api_keys=[API_KEY], record_sink=["hub"], default_max_tokens=12,
                    replica_num_cpus=0.5)
           .sessions(idle_timeout_s=DONE_SESSIONS_IDLE_S, feedback_window_s=0, flush_interval_s=0.1,
                     sample_kinds=["opd", "combine"])
           .judge(teacher="server", num_voters=1, timeout_s=60)
           .buffer(path=str(tmp_path_factory.mktemp("opd-samples")), seal_age_s=0.1,
                   lease_s=60)
           .training(app=APP, lora_rank=4, lora_alpha=8, zero_stage=0, batch_size=32,
                     min_batch=1, take_timeout_s=3, lr=1e-3, learner_num_cpus=0.5,
                     sync_timeout_s=60, checkpoint_dir=str(tmp_path_factory.mktemp("opd-ck"))))
    client = side_app(served, cfg, APP)
    port = served.base_url.split(":")[2].split("/")[0]
    yield (cfg.check(), client,
           Served(f"http://127.0.0.1:{port}/{APP}/v1", API_KEY, "clawray-tiny", None, APP,
                  cfg.buffer_cfg.path, cfg))
    serve.delete(APP)


def _teacher_reference(model_path, messages, hint, response_ids) -> list[float]:
    """Log-probs of ``response_ids`` after the hinted prompt, computed here with transformers
    (the JudgeServer serves the policy model's starting weights)."""
    from transformers import AutoModelForCausalLM

    from clawray.models.loader import load_tokenizer

    tok = load_tokenizer(model_path)
    text = tok.apply_chat_template(inject_hint(messages, hint), add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(
        1, torch.tensor(response_ids)[:, None])[:, 0].tolist()


def test_a_corrected_turn_trains_through_opd_and_combine(opd_app, tiny_model_path):
    from clawray.training.trainer import Trainer

    cfg, client, app = opd_app
    sid = f"s-{uuid.uuid4().hex[:10]}"
    msgs = [SYS, ASK]
    # seeded, and 12 tokens whatever the model samples: the checks below never meet a
    # one-token reply
    first = client.chat.completions.create(model="clawray-tiny", messages=msgs, seed=3,
                                           max_tokens=12, extra_body={"ignore_eos": True},
                                           extra_headers={"X-Session-Id": sid})
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": CORRECTION}]
    client.chat.completions.create(model="clawray-tiny", messages=msgs,
                                   extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"})

    rows = app.samples(expected=2, timeout_s=60, session_id=sid, turn=1)
    by_kind = {r["kind"]: r for r in rows}
    assert set(by_kind) == {"opd", "combine"}, [(r["kind"], r["turn"]) for r in rows]
    opd, comb = by_kind["opd"], by_kind["combine"]
    # The rule judge took the user's correction as the hint and judged the turn -1.
    assert CORRECTION in opd["hint"] and opd["hint"] == comb["hint"]
    assert comb["reward"] == -1.0 and comb["votes"] == [-1, -1, -1]
    # The teacher scored exactly the sampled ids under the hinted prompt.
    response = opd["response_ids"]
    teacher = opd["teacher_logprobs"]
    assert len(teacher) == len(response) and comb["teacher_logprobs"] == teacher
    assert all(math.isfinite(x) and x <= 0 for x in teacher)
    reference = _teacher_reference(tiny_model_path, [SYS, ASK], opd["hint"], response)
    assert max(abs(a - b) for a, b in zip(teacher, reference)) < 2e-3
    # The hint changes what the teacher expects: OPD's advantage is not zero everywhere.
    advantage = [t - s for t, s in zip(teacher, opd["rollout_logprobs"])]
    assert max(abs(a) for a in advantage) > 1e-2

    trainer = Trainer(config=cfg.to_dict())
    try:
        r = trainer.train()
        assert r["samples_opd"] >= 1 and r["samples_combine"] >= 1, r
        assert r["optimizer_steps"] >= 1 and r["policy_version"] == 1
        assert app.handle().weights_version.remote().result(timeout_s=30)["replica"] == 1
        again = client.chat.completions.create(model="clawray-tiny", messages=[SYS, ASK],
                                               max_tokens=4)
        assert again.system_fingerprint == "clawray-policy-v1"
    finally:
        trainer.stop()
