"""clawray on two real hosts: two network namespaces joined by a veth pair, a Ray head in one
and a worker in the other (``tests/support/twohost.py``, in its own process, one cluster for
the file). Ray's traffic between them crosses the link, and a host can be lost on its own,
which ``ray.cluster_utils.Cluster`` (every node on one address) cannot show.

Found by it: gloo advertised the address the host name resolves to (127.0.0.1 here, 127.0.1.1
on many machines), so learner ranks on two hosts could not connect; the learner now names the
interface of the node's Ray address (``clawray/learner/learner.py::init_distributed``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import loopback_ns
from tests.support.common import checks_of

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.own_cluster  # make test-long, not make test (README, "Tests")
TOLERANCE = 1e-4  # served vs learner log-probs: the same torch kernels (transformers engine)


def _can_make_hosts() -> str | None:
    if os.geteuid() != 0:
        return "making network namespaces and a veth pair needs root"
    if not loopback_ns.namespaces_work():
        return "this machine does not allow network namespaces"
    return None


@pytest.fixture(scope="module")
def hosts(tiny_model_path) -> dict[str, dict]:
    """The JSON line of each check, by name; the harness's stderr under ``"stderr"``."""
    why = _can_make_hosts()
    if why:
        pytest.skip(why)
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "support" / "twohost.py"),
                           str(tiny_model_path), "1200"],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=REPO)
    return checks_of(proc)


def _get(hosts: dict, name: str) -> dict:
    out = hosts.get(name)
    assert out is not None, hosts["stderr"]["tail"]
    return out


def test_two_hosts_on_their_own_addresses_exchange_objects(hosts):
    out = _get(hosts, "hosts")
    nodes = out["nodes"]
    assert set(nodes) == {"a", "b"} and nodes["a"] != nodes["b"], out
    assert all(ip.startswith("10.213.") for ip in nodes.values()), out
    assert out["driver_ip"] == nodes["a"]  # the driver is a client on host a
    assert out["array_ok"] and out["bytes"] == 16_000_000  # made on b, read on a


def test_learner_ranks_on_two_hosts_update_like_one_rank(hosts):
    out = _get(hosts, "learner")
    assert out["rank_addresses"] == sorted(_get(hosts, "hosts")["nodes"].values()), out
    assert out["update_l2"] > 0.1
    # as on the simulated cluster (test_multinode_on_cpu.py): a few float-noise sign flips
    assert out["off_frac"] < 1e-4 and out["rel_l2"] < 1e-2, out
    one, two = out["metrics"]["1"], out["metrics"]["2"]
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5) and one["tokens"] == two["tokens"]
    assert two["rows"] == out["rows"]


def test_the_live_loop_runs_across_hosts_and_trains_every_row_once(hosts):
    out = _get(hosts, "live")
    shown = json.dumps(out)
    # placement: a replica on each host, the buffer on a, the learner rank on b
    assert out["replica_hosts"] == ["a", "b"], shown
    assert out["buffer_host"] == ["a"] and out["learner_hosts"] == ["b"], shown
    its = out["iterations"]
    trained = sum(i["samples"] or 0 for i in its)
    assert trained == out["turns"], shown  # every judged turn, taken from a, trained on b
    assert all(not i["samples_repeated"] for i in its), shown
    assert its[-1]["samples"] == 0, shown  # nothing left: none trained twice
    b = out["buffer"]  # the buffer on a: every row added was taken and acknowledged once
    assert b["rows_added"] == b["rows_taken"] == b["rows_acked"] == trained, shown
    assert b["rows_redelivered"] == 0 and b["duplicates"] == 0 and b["available"] == 0, shown
    # the weights went from the rank on b to both replicas, the one on b's own host included
    v = out["versions"]
    assert v["published"] >= 1 and len(v["replicas"]) == 2, shown
    assert set(v["replicas"].values()) == {v["published"]}, shown
    assert out["max_logprob_diff"] < TOLERANCE, shown


def test_env_runners_on_both_hosts_play_and_write_every_step(hosts):
    out = _get(hosts, "envs")
    assert out["nodes"] == 2 and out["runners"] == 2 and out["runner_nodes"] == 2, out
    assert out["unfinished"] == 0 and out["runner_restarts"] == 0, out
    assert out["groups"] == out["expected_groups"] == out["reported"], out
    assert out["episodes"] == out["groups"] * out["group_size"], out
    assert out["rows"] == out["steps"] == out["wal_rows"] >= out["episodes"], out


def test_losing_host_b_under_load(hosts):
    out = _get(hosts, "host_loss")
    shown = json.dumps(out)
    assert out["before"] > 0 and out["before_failed"] == 0, shown
    # no request hangs: every one ended, with an answer or an error the client could see
    assert out["unfinished_clients"] == 0, shown
    assert "Timeout" not in shown, shown
    # Ray declares the node dead; the replica on host a goes on serving, and new judged
    # sessions go through it
    assert out["declared_dead_s"] is not None, shown
    assert out["after_ok_once_declared"] > 0, shown
    assert out["turns_after"] == 4, shown
    assert out["replica_hosts_after"] == ["a"], shown
    # every answered turn was recorded
    assert out["recorded"] >= out["answered"] > 0, shown
    # the trainer, whose rank was on host b, stops and says how to resume
    t = out["trainer"]
    assert not t["ok"] and t["error"].startswith("LearnerLost: a learner rank died"), shown
    assert "resumes from the last checkpoint" in t["error"], shown
    # its batch was not acknowledged: the buffer on host a offers it again; no row is lost
    rows = out["rows"]
    assert rows["leases_expired"] >= 1 and rows["available"] > 0, shown
    assert rows["lost"] == 0 and rows["rows_acked"] < rows["rows_added"], shown


def test_the_harness_exits_cleanly_and_leaves_no_namespace(hosts):
    assert hosts["stderr"]["rc"] == 0, hosts["stderr"]["tail"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "crh" not in left, left
