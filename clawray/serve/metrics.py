"""The ingress's Prometheus series (Ray metrics, scraped with the rest of Ray's; Prometheus
names get Ray's ``ray_`` prefix): what the operator's dashboard needs about serving
(``deployments/grafana/clawray.json``).

    clawray_requests_total{app, api, code}          every API request, by HTTP status
    clawray_request_latency_s{app, api, stream}      seconds to the whole answer (stream=0) or
                                                    to the first streamed event (stream=1)
    clawray_turns_total{app, policy_version, finish} every recorded turn, by the policy version
                                                    that served it and how it ended

Outside a Ray worker (the ingress mounted in a plain process by a test or benchmark) every
call is a no-op.
"""

from __future__ import annotations

from typing import Any, Callable

LATENCY_BOUNDARIES_S = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]


def _ray_factory() -> Callable[..., Any] | None:
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    from ray.util.metrics import Counter, Histogram

    def factory(kind: str, name: str, description: str, tag_keys: tuple) -> Any:
        if kind == "histogram":
            return Histogram(name, description=description, boundaries=LATENCY_BOUNDARIES_S,
                             tag_keys=tag_keys)
        return Counter(name, description=description, tag_keys=tag_keys)
    return factory


class ServingMetrics:
    """``factory(kind, name, description, tag_keys)`` makes a metric (tests pass their own)."""

    def __init__(self, app: str, factory: Callable[..., Any] | None = None) -> None:
        factory = factory or _ray_factory()
        self.app = app
        self.on = factory is not None
        if not self.on:
            return
        self.requests = factory("counter", "clawray_requests_total",
                                "API requests, by API and HTTP status", ("app", "api", "code"))
        self.latency = factory("histogram", "clawray_request_latency_s",
                               "seconds to the answer, or to the first streamed event",
                               ("app", "api", "stream"))
        self.turns = factory("counter", "clawray_turns_total",
                             "recorded turns, by serving policy version and finish reason",
                             ("app", "policy_version", "finish"))

    def request(self, api: str, code: int, seconds: float | None, stream: bool) -> None:
        if not self.on:
            return
        self.requests.inc(1, tags={"app": self.app, "api": api, "code": str(code)})
        if seconds is not None:
            self.latency.observe(seconds, tags={"app": self.app, "api": api,
                                                "stream": "1" if stream else "0"})

    def turn(self, policy_version: int, finish: str | None) -> None:
        if self.on:
            self.turns.inc(1, tags={"app": self.app, "policy_version": str(policy_version),
                                    "finish": finish or "none"})


class CountingSink:
    """A record sink that counts each turn (``ServingMetrics.turn``) and hands it on."""

    def __init__(self, inner: Any, metrics: ServingMetrics) -> None:
        self.inner, self.metrics = inner, metrics

    def put(self, record: Any) -> None:
        self.metrics.turn(record.policy_version, record.finish_reason)
        self.inner.put(record)

    def __getattr__(self, name: str) -> Any:  # flush, close, ... of the wrapped sink
        return getattr(self.inner, name)
