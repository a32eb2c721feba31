"""``bench/chaos.py``'s two-host parts that need no cluster: the per-host-loss figures from a
timeline, the two-host config and the options."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.common import load_file

CHAOS = Path(__file__).resolve().parents[2] / "bench" / "chaos.py"


@pytest.fixture(scope="module")
def chaos():
    return load_file(CHAOS, "chaos_bench")


def test_host_losses_counts_failures_and_stalls_between_the_loss_and_the_recovery(chaos):
    lost = 1000.0
    events = [{"lost": lost, "parts_on_b": ["SessionHub", "ServeReplica:chaos:Ingress"],
               "declared_dead": lost + 29.6, "rejoining": lost + 45.0, "rejoined": lost + 52.0,
               "replicas_back": lost + 80.0}]
    latencies = [(lost - 20 + i, 0.5) for i in range(19)]  # before: typical 0.5 s
    latencies += [(lost + 31.0, 30.5),  # in flight on b at the loss: stalled
                  (lost + 40.0, 0.6),   # on a: fine
                  (lost + 79.0, 6.0),   # slow enough to count (> 5 s and > 10 x 0.5 s)
                  (lost + 85.0, 0.5),   # started after the recovery: outside
                  (lost + 200.0, 60.0)]  # ended long after, started after the recovery
    failures = [(lost - 50, lost - 49, "APIError"),  # before the loss: not this loss's
                (lost - 1, lost + 29.5, "APIError"),  # cut in flight
                (lost + 5, lost + 29.3, "InternalServerError"),
                (lost + 90, lost + 91, "APIError")]  # after the recovery
    unfinished = [(lost + 5, lost + 30.0)]

    (h,) = chaos.host_losses(events, latencies, failures, unfinished)

    assert h["declared_dead_s"] == 29.6 and h["rejoined_s"] == 52.0 and h["recovered_s"] == 80.0
    assert h["failed_attempts"] == 2
    assert h["failed_errors"] == {"APIError": 1, "InternalServerError": 1}
    assert h["requests_failed"] == 1
    assert h["typical_s"] == 0.5
    assert h["completed_in_window"] == 3
    assert h["stalled"] == 2 and h["stalled_until_s"] == 79.0
    assert h["parts_on_b"] == events[0]["parts_on_b"]


def test_a_host_loss_not_recovered_counts_to_the_end_and_says_so(chaos):
    events = [{"lost": 10.0, "parts_on_b": []}]
    (h,) = chaos.host_losses(events, [(50.0, 1.0)], [(20.0, 21.0, "ReadTimeout")], [])
    assert h["declared_dead_s"] is None and h["recovered_s"] is None
    assert h["failed_attempts"] == 1 and h["completed_in_window"] == 1
    assert h["stalled"] == 0 and h["stalled_until_s"] is None


def test_two_hosts_put_one_ingress_replica_on_each_and_the_buffer_on_a(chaos, tmp_path):
    one = chaos.make_config(tmp_path, 8000)
    two = chaos.make_config(tmp_path, 8000, hosts=2)
    assert two.placement_cfg.policy.max_per_node == 1
    assert two.placement_cfg.buffer.labels == {"clawray-host": "a"}
    assert one.placement_cfg.policy.max_per_node != 1
    assert two.serving_cfg.ingress_replicas == 2


def test_options(chaos):
    assert chaos.parse_args([]).hosts == 1
    args = chaos.parse_args(["--hosts", "2", "--host-down-s", "30", "--quick"])
    assert args.hosts == 2 and args.host_down_s == 30 and args.duration_s == 33
    with pytest.raises(SystemExit):
        chaos.parse_args(["--hosts", "3"])
    assert set(chaos.HOST_KINDS) == set(chaos.KINDS) | {"host"}
