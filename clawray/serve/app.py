"""``build_app(config)``: the Ray Serve application, used by ``deployments/*.yaml``.

    applications:
      - name: clawray
        import_path: clawray.serve.app:build_app
        args: {model: {path: embedded:tiny}, serving: {default_turn_type: main}}

``args`` is a clawray config (the same keys as a clawray YAML file), or ``{config: path}``.

The app holds a ``JudgeServer`` when something calls it: the live PRM judge
(``judge.backend: server`` with the ``hub`` record sink) or RLAnything's step-wise reward model
(``training.mode: rlanything`` with ``rlanything.rm_backend: server``; its model is
``judge_model_path``). Callers reach it with
``serve.get_deployment_handle("JudgeServer", app_name=app)``.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from clawray.config import ClawRayConfig
from clawray.serve.judge_server import JudgeServer
from clawray.serve.ingress import Ingress
from clawray.serve.policy_server import PolicyServer
from clawray.serve.routing import ROUTER_CLASS


def build_app(args: dict[str, Any] | ClawRayConfig | None = None) -> Application:
    if isinstance(args, ClawRayConfig):
        cfg = args
    elif args and set(args) == {"config"}:
        cfg = ClawRayConfig.from_yaml(args["config"])
    else:
        cfg = ClawRayConfig.from_dict(args or {})
    cfg.validate()
    s = cfg.serving_cfg
    data = cfg.to_dict()
    actor = {"num_cpus": s.replica_num_cpus, "num_gpus": s.replica_num_gpus}
    ingress = Ingress.options(num_replicas=s.ingress_replicas,
                              max_ongoing_requests=s.max_ongoing_requests)
    judge = None
    live_judge = cfg.judge_cfg.backend == "server" and "hub" in s.record_sink
    step_rm = (cfg.training_cfg.mode == "rlanything"
               and cfg.rlanything_cfg.rm_backend == "server")
    if live_judge or step_rm:
        # Bound into the ingress only to keep it in the app; callers find it by name.
        judge = JudgeServer.options(ray_actor_options=actor).bind(data)
    if s.layout == "colocated":
        return ingress.options(ray_actor_options=actor).bind(data, None, judge)
    routing = {}
    if s.session_affinity:  # a session's turns go to the replica that has its prefix
        routing["request_router_config"] = RequestRouterConfig(request_router_class=ROUTER_CLASS)
    policy = PolicyServer.options(num_replicas=s.policy_replicas,
                                  max_ongoing_requests=s.max_ongoing_requests,
                                  ray_actor_options=actor, **routing)
    return ingress.options(ray_actor_options={"num_cpus": 0}).bind(data, policy.bind(data), judge)
