"""LearnerGroup: 2 DeepSpeed ranks give the same update as 1 rank on the same data, on one
node (the shared test cluster) and with one rank per node of a simulated 2-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clawray.config import TrainingConfig
from learner_data import sampled_rows
from weights_compare import update_distance

pytestmark = pytest.mark.ray
TESTS = Path(__file__).resolve().parent


def test_two_ranks_update_like_one(ray_cluster, tiny_model_path):
    from clawray.learner.group import LearnerGroup

    table = sampled_rows(tiny_model_path, 10, seed=7, max_new=10)
    payloads, metrics = {}, {}
    for n in (1, 2):
        cfg = TrainingConfig(lr=1e-3, zero_stage=2, micro_batches=2, num_learners=n,
                             learner_num_cpus=0.5)
        group = LearnerGroup(tiny_model_path, cfg, setup_timeout_s=120)
        try:
            metrics[n] = group.update(table)
            payloads[n] = group.sync_payload()[1]
        finally:
            group.shutdown()
    d = update_distance(tiny_model_path, payloads[1], payloads[2])
    assert d["update_l2"] > 0.1  # the step did move the weights
    assert d["rel_l2"] < 1e-3 and d["off_frac"] < 1e-4, d
    assert metrics[1]["loss"] == pytest.approx(metrics[2]["loss"], rel=1e-5)
    assert metrics[1]["tokens"] == metrics[2]["tokens"]
    assert metrics[2]["rows"] == table.num_rows  # the ranks' shares add up to the batch


def test_ranks_on_two_nodes_update_like_one(tiny_model_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(TESTS / "multinode_learner.py"),
                           str(tiny_model_path)], capture_output=True, text=True, timeout=400,
                          env=env, cwd=TESTS.parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1])
    assert out["nodes"] == 2 and out["rank_nodes"] == 2
    assert out["update_l2"] > 0.1
    assert out["rel_l2"] < 1e-3 and out["off_frac"] < 1e-4, out
