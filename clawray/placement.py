"""Where each part runs: the Ray options that ``placement`` settings give an actor, and the
check at start that the cluster has a node for every part it is about to start.

Without the check, a part asking for a label or resource no node has waits forever: Serve
keeps its replicas pending, a placement group never becomes ready. ``check_placement`` reads
the nodes (``ray.nodes()``'s dictionaries: ``Alive``, ``Resources`` totals, ``Labels``,
``NodeManagerAddress``) and says which part cannot be placed and what the nodes offer.
Ray-free: the callers pass the nodes in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from clawray.config import ClawRayConfig, PartPlacement

SERVING_PARTS = ("ingress", "policy", "judge")
TRAINING_PARTS = ("learner", "buffer", "env_runners")


class PlacementError(ValueError):
    """No node of the cluster can hold a part as configured."""


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """Whether node ``labels`` satisfy a Ray label selector (``value``, ``!value``,
    ``in(a,b)``, ``!in(a,b)``)."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        body = want[1:] if negate else want
        if body.startswith("in(") and body.endswith(")"):
            ok = have in {v.strip() for v in body[3:-1].split(",")}
        else:
            ok = have == body
        if ok == negate:
            return False
    return True


def actor_options(part: PartPlacement, resources: dict[str, float] | None = None
                  ) -> dict[str, Any]:
    """Ray actor options for one part: its custom resources (with ``resources`` the part
    already asked for) and its label selector; nothing when neither is set."""
    merged = {**(resources or {}), **part.resources}
    return {**({"resources": merged} if merged else {}),
            **({"label_selector": dict(part.labels)} if part.labels else {})}


def serving_placement(cfg: ClawRayConfig, part: str) -> PartPlacement:
    """The placement of serving deployment ``part`` (ingress, policy, judge). The replicas
    that hold an engine (policy, judge) add ``serving.replica_resources``; the colocated
    ingress holds the policy's engine, so the policy's settings apply under its own."""
    s, p = cfg.serving_cfg, cfg.placement_cfg
    own = getattr(p, part)
    if part == "ingress" and s.layout != "colocated":
        return own
    base = p.policy if part == "ingress" else PartPlacement()
    return PartPlacement(resources={**s.replica_resources, **base.resources, **own.resources},
                         labels={**base.labels, **own.labels},
                         max_per_node=own.max_per_node or base.max_per_node)


@dataclass
class Need:
    """What one part asks of the cluster: ``count`` actors of ``per_actor`` resources (CPU and
    GPU included), each on a node whose labels match ``labels``, at most ``per_node`` on one
    node (``None``: any number), or all on one node (``together``: STRICT_PACK)."""

    part: str
    per_actor: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)
    count: int = 1
    per_node: int | None = None
    together: bool = False

    def describe(self) -> str:
        where = f", labels {self.labels}" if self.labels else ""
        spread = (", all on one node" if self.together else
                  f", at most {self.per_node} per node" if self.per_node else "")
        return f"{self.count} × {self.per_actor}{where}{spread}"


def _needs(cfg: ClawRayConfig, parts: tuple[str, ...]) -> list[Need]:
    s, t, p = cfg.serving_cfg, cfg.training_cfg, cfg.placement_cfg
    engine = {"CPU": s.replica_num_cpus, **({"GPU": s.replica_num_gpus}
                                           if s.replica_num_gpus else {})}
    needs = []
    for part in ("ingress", "policy", "judge"):
        if part not in parts or (part == "policy" and s.layout == "colocated"):
            continue  # the colocated ingress holds the policy's engine
        pl = serving_placement(cfg, part)
        holds_engine = part != "ingress" or s.layout == "colocated"
        count = {"ingress": s.ingress_replicas, "policy": s.policy_replicas, "judge": 1}[part]
        needs.append(Need(part, {**(engine if holds_engine else {}), **pl.resources},
                          dict(pl.labels), count, pl.max_per_node))
    if "learner" in parts:
        needs.append(Need("learner", {"CPU": t.learner_num_cpus,
                                      **({"GPU": t.learner_num_gpus} if t.learner_num_gpus
                                         else {}), **p.learner.resources},
                          dict(p.learner.labels), t.num_learners,
                          1 if t.placement_strategy == "STRICT_SPREAD" else None,
                          together=t.placement_strategy == "STRICT_PACK"))
    if "buffer" in parts:
        needs.append(Need("buffer", dict(p.buffer.resources), dict(p.buffer.labels)))
    if "env_runners" in parts:
        e = cfg.environments_cfg
        needs.append(Need("env_runners", {"CPU": max(e.runner_num_cpus, 0.01),
                                          **p.env_runners.resources},
                          dict(p.env_runners.labels), e.num_runners))
    return needs


def _fits(node: dict[str, Any], need: Need, times: int = 1) -> bool:
    have = node.get("Resources") or {}
    return (selector_matches(need.labels, node.get("Labels") or {})
            and all(have.get(k, 0.0) + 1e-9 >= v * times
                    for k, v in need.per_actor.items() if v))


def _node_line(node: dict[str, Any]) -> str:
    res = {k: v for k, v in (node.get("Resources") or {}).items()
           if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    labels = {k: v for k, v in (node.get("Labels") or {}).items()
              if not k.startswith("ray.io/")}
    return f"{node.get('NodeManagerAddress', '?')} {res} labels {labels}"


def check_placement(cfg: ClawRayConfig, nodes: list[dict[str, Any]],
                    parts: tuple[str, ...] = SERVING_PARTS + TRAINING_PARTS) -> None:
    """Raise ``PlacementError`` naming every part in ``parts`` that no alive node of ``nodes``
    can hold (each actor on a node with its labels and, in total, its resources; enough such
    nodes for a part spread ``per_node`` at a time). Checks the nodes' totals, not what is
    free now: a part that fits waits for room as Ray's own scheduling does."""
    if not cfg.placement_cfg.check:
        return
    alive = [n for n in nodes if n.get("Alive", True)]
    problems = []
    for need in _needs(cfg, parts):
        if need.count < 1:
            continue
        if need.together:
            ok = any(_fits(n, need, need.count) for n in alive)
        else:
            eligible = sum(_fits(n, need) for n in alive)
            required = math.ceil(need.count / need.per_node) if need.per_node else 1
            ok = eligible >= required
        if not ok:
            problems.append(f"placement.{need.part}: the cluster cannot hold "
                            f"{need.describe()}")
    if problems:
        raise PlacementError("; ".join(problems) + ". Nodes: " +
                             "; ".join(_node_line(n) for n in alive) +
                             " (give nodes resources and labels with `ray start --resources "
                             "--labels`, or change the placement section: docs/deploy.md)")
