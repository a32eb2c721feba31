"""The Tracker: TensorBoard event files read back record by record, W&B and MLflow refused
with a clear message when their package is missing (an offline W&B run and a local MLflow
store where they are installed), secrets never written, the ``tracking:`` config section."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from clawray.config import ClawRayConfig, ConfigError, TrackingConfig, apply_sets
from clawray.training.tracking import REDACTED, Tracker
from tests.support.events import scalars_of, texts_of

SECRET = "sk-do-not-log-3f9a1c"
TOKEN = "hf_do_not_log_77e2b0"


def test_scalars_land_in_an_event_file_with_their_steps(tmp_path):
    tracker = Tracker(TrackingConfig(), "run-a", tmp_path)
    tracker.log(1, {"loss": 0.5, "reward_mean": -0.25})
    tracker.log(2, {"loss": 0.125, "reward_mean": 0.75})
    tracker.close()
    assert scalars_of(tmp_path / "tensorboard" / "run-a") == {
        ("loss", 1): 0.5, ("reward_mean", 1): -0.25,
        ("loss", 2): 0.125, ("reward_mean", 2): 0.75}


def test_nested_metrics_flatten_and_only_finite_numbers_are_logged(tmp_path):
    tracker = Tracker(TrackingConfig(), "run", tmp_path)
    tracker.log(7, {"smoothed": {"loss": 1.5, "env": {"success": 0.25}}, "samples": 32,
                    "name": "abc", "missing": None, "nan": math.nan, "inf": math.inf,
                    "flag": True, "users_trained": ["u1"]})
    tracker.close()
    assert scalars_of(tmp_path) == {("smoothed/loss", 7): 1.5,
                                    ("smoothed/env/success", 7): 0.25, ("samples", 7): 32.0}


def test_gate_decisions_are_logged_as_text_events(tmp_path):
    tracker = Tracker(TrackingConfig(), "run", tmp_path)
    tracker.log(3, {"gate": "candidate", "gate_events": ["promote"], "loss": 0.5})
    tracker.log(4, {"gate": {"event": "reject", "version": 5}})
    tracker.close()
    texts = texts_of(tmp_path)
    assert texts[("gate/text_summary", 3)] == "candidate"
    assert texts[("gate_events/text_summary", 3)] == '["promote"]'
    assert texts[("gate/text_summary", 4)] == '{"event": "reject", "version": 5}'
    assert scalars_of(tmp_path)[("gate/version", 4)] == 5.0  # a dict's numbers plot too


def test_tensorboard_folder_can_be_set_or_turned_off(tmp_path):
    tracker = Tracker(TrackingConfig(log_dir=str(tmp_path / "tb")), "run", tmp_path / "root")
    tracker.log(1, {"loss": 1.0})
    tracker.close()
    assert scalars_of(tmp_path / "tb" / "run") == {("loss", 1): 1.0}
    off = Tracker(TrackingConfig(tensorboard=False), "run", tmp_path / "off")
    off.log(1, {"loss": 1.0})
    off.close()
    assert not (tmp_path / "off").exists()
    assert not (tmp_path / "root").exists()


def test_tensorboards_own_reader_reads_the_scalars(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    tracker = Tracker(TrackingConfig(), "run", tmp_path)
    for step in (1, 2, 3):
        tracker.log(step, {"smoothed": {"loss": step / 4}})
    tracker.close()
    acc = accumulator.EventAccumulator(str(tmp_path / "tensorboard" / "run"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("smoothed/loss")] == [
        (1, 0.25), (2, 0.5), (3, 0.75)]


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_an_optional_tracker_without_its_package_refuses_to_start(tmp_path, monkeypatch,
                                                                  package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails as if not installed
    with pytest.raises(ImportError) as e:
        Tracker(TrackingConfig(**{package: True}), "run", tmp_path)
    assert str(e.value) == (f"tracking.{package} is on but the '{package}' package is not "
                            f"installed: `pip install {package}` (or set tracking.{package}: "
                            "false)")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written first


def secret_config() -> dict:
    return (ClawRayConfig().serving(api_keys=[SECRET], api_keys_file="/run/secrets/keys")
            .environments(runtime_env={"env_vars": {"HF_TOKEN": TOKEN}})
            .gate(shadow_kwargs={"client_secret": SECRET, "nested": [{"api_key": SECRET}]})
            .to_dict())


def written_bytes(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def test_secrets_in_the_config_are_never_written(tmp_path):
    tracker = Tracker(TrackingConfig(), "run", tmp_path, config=secret_config())
    tracker.log(1, {"loss": 0.5})
    tracker.close()
    data = written_bytes(tmp_path)
    for secret in (SECRET, TOKEN, "/run/secrets/keys"):
        assert secret.encode() not in data
    config = texts_of(tmp_path)[("config/text_summary", 0)]
    assert REDACTED in config and "embedded:tiny" in config  # the config itself is there
    assert '"max_tokens": 512' in config and '"default_max_tokens": 512' in config  # not secrets


def test_a_failing_tracker_never_stops_training(tmp_path, caplog):
    tracker = Tracker(TrackingConfig(), "run", tmp_path)

    class Down:
        def log(self, step, values, texts):
            raise ConnectionError("tracking server down")

        def close(self):
            pass

    tracker.backends.insert(0, Down())
    for step in (1, 2):
        tracker.log(step, {"loss": 0.5 * step})
    tracker.close()
    assert scalars_of(tmp_path) == {("loss", 1): 0.5, ("loss", 2): 1.0}  # the others logged
    assert sum("could not log" in r.getMessage() for r in caplog.records) == 1  # reported once


def test_wandb_offline_run_holds_metrics_and_no_secret(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto.wandb_internal_pb2 import HistoryItem

    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(TrackingConfig(tensorboard=False, wandb=True), "run", tmp_path,
                      config=secret_config())
    tracker.log(3, {"loss": 0.5, "smoothed": {"reward_mean": 0.25}, "gate": "promote"})
    tracker.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()  # the offline run's records, W&B's own protobuf messages
    for key, value in (("_step", "3"), ("loss", "0.5"), ("smoothed/reward_mean", "0.25"),
                       ("gate", '"promote"')):
        assert any(item.SerializeToString() in data for item in (  # either way W&B keys
            HistoryItem(key=key, value_json=value),                # an item
            HistoryItem(nested_key=[key], value_json=value)))
    assert b"<redacted>" in data
    data = written_bytes(tmp_path)
    assert SECRET.encode() not in data and TOKEN.encode() not in data


def test_mlflow_local_run_holds_metrics_and_no_secret(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    tracker = Tracker(TrackingConfig(tensorboard=False, mlflow=True, mlflow_experiment="exp"),
                      "run", tmp_path, config=secret_config())
    tracker.log(1, {"loss": 0.5, "smoothed": {"reward_mean": 0.25}, "gate": "promote"})
    tracker.log(2, {"loss": 0.25})
    tracker.close()
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] \
        == [(1, 0.5), (2, 0.25)]
    assert run.data.metrics["smoothed/reward_mean"] == 0.25
    assert run.data.params["serving/api_keys"] == REDACTED
    data = written_bytes(tmp_path)
    assert SECRET.encode() not in data and TOKEN.encode() not in data


def test_tracking_section_round_trips_and_rejects_bad_values_precisely():
    cfg = ClawRayConfig().tracking(wandb=True, wandb_project="claw-runs", mlflow=True,
                                   mlflow_tracking_uri="file:/tmp/mlruns", log_dir="/tmp/tb")
    data = cfg.to_dict()
    assert data["tracking"]["wandb_project"] == "claw-runs"
    assert ClawRayConfig.from_dict(data) == cfg
    assert ClawRayConfig().tracking_cfg.tensorboard and not ClawRayConfig().tracking_cfg.wandb
    assert not apply_sets(ClawRayConfig(), ["tracking.tensorboard=false"]).tracking_cfg.tensorboard
    with pytest.raises(ConfigError, match=r"tracking\.wandb_project: .*wandb_project must be a "
                       r"name of 1 to 128 characters without any of / \\ # \? % : \(got 'a/b'\)"):
        ClawRayConfig.from_dict({"tracking": {"wandb_project": "a/b"}})
    with pytest.raises(ConfigError, match=r"tracking\.wandb_mode: Input should be 'offline', "
                       "'online' or 'disabled'"):
        ClawRayConfig.from_dict({"tracking": {"wandb_mode": "cloud"}})
    with pytest.raises(ConfigError, match="mlflow_experiment must be a non-empty name"):
        ClawRayConfig().tracking(mlflow_experiment=" ")
    with pytest.raises(ConfigError, match=r"tracking\.tensorbord: Extra inputs"):
        ClawRayConfig.from_dict({"tracking": {"tensorbord": True}})
