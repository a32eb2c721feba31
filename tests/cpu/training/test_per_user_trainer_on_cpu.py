"""The Trainer's per-user mode (training.per_user): an iteration trains the adapter of each
user with enough rows on that user's rows only, publishes it to the replicas beside the
others, and leaves the rows of a user with too few in the buffer for later."""

from __future__ import annotations

import time

import pytest
import ray

from clawray.config import ClawRayConfig
from tests.support.common import API_KEY
from tests.support.serving import DONE_SESSIONS_IDLE_S, chat_session, side_app

pytestmark = pytest.mark.ray
APP = "per-user"


@pytest.fixture(scope="module")
def per_user_app(served, tmp_path_factory):
    from ray import serve

    from clawray.serve.auth import tenant_of_key

    cfg = (ClawRayConfig()
           .inference(engine="hf", max_loras=4)
           .serving(api_keys=[API_KEY], trusted_app_tenants=[tenant_of_key(API_KEY)],
                    record_sink=["hub"], default_max_tokens=8, replica_num_cpus=0.5)
           .sessions(idle_timeout_s=DONE_SESSIONS_IDLE_S, feedback_window_s=0, flush_interval_s=0.1)
           .judge(num_voters=1, timeout_s=20)
           .buffer(path=str(tmp_path_factory.mktemp("per-user-samples")), seal_age_s=0.1,
                   lease_s=60)
           .training(app=APP, per_user=True, lora_rank=4, lora_alpha=8, zero_stage=0,
                     batch_size=16, min_batch=1, take_timeout_s=5, lr=1e-2,
                     learner_num_cpus=0.5, sync_timeout_s=60, per_user_min_rows=3,
                     per_user_max_rows=8, checkpoint_dir=str(tmp_path_factory.mktemp("ck")),
                     user_adapters_dir=str(tmp_path_factory.mktemp("users"))))
    client = side_app(served, cfg, APP)
    yield cfg.check(), client
    serve.delete(APP)


def _session(client, user: str, turns: int) -> None:
    chat_session(client, turns, user)


def test_an_iteration_trains_each_users_adapter_on_their_rows_only(per_user_app):
    from clawray.learner.adapters import AdapterStore
    from clawray.serve.auth import tenant_of_key
    from clawray.sessions.pipeline import attach_live_pipeline
    from clawray.training.trainer import Trainer

    cfg, client = per_user_app
    ann, bob = (f"{tenant_of_key(API_KEY)}/{u}" for u in ("ann", "bob"))
    for _ in range(2):
        _session(client, "ann", turns=2)
    _session(client, "bob", turns=1)  # one row: fewer than per_user_min_rows
    buffer = attach_live_pipeline(cfg, APP).buffer
    deadline = time.time() + 60
    while ray.get(buffer.stats.remote())["available"] < 5:
        assert time.time() < deadline, ray.get(buffer.stats.remote())
        time.sleep(0.3)

    trainer = Trainer(config=cfg.to_dict())
    try:
        r = trainer.train()
        assert r["users_trained"] == [ann] and r["user_versions"] == {ann: 1}
        assert r["user_rows"] == 4 and r["users_waiting"] == 1
        assert trainer.publisher.status()["adapters"] == {ann: 1}
        store = AdapterStore(cfg.training_cfg.user_adapters_dir)
        assert [m["user"] for m in store.users()] == [ann]
        assert store.meta(ann)["rows_trained"] == 4
        # bob's row went back to the buffer; ann's were consumed
        assert ray.get(buffer.stats.remote())["available"] == 1
        _session(client, "bob", turns=2)  # bob now has enough
        deadline = time.time() + 60
        while ray.get(buffer.stats.remote())["available"] < 3:
            assert time.time() < deadline
            time.sleep(0.3)
        r = trainer.train()
        assert r["users_trained"] == [bob] and r["user_rows"] == 3
        assert trainer.publisher.status()["adapters"] == {ann: 1, bob: 1}
    finally:
        trainer.stop()


def test_a_user_below_min_rows_at_the_front_does_not_block_the_others(per_user_app):
    """Rows of a user with too few rows go back to the front of the buffer: a take no larger
    than them would return them forever and train nobody. The take grows until it reaches a
    user with enough rows (training/per_user.py::next_take). And a trainer starting up
    republishes stored adapters the app does not serve."""
    from clawray.serve.auth import tenant_of_key
    from clawray.sessions.pipeline import attach_live_pipeline
    from clawray.training.trainer import Trainer

    cfg, client = per_user_app
    cy, dee = (f"{tenant_of_key(API_KEY)}/{u}" for u in ("cy", "dee"))
    buffer = attach_live_pipeline(cfg, APP).buffer

    def wait_rows(n: int) -> None:
        deadline = time.time() + 60
        while ray.get(buffer.stats.remote())["available"] < n:
            assert time.time() < deadline, ray.get(buffer.stats.remote())
            time.sleep(0.3)

    _session(client, "cy", turns=1)  # one row of cy's at the front, below min_rows (3)
    wait_rows(1)
    _session(client, "dee", turns=3)
    wait_rows(4)
    # The app forgets ann's adapter (as a restarted control actor would): a trainer starting
    # up publishes what is on disk again
    from clawray.weights.publisher import WeightPublisher

    ann = f"{tenant_of_key(API_KEY)}/ann"
    assert WeightPublisher(APP, lora=False, timeout_s=60).delete_adapter(ann)
    trainer = Trainer(config=cfg.copy_with(training={"batch_size": 1}).to_dict())
    try:
        assert trainer.publisher.status()["adapters"][ann] == 1
        trained = [trainer.train()["users_trained"] for _ in range(3)]  # takes of 1, 2, 4
        assert trained == [[], [], [dee]]
        assert ray.get(buffer.stats.remote())["available"] == 1  # cy's row waits
    finally:
        trainer.stop()
