"""Shared fixtures: one Ray cluster and one Serve app on the embedded default per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.common import RLA_NOTEBOOK_SCALE, Served
from tests.support.serving import serve_app

RLA_NOTEBOOK_TEST = "test_rlanything_notebook"
RLA_WARM_STARTS = pytest.StashKey[tuple]()  # (the background build, its log file)
RLA_WARM_STARTS_CMD = ["-m", "clawray.apps.cli", "rla-table", "--scale", RLA_NOTEBOOK_SCALE,
                       "--warm-starts-only"]


# The live learning test measures how much a live loop learns in 40 steps; it runs alone,
# before the background build starts (a busy CPU changes which turns form each batch).
QUIET_TESTS = ("test_demo_learning_on_cpu.py",)
RLA_BUILD_WANTED = pytest.StashKey[bool]()


def pytest_collection_finish(session):
    """The RLAnything notebook runs Table 1 small from warm starts that take minutes of SFT
    to build (then cached). When it is among the tests, build them in the background at the
    lowest CPU priority (``nice 19``) from the first test that is not a quiet one
    (``QUIET_TESTS``) on: the tests before the notebook mostly wait on Ray, so they lend it
    their idle cores and barely notice; the notebook's test waits for it
    (``rla_warm_starts``)."""
    config = session.config
    config.stash[RLA_BUILD_WANTED] = not config.option.collectonly and any(
        RLA_NOTEBOOK_TEST in i.nodeid for i in session.items)


def pytest_runtest_setup(item):
    config = item.config
    if not config.stash.get(RLA_BUILD_WANTED, False) or RLA_WARM_STARTS in config.stash:
        return
    if any(q in item.nodeid for q in QUIET_TESTS):
        return
    _start_rla_build(config)


def _start_rla_build(config) -> None:
    import subprocess
    import sys
    import tempfile

    log = tempfile.NamedTemporaryFile("w+", prefix="clawray-rla-warm-starts-", suffix=".log",
                                      delete=False)
    proc = subprocess.Popen([sys.executable, *RLA_WARM_STARTS_CMD], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))
    config.stash[RLA_WARM_STARTS] = (proc, Path(log.name))


def pytest_unconfigure(config):
    started = config.stash.get(RLA_WARM_STARTS, None)
    if started is not None and started[0].poll() is None:
        started[0].kill()


@pytest.fixture(scope="session")
def rla_warm_starts(pytestconfig) -> str:
    """The background build's output, once it is done (or the build, now)."""
    import subprocess
    import sys

    started = pytestconfig.stash.get(RLA_WARM_STARTS, None)
    if started is None:
        run = subprocess.run([sys.executable, *RLA_WARM_STARTS_CMD], capture_output=True,
                             text=True, timeout=1200)
        assert run.returncode == 0, run.stderr[-4000:]
        return run.stdout
    proc, log = started
    proc.wait(timeout=1200)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from clawray.models.tiny import build_embedded_default

    return build_embedded_default()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from clawray.models.loader import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False,
             logging_level="WARNING", namespace="clawray-tests")
    yield ray
    # ray.shutdown() ends Serve's actors with the cluster; serve.shutdown() first would wait
    # ~30 s for the controller's graceful drain.
    ray.shutdown()


@pytest.fixture(scope="session")
def served_hf(ray_cluster, tiny_model_path, tmp_path_factory) -> Served:
    """The embedded default served by the transformers engine (app "clawray" at /)."""
    return serve_app("clawray", "/", tmp_path_factory)


@pytest.fixture(scope="session")
def served(served_hf) -> Served:
    """The session's main app (the transformers engine)."""
    return served_hf
