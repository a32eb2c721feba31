"""Run as a script by test_learner_group_on_cpu.py: a simulated 2-node cluster
(``ray.cluster_utils.Cluster``), one learner rank per node (STRICT_SPREAD), compared with one
rank on the same data. Prints one JSON line. A separate process, because a test session shares
one Ray cluster and this one needs its own."""

from __future__ import annotations

import json
import sys

import ray
from ray.cluster_utils import Cluster

from clawray.config import TrainingConfig
from clawray.learner.group import LearnerGroup
from learner_data import sampled_rows
from weights_compare import update_distance


def main(model_path: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        table = sampled_rows(model_path, 8, seed=5, max_new=10)
        payloads, nodes = {}, {}
        for n, strategy in ((1, "PACK"), (2, "STRICT_SPREAD")):
            cfg = TrainingConfig(lr=1e-3, zero_stage=1, num_learners=n, learner_num_cpus=1,
                                 placement_strategy=strategy)
            group = LearnerGroup(model_path, cfg, setup_timeout_s=120)
            nodes[n] = sorted(set(ray.get([w.node_id.remote() for w in group.workers])))
            group.update(table)
            payloads[n] = group.sync_payload()[1]
            group.shutdown()
        print(json.dumps({"nodes": len(ray.nodes()), "rank_nodes": len(nodes[2]),
                          **update_distance(model_path, payloads[1], payloads[2])}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
