"""``python -m clawray.train`` joins the cluster its app runs in: ``--address``, else
``RAY_ADDRESS``, else the cluster running on this machine (``serve run``'s own included: by
hand, a job that started a fresh local cluster beside ``serve run`` trained SmolLM2 to
version 3 while users kept talking to version 0), else a new one; it refuses, saying what to
do, when no cluster is found yet something answers on the app's port."""

from __future__ import annotations

import socket

import pytest
import yaml

from clawray.apps import train_job
from clawray.config import ClawRayConfig, load_config


def test_a_serve_configs_http_options_are_the_apps_host_and_port(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": 8123},
        "applications": [{"name": "clawray", "import_path": "clawray.serve.app:build_app",
                          "args": {"model": {"path": "embedded:tiny"}}}]}))
    assert load_config(str(path)).serving_cfg.port == 8123
    data = yaml.safe_load(path.read_text())
    data["applications"][0]["args"]["serving"] = {"port": 9000}  # args win
    path.write_text(yaml.safe_dump(data))
    assert load_config(str(path)).serving_cfg.port == 9000


@pytest.fixture
def inits(monkeypatch):
    """``ray.init`` recorded; ``address="auto"`` finds no cluster."""
    import ray

    calls = []

    def init(address=None, **kwargs):
        calls.append(address)
        if address == "auto":
            raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_the_running_cluster_is_joined_before_a_new_one_is_started(inits):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ClawRayConfig().serving(port=port)
    assert train_job.connect(None, 2.0, cfg) is None
    assert inits == ["auto", None]  # tried the machine's cluster, then started one
    inits.clear()
    assert train_job.connect("10.0.0.5:6379", None, cfg) is None
    assert inits == ["10.0.0.5:6379"]


def test_no_cluster_but_an_app_on_the_port_is_refused_with_what_to_do(inits):
    with socket.socket() as app:  # stands for an app this job cannot reach
        app.bind(("127.0.0.1", 0))
        app.listen()
        port = app.getsockname()[1]
        refused = train_job.connect(None, None, ClawRayConfig().serving(port=port))
    assert inits == ["auto"]  # and no new cluster
    assert f"answers on 127.0.0.1:{port}" in refused and "--address" in refused
    assert "ray job submit" in refused
