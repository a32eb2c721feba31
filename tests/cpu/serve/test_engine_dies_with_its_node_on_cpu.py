"""A replica's vLLM processes do not outlive their Ray node.

A node of its own (tests/support/node_app.py) serves the embedded default with vLLM; the test
kills that node abruptly (SIGKILL to the process group of its driver, raylet and GCS: a crash
or ``kill -9`` of ``serve run``). The replica dies with its raylet; before clawray's watchdog
(clawray/inference/watchdog.py) its ``VLLM::EngineCore`` and ``VLLM::Worker`` stayed alive
under init, ~3 GB each pair, for as long as the machine ran."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.common import REPO

pytestmark = pytest.mark.ray


def _running(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_killing_the_node_under_a_running_app_ends_its_engine_processes(tiny_model_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (make setup installs it; see docs/vllm.md)")
    node = subprocess.Popen([sys.executable, "-m", "tests.support.node_app"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    info = {}
    try:
        line = node.stdout.readline()  # the app answered a turn
        assert line, f"the node's app did not start (exit code {node.poll()})"
        info = json.loads(line)
        assert info["engines"], info  # the replica runs vLLM's engine processes
        assert info["ray"] and info["watchdogs"], info
        os.killpg(node.pid, signal.SIGKILL)  # the driver, its raylet and its GCS at once
        for pid in info["ray"]:  # wherever Ray put them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.wait()
        deadline = time.monotonic() + 120
        everything = info["engines"] + info["watchdogs"] + info["ray"]
        while _running(everything) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _running(info["ray"]), "the node's raylet or GCS survived SIGKILL"
        assert not _running(info["engines"]), (
            f"vLLM processes {_running(info['engines'])} outlived their node")
        assert not _running(info["watchdogs"])
    finally:
        import psutil

        for pid in _running(info.get("engines", []) + info.get("watchdogs", [])) + [node.pid]:
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        if node.poll() is None:
            node.wait()
