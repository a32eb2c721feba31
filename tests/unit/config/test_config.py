from pathlib import Path

import pytest
import yaml

from clawray.config import ClawRayConfig, ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_builder_methods_chain_and_set_sections():
    cfg = ClawRayConfig().model(path="embedded:tiny").inference(max_running=4).serving(port=9001)
    assert cfg.inference_cfg.max_running == 4
    assert cfg.serving_cfg.port == 9001
    assert cfg.validate() is cfg


def test_unknown_key_is_rejected_with_its_path():
    with pytest.raises(ConfigError, match="serving.prot"):
        ClawRayConfig.from_dict({"serving": {"prot": 1}})
    with pytest.raises(ConfigError, match="max_running"):
        ClawRayConfig().inference(max_running=0)


def test_validate_refuses_remote_bind_without_key(monkeypatch):
    monkeypatch.delenv("CLAWRAY_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="beyond loopback"):
        ClawRayConfig().serving(host="0.0.0.0").validate()
    ClawRayConfig().serving(host="0.0.0.0", api_keys=["k"]).validate()
    monkeypatch.setenv("CLAWRAY_API_KEYS", "a, b")
    cfg = ClawRayConfig().serving(host="0.0.0.0")
    assert cfg.serving_cfg.resolved_api_keys() == ["a", "b"]
    cfg.validate()


def test_validate_lists_every_problem():
    cfg = (ClawRayConfig().inference(engine="vllm").model(dtype="float16")
           .serving(default_max_tokens=10, max_tokens_limit=5, host="0.0.0.0"))
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    assert "float16" in msg and "beyond loopback" in msg and "default_max_tokens" in msg
    ClawRayConfig().inference(engine="vllm").validate()  # the embedded model, on CPU too


def test_missing_model_path_is_reported():
    with pytest.raises(ConfigError, match="does not exist"):
        ClawRayConfig().model(path="/nonexistent/model").validate()


def test_yaml_roundtrip(tmp_path):
    cfg = ClawRayConfig().serving(api_keys=["x"], default_turn_type="side")
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(cfg.to_dict()))
    again = ClawRayConfig.from_yaml(p)
    assert again == cfg
    with pytest.raises(ConfigError, match="not found"):
        ClawRayConfig.from_yaml(tmp_path / "nope.yaml")


def test_deployment_yamls_hold_valid_configs():
    for name in ("local.yaml", "gpu.yaml", "envs.yaml", "rlanything.yaml"):
        doc = yaml.safe_load((ROOT / "deployments" / name).read_text())
        app = doc["applications"][0]
        assert app["import_path"] == "clawray.serve.app:build_app"
        assert doc["http_options"]["host"] == "127.0.0.1"
        cfg = ClawRayConfig.from_dict(app["args"])
        if name in ("local.yaml", "envs.yaml", "rlanything.yaml"):
            cfg.validate()
        if name == "envs.yaml":
            assert cfg.training_cfg.mode == "env" and cfg.environments_cfg.num_runners >= 1
        elif name == "rlanything.yaml":
            assert cfg.training_cfg.mode == "rlanything" and cfg.rlanything_cfg.co_train_rm
        elif name == "gpu.yaml":
            assert cfg.inference_cfg.engine == "vllm" and cfg.serving_cfg.layout == "split"


def test_env_training_needs_runners_and_new_sections_reject_typos():
    with pytest.raises(ConfigError, match="needs environments.num_runners"):
        ClawRayConfig().environments(num_runners=0).training(mode="env").validate()
    ClawRayConfig().environments(num_runners=0).validate()  # live mode needs none
    with pytest.raises(ConfigError, match="group_sise"):
        ClawRayConfig.from_dict({"environments": {"group_sise": 4}})
    with pytest.raises(ConfigError, match="sampler"):
        ClawRayConfig().curriculum(sampler="random")
    cfg = ClawRayConfig().sft(steps=3).curriculum(sampler="accuracy_band")
    assert ClawRayConfig.from_dict(cfg.to_dict()) == cfg
