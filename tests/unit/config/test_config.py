from pathlib import Path

import pytest
import yaml

from clawray.config import ClawRayConfig, ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_builder_methods_chain_and_set_sections():
    cfg = ClawRayConfig().model(path="embedded:tiny").inference(max_running=4).serving(port=9001)
    assert cfg.inference_cfg.max_running == 4
    assert cfg.serving_cfg.port == 9001
    assert cfg.check() is cfg


def test_unknown_key_is_rejected_with_its_path():
    with pytest.raises(ConfigError, match="serving.prot"):
        ClawRayConfig.from_dict({"serving": {"prot": 1}})
    with pytest.raises(ConfigError, match="max_running"):
        ClawRayConfig().inference(max_running=0)


def test_validate_refuses_remote_bind_without_key(monkeypatch):
    monkeypatch.delenv("CLAWRAY_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="beyond loopback"):
        ClawRayConfig().serving(host="0.0.0.0").check()
    ClawRayConfig().serving(host="0.0.0.0", api_keys=["k"]).check()
    monkeypatch.setenv("CLAWRAY_API_KEYS", "a, b")
    cfg = ClawRayConfig().serving(host="0.0.0.0")
    assert cfg.serving_cfg.resolved_api_keys() == ["a", "b"]
    cfg.check()


def test_keys_from_a_file_and_digests_count_as_keys(monkeypatch, tmp_path):
    import hashlib

    monkeypatch.delenv("CLAWRAY_API_KEYS", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("# one key per line\nsk-file-1\n\nsk-file-2\n")
    cfg = ClawRayConfig().serving(host="0.0.0.0", api_keys_file=str(keys)).check()
    assert cfg.serving_cfg.resolved_api_keys() == ["sk-file-1", "sk-file-2"]
    digest = hashlib.sha256(b"sk-yaml").hexdigest()
    cfg = ClawRayConfig().serving(host="0.0.0.0", api_key_digests=[digest.upper()]).check()
    assert cfg.serving_cfg.key_digests() == [digest]
    with pytest.raises(ConfigError, match="SHA-256"):
        ClawRayConfig().serving(api_key_digests=["abc"])
    with pytest.raises(ConfigError, match="cannot be read"):
        ClawRayConfig().serving(host="0.0.0.0", api_keys_file=str(tmp_path / "nope")).check()
    # trusted apps are named by tenant id (what `clawray key-digest` prints), never by key
    from clawray.serve.auth import tenant_of_key

    tenant = tenant_of_key("sk-app")
    assert ClawRayConfig().serving(trusted_app_tenants=[tenant]).serving_cfg \
        .trusted_app_tenants == [tenant]
    with pytest.raises(ConfigError, match="tenant ids"):
        ClawRayConfig().serving(trusted_app_tenants=["sk-app"])


def test_deployments_receive_digests_never_keys(monkeypatch):
    """Init args are visible in `serve status` and the dashboard."""
    import hashlib

    from clawray.serve.app import deployment_args

    monkeypatch.setenv("CLAWRAY_API_KEYS", "sk-from-env")
    cfg = ClawRayConfig().serving(api_keys=["sk-secret-1"])
    args = deployment_args(cfg)
    assert "sk-secret-1" not in repr(args) and "sk-from-env" not in repr(args)
    assert args["serving"]["api_key_digests"] == [
        hashlib.sha256(k).hexdigest() for k in (b"sk-secret-1", b"sk-from-env")]
    # what a replica makes of them: the same keys pass, with the same tenants
    from clawray.serve.auth import KeyChecker, tenant_of_key

    monkeypatch.delenv("CLAWRAY_API_KEYS")
    checker = KeyChecker(ClawRayConfig.from_dict(args).serving_cfg.key_digests())
    assert checker.check({"authorization": "Bearer sk-secret-1"}) == tenant_of_key("sk-secret-1")
    assert checker.check({"x-api-key": "sk-from-env"}) == tenant_of_key("sk-from-env")


def test_an_app_is_refused_when_serve_binds_beyond_loopback_without_a_key(monkeypatch):
    """`serve run deployments/x.yaml` binds http_options.host, not serving.host."""
    from clawray.serve import app

    monkeypatch.delenv("CLAWRAY_API_KEYS", raising=False)
    monkeypatch.setattr(app, "serve_http_host", lambda: "0.0.0.0")
    with pytest.raises(ValueError, match="http_options.host='0.0.0.0'"):
        app.build_app(ClawRayConfig())
    app.build_app(ClawRayConfig().serving(api_keys=["k"]))  # with a key it builds
    monkeypatch.setattr(app, "serve_http_host", lambda: "127.0.0.1")
    app.build_app(ClawRayConfig())


def test_validate_lists_every_problem():
    cfg = (ClawRayConfig().inference(engine="vllm").model(dtype="float16")
           .serving(default_max_tokens=10, max_tokens_limit=5, host="0.0.0.0"))
    with pytest.raises(ConfigError) as e:
        cfg.check()
    msg = str(e.value)
    assert "float16" in msg and "beyond loopback" in msg and "default_max_tokens" in msg
    ClawRayConfig().inference(engine="vllm").check()  # the embedded model, on CPU too


def test_missing_model_path_is_reported():
    with pytest.raises(ConfigError, match="does not exist"):
        ClawRayConfig().model(path="/nonexistent/model").check()


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
            cfg.check()
        if name == "envs.yaml":
            assert cfg.training_cfg.mode == "env" and cfg.environments_cfg.num_runners >= 1
        elif name == "rlanything.yaml":
            assert cfg.training_cfg.mode == "rlanything" and cfg.rlanything_cfg.co_train_rm
        elif name == "gpu.yaml":
            assert cfg.inference_cfg.engine == "vllm" and cfg.serving_cfg.layout == "split"
            # every other setting passes the cross-field checks (LoRA rank within vLLM's)
            cfg.copy_with(model={"path": "embedded:tiny"}, judge={"model_path": None}).check()
            assert cfg.training_cfg.lora_rank > 0


def test_env_training_needs_runners_and_new_sections_reject_typos():
    with pytest.raises(ConfigError, match="needs environments.num_runners"):
        ClawRayConfig().environments(num_runners=0).training(mode="env").check()
    ClawRayConfig().environments(num_runners=0).check()  # live mode needs none
    with pytest.raises(ConfigError, match="group_sise"):
        ClawRayConfig.from_dict({"environments": {"group_sise": 4}})
    with pytest.raises(ConfigError, match="sampler"):
        ClawRayConfig().curriculum(sampler="random")
    cfg = ClawRayConfig().sft(steps=3).curriculum(sampler="accuracy_band")
    assert ClawRayConfig.from_dict(cfg.to_dict()) == cfg


def test_nccl_weight_transfer_needs_vllm_full_weights_and_a_learner_gpu():
    from clawray.config import ClawRayConfig

    ok = (ClawRayConfig().inference(engine="vllm", weight_transfer="nccl")
          .training(learner_num_gpus=1))
    assert ok.check() is ok
    with pytest.raises(ValueError, match="needs vLLM replicas, not inference.engine='hf'"):
        ok.copy_with(inference={"engine": "hf"}).check()
    with pytest.raises(ValueError, match="broadcasts full weights.*lora_rank"):
        ok.copy_with(training={"lora_rank": 8}, inference={"max_lora_rank": 8}).check()
    with pytest.raises(ValueError, match="learner's GPU: set training.learner_num_gpus"):
        ok.copy_with(training={"learner_num_gpus": 0}).check()


def test_per_user_training_says_everything_it_needs():
    with pytest.raises(ConfigError) as e:
        ClawRayConfig().training(per_user=True, zero_stage=1).check()
    for need in ("training.lora_rank > 0", "training.zero_stage 0", "inference.max_loras > 0"):
        assert need in str(e.value)
    ok = ClawRayConfig().training(per_user=True, lora_rank=4, zero_stage=0) \
        .inference(max_loras=4).check()
    assert ok.training_cfg.per_user


def test_replica_resources_pin_replicas_and_refuse_builtin_or_negative_ones():
    from clawray.serve.app import build_app

    cfg = ClawRayConfig().serving(replica_resources={"serving_node": 1})
    app = build_app(cfg)
    assert app._bound_deployment.ray_actor_options["resources"] == {"serving_node": 1}
    for bad, why in (({"CPU": 2}, "replica_num_cpus"), ({"x": -1}, ">= 0")):
        with pytest.raises(ValueError, match=why):
            ClawRayConfig().serving(replica_resources=bad)


def test_the_log_level_of_clawrays_lines_is_set_in_config(tmp_path):
    import argparse
    import logging

    from clawray.apps.cli import _config

    log = logging.getLogger("clawray")
    before = log.level
    try:
        ClawRayConfig().apply_log_level()  # unset: the process decides
        assert log.level == before
        ClawRayConfig.from_dict({"tracking": {"log_level": "ERROR"}}).apply_log_level()
        assert log.level == logging.ERROR and not log.isEnabledFor(logging.WARNING)
        # the CLI's commands load their config through _config, which applies it
        cfg = tmp_path / "c.yaml"
        cfg.write_text("tracking: {log_level: WARNING}\n")
        _config(argparse.Namespace(config=str(cfg), port=None))
        assert log.level == logging.WARNING
        with pytest.raises(ConfigError, match="log_level"):
            ClawRayConfig.from_dict({"tracking": {"log_level": "LOUD"}})
    finally:
        log.setLevel(before)


def test_a_nested_setting_is_set_by_its_path_and_keeps_its_neighbours():
    from clawray.config import ClawRayConfig, ConfigError, apply_sets

    cfg = ClawRayConfig().copy_with(training={"loss": {"kl_coef": 0.3, "entropy_coef": 0.01}})
    out = apply_sets(cfg, ["training.loss.kl_coef=0.1", "training.lr=0.5"])
    assert out.training_cfg.loss.kl_coef == 0.1 and out.training_cfg.loss.entropy_coef == 0.01
    assert out.training_cfg.lr == 0.5
    # a dict-valued setting is replaced, not merged
    res = cfg.copy_with(serving={"replica_resources": {"a": 1.0}})
    assert res.copy_with(serving={"replica_resources": {"b": 2.0}}).serving_cfg \
        .replica_resources == {"b": 2.0}
    for bad in ("training.loss.nope=1", "training.loss.=1", "training=1"):
        with pytest.raises(ConfigError):
            apply_sets(cfg, [bad])
