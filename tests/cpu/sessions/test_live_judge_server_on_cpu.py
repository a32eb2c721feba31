"""The `server` judge backend end to end: PRM voters call a JudgeServer deployment in the app.

The judge is the tiny embedded model itself, so its verdicts are mostly unparseable; what this
checks is the plumbing: one n=m call per turn through the JudgeServer handle, every vote either
parsed or counted as a parse failure, and the turn written as judged.
"""

from __future__ import annotations

import uuid

import openai
import pytest
import ray

from clawray.config import ClawRayConfig
from tests.support.common import API_KEY, Served

pytestmark = pytest.mark.ray
SYS = {"role": "system", "content": "You are an agent."}


@pytest.fixture(scope="module")
def judged_app(served, tmp_path_factory):
    from ray import serve

    from clawray.serve.app import build_app

    cfg = (ClawRayConfig().inference(engine="hf")
           .serving(api_keys=[API_KEY], record_sink=["hub"], default_max_tokens=12,
                    replica_num_cpus=0.5)
           .sessions(feedback_window_s=0, flush_interval_s=0.2)
           .judge(backend="server", m=3, max_tokens=24, num_voters=1, timeout_s=60)
           .buffer(path=str(tmp_path_factory.mktemp("judged-samples")), seal_age_s=0.2))
    serve.run(build_app(cfg), name="judged", route_prefix="/judged")
    port = served.base_url.split(":")[2].split("/")[0]
    yield Served(f"http://127.0.0.1:{port}/judged/v1", API_KEY, "clawray-tiny", None, "judged",
                 cfg.buffer_cfg.path, cfg)
    serve.delete("judged")


def test_turns_are_judged_by_the_judge_server(judged_app):
    client = openai.OpenAI(base_url=judged_app.base_url, api_key=API_KEY, max_retries=0)
    sid = f"js-{uuid.uuid4().hex[:6]}"
    msgs = [SYS, {"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model="clawray-tiny", messages=msgs, temperature=0,
                                       extra_headers={"X-Session-Id": sid})
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "Thanks!"}]
    client.chat.completions.create(model="clawray-tiny", messages=msgs, temperature=0,
                                   extra_headers={"X-Session-Id": sid, "X-Session-Done": "1"})
    rows = judged_app.samples(expected=2, timeout_s=90, session_id=sid)
    assert [(r["turn"], r["judge_status"]) for r in rows] == [(1, "judged"), (2, "no_next_state")]
    assert len(rows[0]["votes"]) + rows[0]["vote_parse_failures"] == 3
    stats = ray.get(judged_app.pipeline().hubs[0].stats.remote())
    assert stats["voters"]["calls"] == 1 and stats["voters"]["call_failures"] == 0
