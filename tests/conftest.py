"""Shared fixtures: one Ray cluster and one Serve app on the embedded default per test session."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from clawray.ledger import LEDGER_ENV
from tests.support.common import REPO, RLA_NOTEBOOK_SCALE, Served, die_with_parent, free_port
from tests.support.serving import serve_app

# Tests evaluate on held-out pools too: their ledger lines go to a file of the session's own
# (inherited by the processes tests start), never to docs/results/ledger.jsonl.
os.environ[LEDGER_ENV] = os.path.join(
    __import__("tempfile").mkdtemp(prefix="clawray-ledger-"), "ledger.jsonl")

RLA_WARM_STARTS_CMD = ["-m", "clawray.apps.cli", "rla-table", "--scale", RLA_NOTEBOOK_SCALE,
                       "--warm-starts-only"]
FLOORS_CMD = ["-m", "tests.support.warm_start_floors"]  # + the session's cache folder


@dataclasses.dataclass(frozen=True)
class Build:
    """Warm starts a test needs, built in the background while the suite runs."""

    test: str  # built when a test whose node id contains this is collected
    cmd: list[str]  # python arguments
    into_session_dir: bool = False  # the session's own folder (FLOORS_DIR) is the last argument
    key: pytest.StashKey = dataclasses.field(default_factory=pytest.StashKey)  # (proc, log)


# The RLAnything notebook runs Table 1 small from warm starts of its own (cached by settings);
# the warm-start floor tests check a policy SFT and an RM SFT (minutes of CPU, in
# a folder of the session's own so CI always measures a fresh build).
BUILDS = {"rla": Build("test_rlanything_notebook", RLA_WARM_STARTS_CMD),
          "floors": Build("test_warm_start_floors_on_cpu", FLOORS_CMD, into_session_dir=True)}
FLOORS_DIR = pytest.StashKey[str]()

BUILDS_WANTED = pytest.StashKey[list]()
BUILDS_STARTED = pytest.StashKey[bool]()


# The floors' SFTs pin torch to one thread themselves (warm_start_floors.one_thread; a build's
# numerics follow its thread count, and the floors were measured on one-thread builds).
BUILD_CHAIN = pytest.StashKey[dict]()


def _needs_build(item, build: Build) -> bool:
    return build.test in item.nodeid


def pytest_collection_modifyitems(session, config, items):
    """The tests that wait for a background build run last (in their collected order), so
    their builds have the whole suite to use the CPU the other tests leave idle."""
    waits = [any(_needs_build(i, b) for b in BUILDS.values()) for i in items]
    items[:] = [i for i, w in zip(items, waits) if not w] + [i for i, w in zip(items, waits) if w]


def pytest_collection_finish(session):
    """Builds of ``BUILDS`` whose test is among the collected ones start in the background
    from the first test on, under Linux's idle scheduling class (``SCHED_IDLE``): they run on
    CPU no test wants and never slow one. Each test waits for its build (``wait_build``); those
    tests run last.

    Not ``nice 19``, as before: the suite keeps both cores busy (measured: 0.1 % idle over
    30 s mid-suite), and Ray starts its workers at nice 15 (``RAY_worker_niceness``), so a
    nice-19 build still competes with them (scheduler weights 15 against 36): the floors
    build averaged 0.7 of a core through the Ray tests and was unfinished after 28 min
    (6 min alone); under ``SCHED_IDLE`` it got 0.14 of a core beside them.

    The builds run one after another: two DeepSpeed SFTs at once crawl (two ``clawray sft``
    runs side by side here: 46 s a step against 2.2 s alone, the other did not advance; an
    OpenMP team waits at every barrier for a thread the scheduler has parked)."""
    config = session.config
    config.stash[BUILDS_WANTED] = [] if config.option.collectonly else [
        b for b in BUILDS.values() if any(_needs_build(i, b) for i in session.items)]


def _idle_priority() -> None:
    """In a build's child process: the idle scheduling class (or nice 19 where refused), and
    killed with the thread that started it (Linux's ``PR_SET_PDEATHSIG``), so a suite that is
    killed, and never reaches ``pytest_unconfigure``, leaves no build running."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    die_with_parent()


def pytest_runtest_setup(item):
    config = item.config
    if config.stash.get(BUILDS_STARTED, False) or not config.stash.get(BUILDS_WANTED, []):
        return
    config.stash[BUILDS_STARTED] = True
    _start_chain(config, config.stash[BUILDS_WANTED])


def _floors_dir(config) -> str:
    import tempfile

    if FLOORS_DIR not in config.stash:
        config.stash[FLOORS_DIR] = tempfile.mkdtemp(prefix="clawray-floors-")
    return config.stash[FLOORS_DIR]


def _command(config, build: Build) -> list[str]:
    return build.cmd + ([_floors_dir(config)] if build.into_session_dir else [])


def _start_chain(config, builds: list[Build]) -> None:
    """One daemon thread starts ``builds`` in order, each once the one before has exited;
    a build's (process, log) is in the stash from its start on."""
    import subprocess
    import sys
    import tempfile
    import threading

    chain = config.stash[BUILD_CHAIN] = {"stop": threading.Event(), "done": threading.Event(),
                                         "pending": [b.key for b in builds]}
    commands = [(b, _command(config, b)) for b in builds]  # the folder exists before the thread

    def run() -> None:
        try:
            for build, args in commands:
                if chain["stop"].is_set():
                    return
                log = tempfile.NamedTemporaryFile("w+", prefix="clawray-build-", suffix=".log",
                                                  delete=False)
                proc = subprocess.Popen([sys.executable, *args], stdout=log,
                                        stderr=subprocess.STDOUT, cwd=REPO,
                                        preexec_fn=_idle_priority)
                config.stash[build.key] = (proc, Path(log.name))
                chain["pending"].remove(build.key)
                proc.wait()
        finally:
            chain["done"].set()

    threading.Thread(target=run, name="background-builds", daemon=True).start()


def pytest_unconfigure(config):
    import shutil

    chain = config.stash.get(BUILD_CHAIN, None)
    if chain is not None:
        chain["stop"].set()
    for build in BUILDS.values():
        started = config.stash.get(build.key, None)
        if started is not None and started[0].poll() is None:
            started[0].kill()
            started[0].wait()
    if FLOORS_DIR in config.stash:
        shutil.rmtree(config.stash[FLOORS_DIR], ignore_errors=True)


def wait_build(config, build: Build, timeout_s: float = 1800) -> str:
    """The background build's output once it is done (or the build, now, where none ran)."""
    import subprocess
    import sys
    import time

    chain = config.stash.get(BUILD_CHAIN, None)
    deadline = time.monotonic() + timeout_s
    if chain is not None:  # queued behind another build: wait for its turn to start
        while build.key in chain["pending"] and not chain["done"].is_set():
            assert time.monotonic() < deadline, f"build {build.cmd} did not start in time"
            time.sleep(1.0)
    started = config.stash.get(build.key, None)
    if started is None:
        run = subprocess.run([sys.executable, *_command(config, build)], capture_output=True,
                             text=True, timeout=timeout_s, cwd=REPO)
        assert run.returncode == 0, run.stderr[-4000:]
        return run.stdout
    proc, log = started
    proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    return text


@pytest.fixture(scope="session")
def rla_warm_starts(pytestconfig) -> str:
    """The RLAnything notebook's warm starts, once built (their build's output)."""
    return wait_build(pytestconfig, BUILDS["rla"])


@pytest.fixture(scope="session")
def floor_warm_starts(pytestconfig) -> str:
    """The cache folder holding the warm starts of the floor tests, once built."""
    output = wait_build(pytestconfig, BUILDS["floors"])
    assert "warm starts ready" in output, output[-4000:]
    return _floors_dir(pytestconfig)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from clawray.models.tiny import build_embedded_default

    return build_embedded_default()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The bundled real model (``bundled:smollm2``, converted by ``make setup``); skipped, saying
    why, where its registry package or the gguf reader is not installed."""
    import importlib.util

    from clawray.models.importer import ModelImportError, bundled_file
    from clawray.models.loader import ModelLoadError, resolve_model_path

    try:
        bundled_file("smollm2")
        if importlib.util.find_spec("gguf") is None:
            raise ModelImportError("the gguf package is not installed (make setup installs it)")
        return resolve_model_path("bundled:smollm2")
    except (ModelImportError, ModelLoadError) as e:
        pytest.skip(f"bundled:smollm2 is not available here: {e}")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from clawray.models.loader import load_tokenizer

    return load_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    from clawray.apps.launch import init_local_ray

    init_local_ray(num_cpus=6, include_dashboard=False, log_to_driver=False,
                   logging_level="WARNING", namespace="clawray-tests")
    yield ray
    # ray.shutdown() ends Serve's actors with the cluster; serve.shutdown() first would wait
    # ~30 s for the controller's graceful drain.
    ray.shutdown()


@pytest.fixture(scope="session")
def served_hf(ray_cluster, tiny_model_path, tmp_path_factory) -> Served:
    """The embedded default served by the transformers engine (app "clawray" at /); its
    replica also serves HTTP itself (serving.replica_http_port; tests/cpu/serve/
    test_replica_http_on_cpu.py), every other test goes through Serve's path."""
    return serve_app("clawray", "/", tmp_path_factory,
                     serving={"replica_http_port": free_port()})


@pytest.fixture(scope="session")
def served(served_hf) -> Served:
    """The session's main app (the transformers engine)."""
    return served_hf
