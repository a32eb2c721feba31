"""``bench/engines.py``'s parts that need no server: where a cell's CPU went, and the Ray
environment each clawray setup starts with."""

from __future__ import annotations

import asyncio
import json
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
    # an engine process that kept its spawn command line instead of its title
    spawned = "/x/python -B -c from multiprocessing.spawn import spawn_main; spawn_main(t"
    assert engines.cpu_groups({9: (spawned, 1.0, 15)}, {9: (spawned, 9.0, 15)}, 10.0)[
        "engine"] == 80.0
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


def test_the_replicahttp_setup_is_clawray_vllm_with_the_replica_serving_http_itself(
        engines, monkeypatch):
    seen = {}

    def fake_start_ray(name, env, config, logdir):
        seen[name] = (env, config)
        raise RuntimeError("stop here")

    monkeypatch.setattr(engines, "start_ray", fake_start_ray)
    for name in ("clawray-vllm", "clawray-vllm-replicahttp"):
        with pytest.raises(RuntimeError, match="stop here"):
            engines.start_setup(name, "/model", Path("/tmp"))
    (env, plain), (own_env, own) = seen["clawray-vllm"], seen["clawray-vllm-replicahttp"]
    assert own_env == env and own["inference"]["engine"] == "vllm"
    assert "replica_http_port" not in plain["serving"]
    assert isinstance(own["serving"].pop("replica_http_port"), int)
    own["serving"]["records_path"] = plain["serving"]["records_path"]
    assert own == plain  # nothing else differs


def test_a_clawray_requests_time_is_split_at_the_handler_by_its_record(engines, tmp_path):
    records = tmp_path / "clawray-vllm-turns.jsonl"
    assert engines.join_timeline([{"id": "a", "sent_at": 0.0, "done_at": 1.0}], records) is None
    # handler 100.1-100.9 s for "a", 200.2-201.0 for "b"; "c" was never recorded
    records.write_text("\n".join(json.dumps(r) for r in (
        {"record_id": "chatcmpl-a", "started_at": 100.1, "finished_at": 100.9},
        {"record_id": "chatcmpl-b", "started_at": 200.2, "finished_at": 201.0})) + "\n")
    timeline = [{"id": "chatcmpl-a", "sent_at": 100.0, "done_at": 101.0},
                {"id": "chatcmpl-b", "sent_at": 200.0, "done_at": 201.3},
                {"id": "chatcmpl-c", "sent_at": 300.0, "done_at": 301.0}]
    where = engines.join_timeline(timeline, records)
    assert where["joined"] == 2
    assert where["in_ms_p50"] == pytest.approx(150.0) and where["in_ms_p90"] == pytest.approx(190.0)
    assert where["handler_ms_p50"] == pytest.approx(800.0)
    assert where["out_ms_p50"] == pytest.approx(200.0) and where["out_ms_p90"] == pytest.approx(280.0)


def test_the_raythreads_setup_gives_vllm_rays_thread_count_and_the_others_none(engines):
    configs = {n: engines.clawray_config(n, "/model", Path("/tmp/logs"), "vllm")
               for n in ("clawray-vllm", "clawray-vllm-raythreads", "clawray-uvicorn")}
    assert {n: c["inference"]["engine_threads"] for n, c in configs.items()} == {
        "clawray-vllm": None, "clawray-vllm-raythreads": engines.REPLICA_CPUS,
        "clawray-uvicorn": None}
    assert configs["clawray-uvicorn"]["serving"]["records_path"] == \
        "/tmp/logs/clawray-uvicorn-turns.jsonl"  # where join_timeline reads its records


async def test_clawrays_code_without_ray_serves_and_records_each_turn(tmp_path, tiny_model_path):
    """The setup clawray-uvicorn: bench/_baseline_servers.py's engine server, the same
    IngressCore behind plain uvicorn (here called through ASGI, on the transformers engine and
    the embedded model), writing the records that ``join_timeline`` splits a request's time
    with."""
    import httpx

    sys.path.insert(0, str(BENCH))
    try:
        from _baseline_servers import engine_app
    finally:
        sys.path.remove(str(BENCH))
    records = tmp_path / "turns.jsonl"
    app = engine_app({"model": {"path": str(tiny_model_path), "served_name": "m"},
                     "inference": {"engine": "hf"},
                     "serving": {"layout": "colocated", "record_sink": ["jsonl"],
                                 "records_path": str(records)}})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://bench") as client:
        listed = await client.get("/v1/models")
        assert listed.status_code == 200, listed.text
        assert [m["id"] for m in listed.json()["data"]] == ["m"]
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    for _ in range(100):  # the JSONL sink writes from its own thread
        if records.exists() and records.read_text().endswith("\n"):
            break
        await asyncio.sleep(0.05)
    [record] = [json.loads(line) for line in records.read_text().splitlines()]
    assert record["record_id"] == r.json()["id"]
    assert 0 < record["started_at"] <= record["finished_at"]
