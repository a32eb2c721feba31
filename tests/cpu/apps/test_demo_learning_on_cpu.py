"""Seeded end-to-end learning on CPU: simulated users who want brief replies chat with the
embedded model through the HTTP API while the trainer learns from their judged turns; the
satisfaction rate on a fixed HELD-OUT evaluation set (side turns, seeded sampling, the "test"
prompt pool: templates and words no training user sends) must rise well beyond run-to-run
noise. The same code path as ``clawray demo`` (``clawray.apps.demo.run_learning``), with the
heuristic rule judge and users who speak its keywords (``BriefReplies(phrasing="keywords")``):
this checks the loop's mechanics (users, judge, samples, updates, sync, evaluation), not that
the model learns from what users say: the shuffled-feedback control of ``clawray demo
--controls`` rose nearly as much over five seeds (docs/training.md, "Controls").

Lockstep (``run_learning(lockstep=True)``, ``clawray demo --lockstep``): each iteration the
eight users play one session each, the trainer trains on exactly those turns and syncs, and
the next round is served by the new version. What the users send, which rows form a batch and
which version serves each request no longer depend on the machine's speed, so the outcome is
repeatable for the seed: at 40 iterations two runs here on 2026-12-05 rose 0.37 -> 0.79 and
0.37 -> 0.80 (~107 s each); at 25, 0.37 -> 0.73 (81 s, beside a one-thread SFT); at 15, the
test's since 2026-12-06, 0.35 -> 0.62 (the whole pytest run 103 s with its cluster, idle
machine). The live setting (users chatting while the trainer runs, the demo's default) is
not: request timing decided which samples formed a batch, and its CI runs at seed 0 rose
0.35 -> 0.84, 0.80, 0.49 and, next to a busy build, 0.38 -> 0.43.

Margin: the evaluation set has 150 requests, so one rate's binomial standard error is at most
0.041 and a difference of two rates' about 0.058; the test asks for a rise of at least 0.10
(1.7 of those) from a base rate measured in the same run.
Served by the transformers engine: on vLLM (``clawray demo``'s default where it is installed)
the live test rose 0.29 -> 0.72 at seed 0 but took 163-260 s, and the suite's 30 minutes do
not allow it; tests/cpu/training/test_trainer_on_cpu.py trains into vLLM.
"""

from __future__ import annotations

import pytest

from clawray.config import ClawRayConfig
from tests.support.common import API_KEY

pytestmark = pytest.mark.ray
APP = "learn"
MARGIN = 0.10  # see the docstring: 0.15 failed one CI run of a loop that learned
EVAL_N = 150  # as the demo; one rate's binomial standard error at most 0.041
ITERATIONS = 15  # lockstep rounds: +0.27 here; 25 rose to 0.73, 40 (the demo's) to 0.79-0.80
ENGINE = "hf"


def test_live_users_satisfaction_rises_with_training(served, tmp_path):
    from ray import serve

    from clawray.apps.demo import demo_config, run_learning
    from clawray.serve.app import build_app

    cfg = demo_config(ClawRayConfig().serving(api_keys=[API_KEY]), tmp_path, seed=0) \
        .training(app=APP, learner_num_cpus=0.5).inference(engine=ENGINE, kv_cache_gib=0.25)
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    port = served.base_url.split(":")[2].split("/")[0]
    lines: list[str] = []
    try:
        summary = run_learning(cfg, f"http://127.0.0.1:{port}/{APP}/v1", API_KEY, served.model,
                               tmp_path, iterations=ITERATIONS, users=8, eval_n=EVAL_N, seed=0,
                               lockstep=True,
                               log=lines.append)
    finally:
        serve.delete(APP)
    before, after = summary["before"]["rate"], summary["after"]["rate"]
    print(f"[{ENGINE}] satisfaction {before:.2f} -> {after:.2f} over {ITERATIONS} iterations")
    assert 0.2 <= before <= 0.6, summary["before"]  # the preference's base rate
    assert after >= before + MARGIN, "\n".join(lines)
    assert summary["user_errors"] == 0 and summary["eval_errors"] == 0
    assert summary["eval_pool"] == "test" and summary["users_phrasing"] == "keywords"
    assert max(summary["after"]["policy_versions"]) == ITERATIONS
    # The keyword judge answers at once: every judgeable turn is judged, no call times out.
    judging = summary["judging"]
    assert judging["judged"] > 0 and judging["unjudged"] == 0, judging
    # only each session's closing turn has no next state: every other turn reached its judge
    assert judging["no_next_state"] == 8 * ITERATIONS, judging
    assert judging["judge_controls"] == ["none"], judging  # what the app's voters ran
    assert judging["judge_timeouts"] == 0 and judging["judge_calls"] >= judging["judged"], judging
    assert (tmp_path / "progress.png").stat().st_size > 10_000
    # the run's curves, read back by TensorBoard's own reader: one point per iteration
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run,) = (tmp_path / "tensorboard").iterdir()
    curves = EventAccumulator(str(run))
    curves.Reload()
    versions = curves.Scalars("policy_version")
    assert [e.step for e in versions] == list(range(1, ITERATIONS + 1))
    assert versions[-1].value == ITERATIONS
    assert len(curves.Scalars("loss")) == ITERATIONS and "config/text_summary" in \
        curves.Tags()["tensors"]
