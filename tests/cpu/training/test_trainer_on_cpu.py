"""The training loop end to end on CPU: live turns → judged samples → DeepSpeed update →
weights in every serving replica, with no request failing; checkpoint → kill → restore; Tune.

Uses its own Serve app (``trainer-app``) so training never changes the model other tests see.
Two replicas on the transformers engine: the trainer's work does not depend on the engine, and
loading a learner's weights into vLLM (and its log-probs after) is tested in
tests/cpu/weights/test_weight_sync_on_cpu.py; a vLLM replica here cost the suite ~50 s to start.
"""

from __future__ import annotations

import pathlib
import threading
import uuid

import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from clawray.config import ClawRayConfig
from tests.support.common import API_KEY
from tests.support.events import scalars_of
from tests.support.serving import DONE_SESSIONS_IDLE_S

pytestmark = pytest.mark.ray
APP = "trainer-app"
REPLICAS = 2
TOLERANCE = 1e-4  # served vs learner log-probs: the same torch kernels


def _session(client: openai.OpenAI, good: bool, turns: int = 2) -> list:
    """A session whose user answers each reply with praise or a correction (±1 by the
    heuristic judge); returns the completions."""
    sid = f"s-{uuid.uuid4().hex[:10]}"
    msgs = [{"role": "user", "content": "hello there"}]
    out = []
    for t in range(turns):
        last = t == turns - 1
        r = client.chat.completions.create(
            model="clawray-tiny", messages=msgs, max_tokens=10,
            extra_headers={"X-Session-Id": sid, **({"X-Session-Done": "1"} if last else {})})
        out.append(r)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        msgs.append({"role": "user", "content": "Thanks, perfect." if good
                     else "That's wrong, try again."})
    return out


@pytest.fixture(scope="module")
def app(served, tmp_path_factory):
    from ray import serve

    from clawray.serve.app import build_app

    cfg = (ClawRayConfig()
           .inference(engine="hf")
           .serving(api_keys=[API_KEY], record_sink=["hub"], default_max_tokens=10,
                    ingress_replicas=REPLICAS, replica_num_cpus=0.5)
           .sessions(idle_timeout_s=DONE_SESSIONS_IDLE_S, feedback_window_s=0, flush_interval_s=0.1)
           .judge(num_voters=1, timeout_s=20)
           # a short lease: a batch taken by a trainer that dies is delivered again soon
           .buffer(path=str(tmp_path_factory.mktemp("trainer-samples")), seal_age_s=0.1,
                   lease_s=10)
           .training(app=APP, batch_size=8, min_batch=2, take_timeout_s=20, lr=2e-3,
                     learner_num_cpus=0.5, checkpoint_dir=str(tmp_path_factory.mktemp("ckpt")),
                     sync_timeout_s=60))
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    port = served.base_url.split(":")[2].split("/")[0]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/{APP}/v1", api_key=API_KEY,
                           max_retries=0, timeout=60)
    yield cfg, client
    serve.delete(APP)


@pytest.fixture(scope="module")
def trainer(app):
    from clawray.training.trainer import Trainer

    cfg, _ = app
    t = Trainer(config=cfg.to_dict())
    yield t
    t.stop()


def _fixed_pair(cfg: ClawRayConfig) -> tuple[list[int], list[int]]:
    from clawray.models.loader import load_tokenizer
    from clawray.models.loader import policy_model_info

    tok = load_tokenizer(policy_model_info(cfg).path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi there"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(prompt), tok.encode("OK, I understand.", add_special_tokens=False)


def test_an_iteration_trains_and_every_replica_serves_the_learner_weights(app, trainer):
    from ray import serve

    from clawray.samples import make_row, rows_to_batch

    cfg, client = app
    for i in range(5):
        _session(client, good=i % 2 == 0)
    r = trainer.train()
    assert r["samples"] >= 2 and r["optimizer_steps"] >= 1, r
    assert r["policy_version"] == 1 and r["sync_bytes"] > 0
    assert {"time_take_s", "time_update_s", "time_sync_s"} <= set(r["smoothed"])
    # the iteration's curves are in TensorBoard's event files (tracking: defaults)
    curves = scalars_of(trainer.metrics_path.parent / "tensorboard")
    assert curves[("loss", 1)] == pytest.approx(r["loss"], rel=1e-6)
    assert curves[("policy_version", 1)] == 1
    handle = serve.get_app_handle(APP)
    seen = {}
    for _ in range(12):  # both replicas, through the handle's routing
        v = handle.weights_version.remote().result()
        seen[v["replica"]] = v
    assert set(seen) == {1}, seen
    assert len(next(iter(seen.values()))["replicas"]) == REPLICAS
    # The served engine scores a fixed response exactly as the learner does.
    prompt, response = _fixed_pair(cfg)
    served_lp = handle.prompt_logprobs.remote(prompt, response).result()
    row = make_row(sample_id="probe", kind="rl", source="live", prompt_ids=prompt,
                   response_ids=response, rollout_logprobs=[0.0] * len(response),
                   policy_version=1, loss_mask=[1] * len(response), reward=0.0)
    learner_lp = trainer.learner.logprobs(pa.Table.from_batches([rows_to_batch([row])]))[0]
    assert max(abs(a - b) for a, b in zip(served_lp, learner_lp)) < TOLERANCE
    # New responses say they come from the new weights.
    c = _session(client, good=True, turns=1)[0]
    assert c.system_fingerprint == "clawray-policy-v1"


def test_every_series_of_the_dashboard_is_exported_by_the_running_app(app, trainer):
    """deployments/grafana/clawray.json against this app's Prometheus endpoint, after
    sessions were served, judged and trained on: every series a panel reads exists (the
    policy gate's: tests/cpu/training/test_gated_trainer_on_cpu.py)."""
    from tests.support.metrics import dashboard_series, wait_for_series

    wanted = dashboard_series()
    assert len(wanted) >= 15 and "ray_clawray_requests_total" in wanted
    gate = {s for s in wanted if s.startswith("ray_clawray_gate_")}
    assert gate
    assert wait_for_series(wanted - gate) == set()


def test_clawray_status_shows_the_running_app(app, trainer):
    """``clawray status`` on this app: in-process (the state it reads) and as the command an
    operator runs (its own process, joining this cluster); an app that does not run is named."""
    import json
    import subprocess
    import sys

    from clawray.apps.status import NoApp, gather, render
    from tests.support.common import REPO

    st = gather(APP)
    assert st["engine"]["engine"] == "hf" and st["engine"]["policy_version"] == trainer.version
    ctl = st["control"]
    assert ctl["version"] == trainer.version and len(ctl["replicas"]) == REPLICAS
    assert len(st["hubs"]) >= 1 and all("sessions" in h for h in st["hubs"])
    assert st["buffer"]["policy_version"] == trainer.version and st["gate"] is None
    screen = render(st)
    assert f"published v{trainer.version}" in screen
    assert f"{REPLICAS} of {REPLICAS} live replicas on it" in screen
    with pytest.raises(NoApp, match="no app 'nope' runs"):
        gather("nope")
    # this cluster by its address: others may run on the machine (a background build's)
    address = ray.get_runtime_context().gcs_address
    run = subprocess.run([sys.executable, "-m", "clawray.apps.cli", "status", "--app", APP,
                          "--address", address, "--json"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["control"]["version"] == trainer.version


def test_training_and_syncing_under_load_fail_no_request(app, trainer):
    cfg, client = app
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]
    fingerprints: set[str] = set()

    def load(good: bool) -> None:
        while not stop.is_set():
            try:
                for c in _session(client, good):
                    fingerprints.add(c.system_fingerprint)
                done[0] += 1
            except Exception as e:  # noqa: BLE001 - every failure is the finding
                errors.append(e)

    threads = [threading.Thread(target=load, args=(i % 2 == 0,)) for i in range(3)]
    for th in threads:
        th.start()
    try:
        start = trainer.version
        results = [trainer.train() for _ in range(3)]
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=60)
    assert not errors, errors[:3]
    assert done[0] >= 3
    synced = [r for r in results if "sync_seconds" in r]
    assert synced and trainer.version == start + len(synced)
    assert len(fingerprints) >= 2  # requests were answered by more than one policy version


def _position(cfg, consumed: dict) -> tuple[int, int]:
    """A consumed position in one form: the end of segment s is (s + 1, 0). The buffer writes
    it as (s, rows) until segment s + 1 is sealed, and sealing is timed (seal_age_s)."""
    from clawray.buffer.core import segment_name

    seq, offset = consumed["seq"], consumed["offset"]
    wal = pathlib.Path(cfg.buffer_cfg.path).expanduser() / segment_name(seq)
    if wal.exists() and offset >= pq.ParquetFile(wal).metadata.num_rows:
        return seq + 1, 0
    return seq, offset


def test_checkpoint_kill_restore_resumes_version_and_buffer_offset(app, trainer, tmp_path):
    """Checkpoint, then the trainer takes a batch and dies before its update: a restored
    trainer resumes version and buffer position, and trains the lost batch's rows once (its
    lease expires, the rows come back)."""
    from clawray.buffer.core import fetch
    from clawray.training.trainer import Trainer

    cfg, client = app
    saved = trainer.save_checkpoint(str(tmp_path))
    buffer = trainer.pipeline.buffer
    consumed = ray.get(buffer.stats.remote())["consumed"]
    assert saved["policy_version"] == trainer.version and saved["buffer_consumed"] == consumed
    for i in range(3):
        _session(client, good=i % 2 == 0)
    lost = trainer._take_batch().slices  # taken under a lease, never trained nor acknowledged
    lost_ids = fetch(lost, ray.get).column("sample_id").to_pylist()
    assert lost_ids and ray.get(buffer.stats.remote())["leased_rows"] == len(lost_ids)
    trainer.learner.shutdown()  # the learner dies with its weights and optimizer
    fresh = Trainer(config=cfg.to_dict())
    try:
        fresh.restore(str(tmp_path))
        assert fresh.version == saved["policy_version"]
        assert fresh.updates == saved["updates"]
        restored = ray.get(fresh.pipeline.buffer.stats.remote())["consumed"]
        assert _position(cfg, restored) == _position(cfg, consumed)
        r = fresh.train()
        assert r["policy_version"] == saved["policy_version"] + 1
        repeated = r["samples_repeated"]
        for _ in range(3):  # rows waiting before them first; the lost ones after their lease
            if all(sid in fresh.trained for sid in lost_ids):
                break
            repeated += fresh.train()["samples_repeated"]
        assert all(sid in fresh.trained for sid in lost_ids) and repeated == 0
        stats = ray.get(buffer.stats.remote())
        assert stats["leased_rows"] == 0 and stats["rows_redelivered"] >= len(lost_ids)
        assert stats["consumed"] != consumed  # acknowledged after the update
    finally:
        fresh.stop()
        trainer.learner = fresh.learner  # the module fixture's stop() must not fail


def test_tune_runs_and_checkpoints_the_trainer(app, tmp_path):
    from ray import tune

    from clawray.training.trainer import Trainer

    cfg, client = app
    for i in range(3):
        _session(client, good=i % 2 == 0)
    tuner = tune.Tuner(
        Trainer, param_space=cfg.to_dict(),
        run_config=tune.RunConfig(stop={"training_iteration": 1}, storage_path=str(tmp_path),
                                  checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=True),
                                  verbose=0))
    result = tuner.fit().get_best_result(metric="samples", mode="max")
    assert result.error is None
    assert result.metrics["training_iteration"] == 1
    assert result.checkpoint is not None
