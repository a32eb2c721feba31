"""A quick run of ``bench/serving.py`` for the rows that need no Ray: the in-process floor (a)
and the peer proxy design (b), whose two uvicorn servers really start and serve over loopback.
The Ray Serve rows need clusters of their own and belong to the full benchmark only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


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
    # Concurrent requests overlap in the engine, so 8 workers beat 1.
    assert cells[("peer-proxy", 8)]["rps"] > cells[("peer-proxy", 1)]["rps"]

    [check] = report["targets"]
    assert check["setup"] == "ingress-inproc" and check["vs"] == "peer-proxy"
    assert check["rps_ratio_at_8"] > 0 and check["p50_diff_ms_at_1"] is not None
    assert check["rps_ratio_at_32"] is None and check["all_targets_met"] is None  # no c=32

    png = out.with_suffix(".png")
    assert png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
