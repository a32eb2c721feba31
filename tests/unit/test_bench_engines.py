"""``bench/engines.py``'s parts that need no server: where a cell's CPU went, and the Ray
environment each clawray setup starts with."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def engines():
    sys.path.insert(0, str(BENCH))  # engines.py imports its siblings (_bodies, _servers, ...)
    try:
        import engines
        yield engines
    finally:
        sys.path.remove(str(BENCH))


def test_cpu_is_grouped_by_kind_of_process_and_the_top_ones_show_their_niceness(engines):
    before = {1: ("VLLM::EngineCore", 10.0, 0), 2: ("VLLM::Worker", 5.0, 0),
              3: ("ray::ServeReplica:clawray:Ingress", 1.0, 0), 4: ("/x/raylet --y", 0.0, 0),
              5: ("python -m vllm.entrypoints.openai.api_server --model m", 0.0, 0),
              6: (".venv/bin/python bench/engines.py --setups a", 0.0, 0), 7: ("sshd", 0.0, 0)}
    after = {1: ("VLLM::EngineCore", 18.0, 0), 2: ("VLLM::Worker", 13.0, 0),
             3: ("ray::ServeReplica:clawray:Ingress", 1.5, 0), 4: ("/x/raylet --y", 0.5, 0),
             5: ("python -m vllm.entrypoints.openai.api_server --model m", 0.5, 0),
             6: (".venv/bin/python bench/engines.py --setups a", 0.2, 0), 7: ("sshd", 0.1, 0),
             8: ("ray::ServeController  ", 0.3, 15)}  # started during the cell
    assert engines.cpu_groups(before, after, 10.0) == {
        "engine": 160.0, "server": 10.0, "ray": 8.0, "client": 2.0, "other": 1.0}
    top = engines.cpu_top(before, after, 10.0, n=3)
    assert top == [{"process": "VLLM::Worker", "cpu_pct": 80.0, "nice": 0},
                   {"process": "VLLM::EngineCore", "cpu_pct": 80.0, "nice": 0},
                   {"process": "ray::ServeReplica:clawray:Ingress", "cpu_pct": 5.0, "nice": 0}]
    assert engines.cpu_top({}, {8: after[8]}, 10.0)[0] == {
        "process": "ray::ServeController", "cpu_pct": 3.0, "nice": 15}


def test_each_clawray_setup_starts_ray_as_clawray_serve_would(engines, monkeypatch):
    seen = {}

    def fake_start_ray(name, env, config, logdir):
        seen[name] = env
        raise RuntimeError("stop here")

    monkeypatch.setattr(engines, "start_ray", fake_start_ray)
    for name in ("clawray-vllm", "clawray-vllm-tput", "clawray-vllm-rayctl"):
        with pytest.raises(RuntimeError, match="stop here"):
            engines.start_setup(name, "/model", Path("/tmp"))
    direct = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"}
    loop = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1"}
    assert seen == {"clawray-vllm": direct | loop,
                    "clawray-vllm-tput": direct | loop | {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
                    "clawray-vllm-rayctl": direct}
