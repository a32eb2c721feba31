"""``init_local_ray``: a cluster of the caller's own, started again when Ray's node times out
during start-up (ray-project/ray#65983), and no other error hidden."""

from __future__ import annotations

import pytest

from clawray.apps import launch

TIMEOUT = Exception("The current node timed out during startup. This could happen because "
                    "some of the raylet failed to startup or the GCS has become overloaded.")


class FakeRay:
    def __init__(self, errors: list[Exception | None]) -> None:
        self.errors = errors
        self.inits: list[dict] = []
        self.shutdowns = 0

    def init(self, **kwargs) -> None:
        self.inits.append(kwargs)
        error = self.errors.pop(0)
        if error is not None:
            raise error

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_node_that_timed_out_is_shut_down_and_started_again(monkeypatch, caplog):
    fake = FakeRay([TIMEOUT, None])
    monkeypatch.setattr(launch, "ray", fake)
    launch.init_local_ray(num_cpus=4, include_dashboard=False)
    # always a local cluster of its own, with the caller's settings, each time
    assert fake.inits == [{"address": "local", "num_cpus": 4, "include_dashboard": False}] * 2
    assert fake.shutdowns == 1
    assert "timed out during start-up (attempt 1 of 3)" in caplog.text


def test_it_gives_up_after_its_attempts_with_rays_own_error(monkeypatch):
    fake = FakeRay([TIMEOUT, TIMEOUT])
    monkeypatch.setattr(launch, "ray", fake)
    with pytest.raises(Exception, match="timed out during startup"):
        launch.init_local_ray(attempts=2)
    assert len(fake.inits) == 2 and fake.shutdowns == 1


def test_any_other_error_is_raised_at_once(monkeypatch):
    fake = FakeRay([ValueError("When connecting to an existing cluster, num_cpus ..."), None])
    monkeypatch.setattr(launch, "ray", fake)
    with pytest.raises(ValueError, match="num_cpus"):
        launch.init_local_ray(num_cpus=2)
    assert len(fake.inits) == 1 and fake.shutdowns == 0


def test_serving_settings_name_the_ray_serve_environment():
    from clawray.apps.launch import serve_env
    from clawray.config import ClawRayConfig

    def env(**serving):
        return serve_env(ClawRayConfig().copy_with(serving=serving).serving_cfg)

    loop = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1"}
    assert env() == {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", **loop}  # the defaults
    assert env(direct_ingress=False) == loop
    assert env(direct_ingress=False, control_loop_interval_s=None) == {}
    assert env(direct_ingress=False, control_loop_interval_s=0.5) == {
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5"}
    assert env(direct_ingress=False, throughput_optimized=True) == {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", **loop}


def test_the_control_loop_reaches_rays_processes_and_leaves_the_environment(monkeypatch):
    """Ray's processes (and through the raylet, Serve's controller) take the environment of
    ``ray.init``; afterwards the interval is not left in this process's environment, where
    clusters this process starts later would take it too. Direct ingress stays (the driver
    reads it)."""
    import os

    from clawray.config import ClawRayConfig

    seen = {}

    class Stop(Exception):
        pass

    class Ray:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            seen.update({k: os.environ.get(k) for k in (launch.CONTROL_LOOP,
                                                        "RAY_SERVE_ENABLE_DIRECT_INGRESS")})

    class Serve:
        def start(self, **kwargs):
            raise Stop

    monkeypatch.delenv(launch.CONTROL_LOOP, raising=False)
    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)
    monkeypatch.setattr(launch, "ray", Ray())
    monkeypatch.setattr(launch, "serve", Serve())
    with pytest.raises(Stop):
        launch.start_serving(ClawRayConfig(), blocking=False)
    assert seen == {launch.CONTROL_LOOP: "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    assert launch.CONTROL_LOOP not in os.environ
    assert os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    # a value the user set is theirs: used, and left in place
    monkeypatch.setenv(launch.CONTROL_LOOP, "0.5")
    with pytest.raises(Stop):
        launch.start_serving(ClawRayConfig(), blocking=False)
    assert seen[launch.CONTROL_LOOP] == "0.5" and os.environ[launch.CONTROL_LOOP] == "0.5"
