"""``build_app(config)``: the Ray Serve application, used by ``deployments/*.yaml``.

    applications:
      - name: clawray
        import_path: clawray.serve.app:build_app
        args: {model: {path: embedded:tiny}, serving: {default_turn_type: main}}

``args`` is a clawray config (the same keys as a clawray YAML file), or ``{config: path}``.

The app holds a ``JudgeServer`` when something calls it: the live PRM judge
(``judge.backend: server``, or ``judge.teacher: server`` for OPD's teacher log-probs, with
the ``hub`` record sink) or RLAnything's step-wise reward model
(``training.mode: rlanything`` with ``rlanything.rm_backend: server``; its model is
``judge_model_path``). Callers reach it with
``serve.get_deployment_handle("JudgeServer", app_name=app)``.

Security: deployments receive the SHA-256 digests of the API keys, never the keys (init args
are visible in ``serve status`` and the dashboard); and the app is refused when the running
Serve instance binds beyond loopback (``http_options.host`` of a Serve config, or
``serve.start``) while no key is set — the same rule ``serving.host`` is checked by.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from clawray.config import ClawRayConfig
from clawray.judging.backends import needs_server
from clawray.models.loader import check_teacher_tokenizer
from clawray.placement import actor_options, check_placement, serving_placement
from clawray.serve.judge_server import JudgeServer
from clawray.serve.ingress import Ingress
from clawray.serve.policy_server import PolicyServer
from clawray.serve.routing import ROUTER_CLASS


def deployment_args(cfg: ClawRayConfig) -> dict[str, Any]:
    """The config the deployments receive: keys replaced by their digests."""
    data = cfg.to_dict()
    serving = data["serving"]
    serving.update(api_keys=[], api_keys_file=None, api_key_digests=cfg.serving_cfg.key_digests())
    return data


def serve_http_host() -> str | None:
    """The host the running Serve instance's HTTP proxy (and direct ingress) binds, if one runs
    (``serve run config.yaml`` starts it from the YAML's ``http_options`` first)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client(raise_if_no_controller_running=False)
        return None if client is None else str(client.http_config.host)
    except Exception:  # noqa: BLE001 - a private API: without it, serving.host's check stands
        return None


def build_app(args: dict[str, Any] | ClawRayConfig | None = None) -> Application:
    if isinstance(args, ClawRayConfig):
        cfg = args
    elif args and set(args) == {"config"}:
        cfg = ClawRayConfig.from_yaml(args["config"])
    else:
        cfg = ClawRayConfig.from_dict(args or {})
    cfg.check()
    s = cfg.serving_cfg
    host = serve_http_host()
    problem = s.bind_problem(host, "Serve's http_options.host") if host is not None else None
    if problem:
        raise ValueError(problem)
    check_teacher_tokenizer(cfg)
    data = deployment_args(cfg)
    engine = {"num_cpus": s.replica_num_cpus, "num_gpus": s.replica_num_gpus}

    def placed(part: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``part``'s ray_actor_options placement and its Serve spread option."""
        pl = serving_placement(cfg, part)
        return actor_options(pl), ({"max_replicas_per_node": pl.max_per_node}
                                   if pl.max_per_node else {})
    affine = {}
    if s.session_affinity:  # a session's turns go to the replica that has its prefix
        affine["request_router_config"] = RequestRouterConfig(request_router_class=ROUTER_CLASS)
    ingress_place, ingress_spread = placed("ingress")
    ingress = Ingress.options(num_replicas=s.ingress_replicas,
                              max_ongoing_requests=s.max_ongoing_requests, **ingress_spread,
                              **(affine if s.layout == "colocated" else {}))
    judge = None
    live_judge = needs_server(cfg.judge_cfg) and "hub" in s.record_sink
    step_rm = (cfg.training_cfg.mode == "rlanything"
               and cfg.rlanything_cfg.rm_backend == "server")
    if ray.is_initialized():  # a part no node can hold would stay pending forever
        check_placement(cfg, ray.nodes(),
                        ("ingress", "policy") + (("judge",) if live_judge or step_rm else ()))
    if live_judge or step_rm:
        # Bound into the ingress only to keep it in the app; callers find it by name.
        # Serve's default max_ongoing_requests (5) would queue calls in the handle's router,
        # out of the engine's sight and cancellation; the engine's own scheduler queues them.
        judge_place, judge_spread = placed("judge")
        judge = JudgeServer.options(ray_actor_options={**engine, **judge_place},
                                    max_ongoing_requests=s.max_ongoing_requests,
                                    **judge_spread).bind(data)
    if s.layout == "colocated":  # the ingress holds the engine
        return ingress.options(ray_actor_options={**engine, **ingress_place}
                               ).bind(data, None, judge)
    policy_place, policy_spread = placed("policy")
    policy = PolicyServer.options(num_replicas=s.policy_replicas,
                                  max_ongoing_requests=s.max_ongoing_requests,
                                  ray_actor_options={**engine, **policy_place}, **affine,
                                  **policy_spread)
    return ingress.options(ray_actor_options={"num_cpus": 0, **ingress_place}
                           ).bind(data, policy.bind(data), judge)
