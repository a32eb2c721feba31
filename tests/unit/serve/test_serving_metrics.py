"""The ingress's Prometheus series (clawray/serve/metrics.py) and the Grafana dashboard that
reads them (deployments/grafana/clawray.json); the series a running app exports are checked
against the dashboard in tests/cpu/training/test_trainer_on_cpu.py."""

from __future__ import annotations

import json
import types
from collections import defaultdict

from clawray.serve.metrics import CountingSink, ServingMetrics
from tests.support.metrics import DASHBOARD, dashboard_series


class Fake:
    def __init__(self, kind, name, description, tag_keys):
        self.kind, self.name, self.tag_keys = kind, name, tag_keys
        self.values = defaultdict(list)

    def _tags(self, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        return tuple(sorted(tags.items()))

    def inc(self, n, tags):
        self.values[self._tags(tags)].append(n)

    def observe(self, x, tags):
        self.values[self._tags(tags)].append(x)


def test_requests_latencies_and_turns_are_counted_by_their_labels():
    made = {}

    def factory(kind, name, description, tag_keys):
        made[name] = Fake(kind, name, description, tag_keys)
        return made[name]

    m = ServingMetrics("app1", factory)
    m.request("chat completion", 200, 0.25, stream=False)
    m.request("chat completion", 200, 0.05, stream=True)
    m.request("message", 401, None, stream=False)  # refused before any work: not timed
    inner = types.SimpleNamespace(got=[], put=lambda r: inner.got.append(r), close=lambda: "closed")
    sink = CountingSink(inner, m)
    record = types.SimpleNamespace(policy_version=3, finish_reason="stop")
    sink.put(record)
    assert inner.got == [record] and sink.close() == "closed"  # handed on, the rest delegated
    req = made["clawray_requests_total"].values
    assert req[(("api", "chat completion"), ("app", "app1"), ("code", "200"))] == [1, 1]
    assert req[(("api", "message"), ("app", "app1"), ("code", "401"))] == [1]
    lat = made["clawray_request_latency_s"].values
    assert lat[(("api", "chat completion"), ("app", "app1"), ("stream", "0"))] == [0.25]
    assert lat[(("api", "chat completion"), ("app", "app1"), ("stream", "1"))] == [0.05]
    assert made["clawray_turns_total"].values == {
        (("app", "app1"), ("finish", "stop"), ("policy_version", "3")): [1]}


def test_the_dashboard_is_grafana_json_whose_panels_each_query_prometheus():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "clawray" and {v["name"] for v in dash["templating"]["list"]} == \
        {"datasource", "app"}
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    assert all(p["targets"] and all(t["expr"] for t in p["targets"]) for p in panels)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    # the serving series this module defines are on it
    assert {"ray_clawray_requests_total", "ray_clawray_request_latency_s_bucket",
            "ray_clawray_turns_total"} <= dashboard_series()
