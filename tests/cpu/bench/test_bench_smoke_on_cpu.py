"""Quick runs of the benchmarks. ``bench/serving.py`` for the rows that need no Ray: the
in-process floor (a) and the peer proxy design (b), whose two uvicorn servers really start and
serve over loopback (the Ray Serve rows need clusters of their own and belong to the full
benchmark only). ``bench/learner.py --quick``, ``bench/envs.py --quick`` and
``bench/chaos.py --quick`` whole, each in a subprocess with its own Ray: marked
``own_cluster``, run by ``make test-long`` and not by ``make test``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


@pytest.fixture(scope="module")
def serving_bench(tiny_model_path):
    sys.path.insert(0, str(BENCH))
    try:
        import serving
    finally:
        sys.path.remove(str(BENCH))
    return serving


def test_quick_run_of_inproc_and_peer_proxy_writes_complete_results(serving_bench, tmp_path):
    out = tmp_path / "serving.json"
    serving_bench.main(["--quick", "--setups", "ingress-inproc,peer-proxy", "--concurrency", "1,8",
                        "--requests", "24", "--warmup", "4", "--quiet-wait-s", "0",
                        "--out", str(out)])
    report = json.loads(out.read_text())

    assert report["machine"]["logical_cpus"] >= 1
    assert report["machine"]["versions"]["uvicorn"] and report["machine"]["versions"]["httpx"]
    settings = report["settings"]
    assert settings["latency_s"] == 0.02 and settings["levels"] == [1, 8]
    assert settings["scenarios"] == ["stream"]
    assert report["bodies"]["stream"]["stream"] is True
    assert report["bodies"]["stream"]["stream_options"] == {"include_usage": True}

    cells = {(r["setup"], r["concurrency"]): r for r in report["results"]}
    assert set(cells) == {(s, c) for s in ("ingress-inproc", "peer-proxy") for c in (1, 8)}
    for (setup, level), r in cells.items():
        assert r["errors"] == 0 and r["ok"] == r["requests"] >= 24, (setup, level, r)
        assert r["rps"] > 0
        # Every request includes the engine's 20 ms sleep.
        assert 20.0 <= r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
        assert r["client_cpu_ms_per_req"] > 0
    assert cells[("peer-proxy", 8)]["server_cpu_ms_per_req"] > 0
    assert cells[("ingress-inproc", 8)]["server_cpu_ms_per_req"] is None  # no separate server

    [check] = report["targets"]
    assert check["setup"] == "ingress-inproc" and check["vs"] == "peer-proxy"
    assert check["rps_ratio_at_8"] > 0 and check["p50_diff_ms_at_1"] is not None
    assert check["rps_ratio_at_32"] is None and check["all_targets_met"] is None  # no c=32

    png = out.with_suffix(".png")
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def run_quick(script, out, timeout_s: float = 300):
    """``script --quick --out out`` in its own process; its JSON report."""
    import subprocess

    run = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=timeout_s, cwd=BENCH.parent)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.own_cluster  # make test-long (README, "Tests")
def test_quick_run_of_the_learner_bench_compares_the_same_work_and_times_a_sync(
        tiny_model_path, tmp_path):
    """``bench/learner.py --quick`` in its own process: it joins a gloo process group and
    starts (then shuts down) a local Ray cluster, neither of which may touch this session's."""
    out = tmp_path / "learner.json"
    report = run_quick(BENCH / "learner.py", out)

    assert report["benchmark"] == "learner" and report["machine"]["versions"]["deepspeed"]
    assert report["settings"]["model_path"] == str(tiny_model_path)
    shape = report["batches"]
    assert shape["rows_per_batch"] == 16 and shape["padding_waste_mean"] > 0
    rows = {r["contender"]: r for r in report["throughput"]["results"]}
    assert set(rows) == {"ds-zero0", "ds-zero1", "torch-packed", "torch-padded"}
    for r in rows.values():
        assert r["rounds"] == 2 and r["tokens_per_s"] > 0 and r["ratio_paired_median"] > 0
    # The same batches for everyone, real tokens only (padding is not counted).
    assert len({r["tokens"] for r in rows.values()}) == 1
    assert rows["torch-packed"]["tokens"] == sum(shape["tokens_per_batch"][-2:])  # after warm-up
    # Same start, same updates: the DeepSpeed learner and both plain loops end on the same weights.
    diff = report["throughput"]["max_weight_diff_vs_baseline"]
    assert diff["ds-zero0"] < 1e-4 and diff["ds-zero1"] < 1e-4 and diff["torch-padded"] < 1e-3

    summary = report["summary"]
    assert summary["baseline"] == "torch-packed" and summary["target_ratio"] == 0.9
    assert set(summary["target_met"]) == {"ds-zero0", "ds-zero1"}
    assert summary["packed_vs_padded"] > 0

    sync = report["sync"]
    assert [r["version"] for r in sync["rounds"]] == [1, 2] and sync["served_version"] == 2
    assert sync["bytes"] == sync["copy_bytes"] > 1_000_000  # the whole state dict, both ways
    assert sync["sync_s_median"] > 0 and sync["copy_s_median"] > 0 and sync["sync_vs_copy"] > 0
    assert all(r["replicas"] == 1 for r in sync["rounds"])

    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


@pytest.mark.own_cluster  # make test-long (README, "Tests")
def test_quick_run_of_the_env_runner_bench_measures_runners_against_the_generation_limit(
        tiny_model_path, tmp_path):
    """``bench/envs.py --quick`` in its own process (its own local Ray cluster and Serve app):
    2 runners and the policy's raw generation rate at 16 calls in flight (as many as the 2
    runners keep in flight: 2 x 2 groups x 4 rollouts)."""
    out = tmp_path / "envs.json"
    report = run_quick(BENCH / "envs.py", out)

    assert report["benchmark"] == "envs" and report["machine"]["versions"]["ray"]
    s = report["settings"]
    assert s["model_path"] == str(tiny_model_path)
    assert (s["family"], s["history_window"], s["max_tokens"], s["group_size"]) == (
        "household", 0, 8, 4)
    rows = {r["config"]: r for r in report["summary"]["results"]}
    assert set(rows) == {"generate c=16", "2 runners"}
    assert report["summary"]["limit"] == "generate c=16"
    limit = rows["generate c=16"]
    assert limit["calls"] > 0 and limit["errors"] == 0
    assert 0 < limit["tokens_per_call"] <= 8 and limit["vs_limit_tokens"] == 1.0
    r = rows["2 runners"]
    assert r["runners"] == 2 and r["groups"] > 0 and r["episodes"] == 4 * r["groups"], r
    assert r["calls"] >= r["episodes"] and 0 < r["tokens_per_call"] <= 8, r  # whole groups
    assert r["tokens_per_s"] > 0 and r["vs_limit_tokens"] > 0 and r["nodes"] == 1
    assert r["group_retries"] == 0
    # The limit's prompts are what the runners render: similar lengths.
    p = report["prompts"]
    assert p["runner_rows"] > 0
    assert 0.5 < p["limit_tokens_mean"] / p["runner_rows_tokens_mean"] < 2.0, p

    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_prompt_token_bench_checks_ids_and_reports_both_methods(tmp_path, tiny_model_path):
    import subprocess

    out = tmp_path / "prompt_tokens.json"
    script = Path(__file__).resolve().parents[3] / "bench" / "prompt_tokens.py"
    run = subprocess.run([sys.executable, str(script), "--repeats", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert len(report["rows"]) >= 6 and report["cache"]["enabled"]
    for row in report["rows"]:  # the script itself asserts equal ids before timing
        assert row["tokens"] > 17_000 and row["whole_ms"] > 0 and row["cached_ms"] > 0


@pytest.mark.own_cluster  # make test-long (README, "Tests")
def test_quick_chaos_soak_loses_nothing_duplicates_nothing_trains_nothing_twice(
        tiny_model_path, tmp_path):
    """``bench/chaos.py --quick`` in its own process (its own Ray): 33 s of sessions,
    feedback and training while a hub, a voter, the buffer, a learner rank, an ingress replica
    and the trainer job are killed one at a time."""
    out = tmp_path / "chaos.json"
    report = run_quick(BENCH / "chaos.py", out, timeout_s=600)

    kinds = report["kills_by_kind"]
    assert set(kinds) == {"hub", "voter", "buffer", "learner", "ingress", "trainer"}, kinds
    turns, training, requests = report["turns"], report["training"], report["requests"]
    assert turns["served"] >= 20, report["requests"]
    assert turns["lost"] == 0, turns["lost_ids"]
    assert turns["duplicated"] == 0
    assert training["rows_trained"] > 0 and training["trained_twice"] == 0, training
    assert training["restarts"] >= 1  # the trainer job (and the learner) did die
    # every row the buffer settled was trained by some update (no staleness limit here)
    left = training["left_in_buffer_after_drain"]
    assert training["rows_never_trained"] <= left.get("available", 0) + left.get("leased", 0), \
        training
    # A request fails only when it and its retry both met a dying replica.
    assert requests["failed"] <= 2 * kinds["ingress"] * report["settings"]["users"], requests
    assert report["peak_rss_mb"]["SessionHub"] > 0 and report["peak_rss_mb"]["SampleBuffer"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
