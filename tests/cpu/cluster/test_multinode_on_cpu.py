"""A simulated multi-node cluster (``ray.cluster_utils.Cluster``, in its own process:
``tests/support/multinode.py``): a node killed under a running vLLM replica leaves none of its
engine processes behind. Learner ranks and env runners across nodes are checked on two real
hosts (test_two_hosts_on_cpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.common import checks_of

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.own_cluster  # make test-long, not make test (README, "Tests")


@pytest.fixture(scope="module")
def multinode(tiny_model_path) -> dict[str, dict]:
    """The JSON line of each check, by name; the subprocess's stderr under ``"stderr"``."""
    # tiny_model_path builds the embedded model before the subprocess needs it.
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "multinode.py")],
                          capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    return checks_of(proc)


def test_killing_the_node_under_a_running_app_ends_its_engine_processes(multinode):
    """The replica dies with its raylet; clawray's watchdog then ends the replica's vLLM
    processes (with the watchdog disabled they were still running 120 s later: ``"left":
    {"engines": [2660, 2682]}``; with it, gone in 7 s)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (make setup installs it; see docs/vllm.md)")
    out = multinode.get("node_kill")
    assert out is not None, multinode["stderr"]
    shown = json.dumps(out)  # all of it (pytest cuts a dict's repr short)
    assert out["answered"] and out["replicas_on_node"] == 1, shown  # the app ran on that node
    assert out["engines"] and out["watchdogs"], shown  # vLLM's processes, watched
    assert out["left"]["replica"] == [], shown  # the replica died with its raylet
    assert out["left"]["engines"] == [], f"vLLM processes outlived their node: {shown}"
    assert out["left"]["watchdogs"] == [], shown


def test_the_cluster_process_exits_cleanly(multinode):
    assert multinode["stderr"]["rc"] == 0, multinode["stderr"]["tail"]
