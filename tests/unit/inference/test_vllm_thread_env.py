"""The environment vLLM's engine processes start in (clawray/inference/vllm/engine.py)."""

import os

import pytest

from clawray.inference.vllm.engine import engine_thread_env


@pytest.mark.parametrize("outer", [None, "2"])
def test_the_engine_starts_without_the_actors_thread_count_unless_one_is_set(monkeypatch, outer):
    if outer is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", outer)
    with engine_thread_env(None):
        assert "OMP_NUM_THREADS" not in os.environ
    assert os.environ.get("OMP_NUM_THREADS") == outer
    with engine_thread_env(3):
        assert os.environ["OMP_NUM_THREADS"] == "3"
    assert os.environ.get("OMP_NUM_THREADS") == outer


def test_the_setting_is_put_back_when_the_start_fails(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.raises(RuntimeError), engine_thread_env(None):
        raise RuntimeError("vLLM failed to start")
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_the_config_takes_a_thread_count_and_refuses_zero():
    from clawray.config import ClawRayConfig, ConfigError

    assert ClawRayConfig().inference_cfg.engine_threads is None
    two = ClawRayConfig.from_dict({"inference": {"engine_threads": 2}})
    assert two.inference_cfg.engine_threads == 2
    with pytest.raises(ConfigError, match="engine_threads"):
        ClawRayConfig.from_dict({"inference": {"engine_threads": 0}})


@pytest.mark.parametrize("threads, seen", [(None, None), (1, "1")])
def test_vllm_is_started_in_that_environment_and_the_replicas_is_put_back(
        monkeypatch, tmp_path, threads, seen):
    """What ``VLLMEngine.from_config`` hands vLLM: inside an actor that Ray gave 2 CPUs
    (``OMP_NUM_THREADS=2``), AsyncLLM starts its processes without it (or with the setting)."""
    pytest.importorskip("vllm")
    from vllm.v1.engine.async_llm import AsyncLLM

    from clawray.inference.vllm.engine import VLLMEngine

    class Started(Exception):
        pass

    env_at_start = []

    def start(args, **_):
        env_at_start.append(os.environ.get("OMP_NUM_THREADS"))
        raise Started

    monkeypatch.setattr(AsyncLLM, "from_engine_args", start)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    with pytest.raises(Started):
        VLLMEngine.from_config(str(tmp_path), max_model_len=64, engine_threads=threads)
    assert env_at_start == [seen]
    assert os.environ["OMP_NUM_THREADS"] == "2"
