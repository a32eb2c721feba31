"""EnvRunners over a simulated 2-node cluster: SPREAD places the 2 runners on both nodes, each
plays its group through the app's policy, and every step lands in the env buffer as one row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_two_runners_spread_over_two_nodes_play_and_write_their_groups(tiny_model_path):
    # tiny_model_path builds the embedded model before the subprocess needs it.
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    # runner_num_cpus 0.25: SPREAD round-robins actors that request resources; zero-resource
    # actors go to a random node instead (see multinode_envs.py).
    proc = subprocess.run([sys.executable, str(TESTS / "multinode_envs.py"), "180", "0.25"],
                          capture_output=True, text=True, timeout=400, env=env, cwd=TESTS.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["nodes"] == 2 and out["runners"] == 2
    assert out["runner_nodes"] == 2, out  # one runner per node
    assert out["unfinished"] == 0 and out["runner_restarts"] == 0, out
    assert out["groups"] == out["expected_groups"] == out["reported"], out
    assert out["episodes"] == out["groups"] * out["group_size"], out
    assert out["steps"] >= out["episodes"]
    assert out["rows"] == out["steps"] == out["wal_rows"], out
