"""LearnerGroup: 2 DeepSpeed ranks give the same update as 1 rank on the same data, on one
node (the shared test cluster). One rank per node of a simulated 2-node cluster:
``test_multinode_on_cpu.py``."""

from __future__ import annotations

import pytest

from clawray.config import TrainingConfig
from tests.support.learner_data import sampled_rows
from tests.support.weights_compare import update_distance

pytestmark = pytest.mark.ray


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
    # Adam's first step is ~lr * sign(grad): the few elements whose gradient is float noise
    # (off_frac, here ~5e-6) may step the other way in another summation order, and each such
    # flip costs ~2 lr, so rel_l2 ~ 2 sqrt(off_frac) at most (a 1e-3 bound failed on a fresh
    # machine at rel_l2 0.00102, off_frac 5e-6). A rank's share of the batch missing would
    # flip the sign of many elements' gradients, not a handful.
    assert d["off_frac"] < 1e-4 and d["rel_l2"] < 1e-2, d
    assert metrics[1]["loss"] == pytest.approx(metrics[2]["loss"], rel=1e-5)
    assert metrics[1]["tokens"] == metrics[2]["tokens"]
    assert metrics[2]["rows"] == table.num_rows  # the ranks' shares add up to the batch
