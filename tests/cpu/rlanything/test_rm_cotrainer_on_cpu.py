"""RLAnything's reward model co-trained on the embedded tiny model.

The judge keeps the exact ids it sampled (``judge_samples``); rm rows built from them train the
RM learner (``RMCoTrainer``), whose weights reach the app's JudgeServer on the judge's own
channel while the policy's version stays where it was.
"""

from __future__ import annotations

import asyncio

import pytest
import ray

from clawray.config import ClawRayConfig
from clawray.serve.judge_server import JudgeCore
from clawray.judging.step_rm import build_step_rm_prompt
from clawray.rlanything.core import rm_consistency_rewards
from clawray.rlanything.rm_cotrainer import rm_rows, start_rm_cotrainer
from clawray.names import judge_channel
from clawray.weights.control import get_app_control

APP = "rmco"
PROMPT = build_step_rm_prompt("Put a clean mug in the cabinet.", [], "go to cabinet 1",
                              "You arrive at cabinet 1. The cabinet 1 is closed.")


def test_judge_samples_are_token_exact(tiny_model_path, tiny_tokenizer):
    async def run():
        core = JudgeCore(ClawRayConfig().inference(engine="hf").model(path=str(tiny_model_path)))
        try:
            samples = await core.judge_samples(PROMPT, 3, 0.8, 12)
            seeded = [await core.judge_samples(PROMPT, 3, 2.0, 12, seed=s) for s in (7, 7, 8)]
            texts = await core.judge(PROMPT, 2, 0.0, 12)
            greedy = await core.judge_samples(PROMPT, 2, 0.0, 12)
            rescored = [await core.engine.prompt_logprobs(s["prompt_ids"], s["token_ids"])
                        for s in samples]
            return core.template(PROMPT), samples, texts, greedy, rescored, seeded
        finally:
            await core.engine.shutdown()

    prompt_ids, samples, texts, greedy, rescored, seeded = asyncio.run(run())
    # A seed makes an evaluation's scorings reproducible; another seed samples others.
    ids = [[s["token_ids"] for s in call] for call in seeded]
    assert ids[0] == ids[1] and ids[0] != ids[2]
    assert len(samples) == 3
    for s, again in zip(samples, rescored):
        assert s["prompt_ids"] == prompt_ids
        assert tiny_tokenizer.decode(s["token_ids"], skip_special_tokens=True) == s["text"]
        assert len(s["logprobs"]) == len(s["token_ids"]) >= 1
        assert s["finish_reason"] in ("stop", "length") and s["policy_version"] == 0
        # The log-probs are those of the sampled ids under the judge's weights.
        assert max(abs(a - b) for a, b in zip(s["logprobs"], again)) < 1e-4
    assert texts == [s["text"] for s in greedy]  # judge() is judge_samples' texts


@pytest.mark.ray
def test_rm_cotrainer_trains_and_publishes_on_the_judge_channel(served, tmp_path):
    from ray import serve

    from clawray.serve.app import build_app

    cfg = (ClawRayConfig().inference(engine="hf")
           .serving(record_sink=["jsonl"], records_path=str(tmp_path / "turns.jsonl"),
                    replica_num_cpus=0.5, default_max_tokens=8)
           .training(mode="rlanything", app=APP, learner_num_cpus=1, sync_timeout_s=60)
           .rlanything(rm_backend="server", m=3, max_tokens=12, rm_lr=1e-3))
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    co = None
    try:
        judge = serve.get_deployment_handle("JudgeServer", app_name=APP)
        assert judge.status.remote().result(timeout_s=30)["version"] == 0
        samples = judge.judge_samples.remote(PROMPT, 3, 0.8, 12, seed=7).result(timeout_s=60)
        longest = max(samples, key=lambda s: len(s["token_ids"]))
        fixed = longest["token_ids"]
        before = judge.teacher_logprobs.remote(PROMPT, None, fixed).result(timeout_s=30)
        assert max(abs(a - b) for a, b in zip(before, longest["logprobs"])) < 1e-4

        # Step reward R = 1; scores +1, -1, unparseable → R·S = 1, -1, -2, standardized.
        advantages = rm_consistency_rewards(1.0, [1, -1, None])
        rows = rm_rows(samples, advantages, "task-0", 0, "traj-0")
        assert all(r["kind"] == "rm" and r["advantage"] != 0 for r in rows)

        co = start_rm_cotrainer(cfg, APP)
        assert ray.get(co.version.remote(), timeout=120) == 0
        start = ray.get(co.logprobs.remote(rows))
        metrics = ray.get(co.update.remote(rows), timeout=120)
        assert metrics["rm_rows"] == 3 and metrics["rm_optimizer_steps"] == 1
        assert metrics["rm_grad_norm"] > 0
        after = ray.get(co.logprobs.remote(rows))
        moved = [sum(b) - sum(a) for a, b in zip(start, after)]
        assert max(abs(m) for m in moved) > 1e-3

        info = ray.get(co.publish.remote(), timeout=120)
        assert info["published"] and info["version"] == 1 and info["bytes"] > 0
        status = judge.status.remote().result(timeout_s=30)
        assert status["version"] == 1 and status["weights_error"] is None
        served_now = judge.teacher_logprobs.remote(PROMPT, None, fixed).result(timeout_s=30)
        assert max(abs(a - b) for a, b in zip(served_now, before)) > 1e-3
        learner_now = after[samples.index(longest)]
        assert max(abs(a - b) for a, b in zip(served_now, learner_now)) < 1e-4
        assert ray.get(co.publish.remote())["published"] is False  # nothing new trained
        assert ray.get(co.save.remote(str(tmp_path / "rm")))["rm_version"] == 1
        restored = ray.get(co.load.remote(str(tmp_path / "rm")), timeout=120)
        assert restored["version"] == 1 and ray.get(co.version.remote()) == 1  # no republish

        # The channels do not mix: the policy app's replicas still serve version 0.
        policy = ray.get(get_app_control(APP).status.remote())
        assert policy["version"] == 0
        assert all(r["version"] == 0 for r in policy["replicas"].values() if r["weights"])
        rm = ray.get(get_app_control(judge_channel(APP)).status.remote())
        assert rm["version"] == 1 and rm["kind"] == "object_store"
    finally:
        if co is not None:
            ray.get(co.shutdown.remote())
            ray.kill(co)
        serve.delete(APP)
