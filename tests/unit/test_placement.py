"""Placement: Ray options from the config's placement section, and the start check that
refuses a part no node of the cluster can hold (Ray itself would leave it pending forever)."""

from __future__ import annotations

import pytest

from clawray.config import ClawRayConfig, ConfigError
from clawray.placement import (PlacementError, actor_options, check_placement,
                               selector_matches)


def node(ip: str, cpus: float = 2, alive: bool = True, gpus: float = 0, **labels: str) -> dict:
    resources = {"CPU": cpus, "memory": 1e9, f"node:{ip}": 1.0,
                 **({"GPU": gpus} if gpus else {})}
    return {"NodeManagerAddress": ip, "Alive": alive, "Resources": resources,
            "Labels": {"ray.io/node-id": ip, **labels}}


@pytest.mark.parametrize("selector, labels, ok", [
    ({}, {}, True),
    ({"host": "a"}, {"host": "a"}, True),
    ({"host": "a"}, {"host": "b"}, False),
    ({"host": "a"}, {}, False),
    ({"host": "!a"}, {"host": "b"}, True),
    ({"host": "!a"}, {}, True),
    ({"host": "!a"}, {"host": "a"}, False),
    ({"host": "in(a, b)"}, {"host": "b"}, True),
    ({"host": "in(a,b)"}, {"host": "c"}, False),
    ({"host": "!in(a,b)"}, {"host": "c"}, True),
    ({"host": "!in(a,b)"}, {"host": "a"}, False),
    ({"host": "a", "pool": "gpu"}, {"host": "a", "pool": "cpu"}, False),
])
def test_label_selectors_match_as_rays_do(selector, labels, ok):
    assert selector_matches(selector, labels) is ok


def test_actor_options_carry_resources_and_labels_only_when_set():
    cfg = ClawRayConfig().placement(policy={"resources": {"serving": 1},
                                            "labels": {"host": "a"}})
    assert actor_options(ClawRayConfig().placement_cfg.policy) == {}
    assert actor_options(cfg.placement_cfg.policy, {"old": 2}) == {
        "resources": {"old": 2, "serving": 1}, "label_selector": {"host": "a"}}
    for bad, why in (({"CPU": 1}, "custom resources only"), ({"x": -1}, ">= 0")):
        with pytest.raises(ConfigError, match=why):
            ClawRayConfig().placement(learner={"resources": bad})


def test_the_default_placement_fits_a_single_node():
    check_placement(ClawRayConfig(), [node("10.0.0.1")])


def test_a_label_no_node_has_is_refused_naming_the_part_and_the_nodes():
    cfg = ClawRayConfig().placement(learner={"labels": {"host": "gpu-pool"}})
    nodes = [node("10.0.0.1", host="a"), node("10.0.0.2", host="b")]
    with pytest.raises(PlacementError) as e:
        check_placement(cfg, nodes)
    msg = str(e.value)
    assert "placement.learner" in msg and "gpu-pool" in msg
    assert "10.0.0.1" in msg and "'host': 'a'" in msg and "ray.io/node-id" not in msg
    assert "placement.policy" not in msg  # only the part that cannot be placed
    check_placement(cfg, nodes + [node("10.0.0.3", host="gpu-pool")])
    check_placement(cfg, nodes, parts=("ingress", "policy"))  # the serving parts fit
    check_placement(cfg.placement(check=False), nodes)  # an autoscaling cluster: off


def test_replicas_spread_one_per_node_need_as_many_nodes():
    cfg = ClawRayConfig().serving(layout="split", policy_replicas=2, replica_num_cpus=1) \
        .placement(policy={"max_per_node": 1})
    with pytest.raises(PlacementError, match="placement.policy.*at most 1 per node"):
        check_placement(cfg, [node("10.0.0.1", cpus=4)], parts=("policy",))
    check_placement(cfg, [node("10.0.0.1"), node("10.0.0.2")], parts=("policy",))
    # a dead node does not count
    with pytest.raises(PlacementError):
        check_placement(cfg, [node("10.0.0.1"), node("10.0.0.2", alive=False)],
                        parts=("policy",))


def test_learner_strategies_need_distinct_nodes_or_one_node_for_all_ranks():
    spread = ClawRayConfig().training(num_learners=2, learner_num_cpus=1,
                                      placement_strategy="STRICT_SPREAD")
    with pytest.raises(PlacementError, match="placement.learner"):
        check_placement(spread, [node("10.0.0.1", cpus=8)], parts=("learner",))
    check_placement(spread, [node("10.0.0.1", cpus=1), node("10.0.0.2", cpus=1)],
                    parts=("learner",))
    pack = spread.copy_with(training={"placement_strategy": "STRICT_PACK"})
    with pytest.raises(PlacementError, match="all on one node"):
        check_placement(pack, [node("10.0.0.1", cpus=1), node("10.0.0.2", cpus=1)],
                        parts=("learner",))
    check_placement(pack, [node("10.0.0.1", cpus=2)], parts=("learner",))
    gpu = ClawRayConfig().training(learner_num_gpus=1)
    with pytest.raises(PlacementError, match="'GPU': 1"):
        check_placement(gpu, [node("10.0.0.1")], parts=("learner",))
    check_placement(gpu, [node("10.0.0.1", gpus=1)], parts=("learner",))


def test_build_app_places_replicas_and_refuses_what_the_cluster_cannot_hold(monkeypatch):
    from clawray.serve import app

    cfg = ClawRayConfig().placement(policy={"resources": {"serving": 1},
                                            "labels": {"host": "b"}, "max_per_node": 1})
    monkeypatch.setattr(app.ray, "is_initialized", lambda: False)  # no cluster to check yet
    built = app.build_app(cfg)  # colocated (the default): the ingress holds the engine
    opts = built._bound_deployment.ray_actor_options
    assert opts["resources"] == {"serving": 1} and opts["label_selector"] == {"host": "b"}
    assert built._bound_deployment._replica_config.max_replicas_per_node == 1
    split = app.build_app(cfg.copy_with(serving={"layout": "split"}))
    assert split._bound_deployment.ray_actor_options.get("label_selector") is None
    policy = split._bound_deployment.init_args[1]
    assert policy._bound_deployment.ray_actor_options["label_selector"] == {"host": "b"}
    monkeypatch.setattr(app.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(app.ray, "nodes", lambda: [node("10.0.0.1", host="a")])
    with pytest.raises(PlacementError, match="placement.ingress"):
        app.build_app(cfg)
