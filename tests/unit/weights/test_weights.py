"""Weight sync without Ray: LoRA merge math against peft, payload checks, the vLLM import guard."""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys

import pytest
import torch

from clawray.inference import EngineError, HFEngine
from clawray.models import lora
from clawray.models.lora import from_peft_model
from clawray.weights.sync import (
    LoraSync,
    ObjectStoreSync,
    WeightSyncError,
    copy_baseline,
    make_weight_sync,
    merge_lora,
)

TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def base_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


def peft_model_of(base, seed: int, **lora_kw):
    """A peft LoRA model on a copy of ``base`` with seeded, non-zero adapters."""
    import copy

    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **lora_kw)
    model = get_peft_model(copy.deepcopy(base), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@contextlib.asynccontextmanager
async def engine_on(base):
    import copy

    engine = HFEngine(copy.deepcopy(base), eos_token_ids=[])
    try:
        yield engine
    finally:
        await engine.shutdown()


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


async def test_lora_merge_matches_peft_merge_and_unload(base_model):
    first, second = peft_model_of(base_model, 0), peft_model_of(base_model, 1)
    payloads = [from_peft_model(first), from_peft_model(second)]
    assert set(lora.modules(payloads[0])) >= {"model.layers.0.self_attn.q_proj",
                                              "model.layers.0.mlp.down_proj"}
    expected = [first.merge_and_unload().state_dict(), second.merge_and_unload().state_dict()]
    sync = LoraSync("test", replica_id="r0")
    async with engine_on(base_model) as engine:
        for version, (payload, want) in enumerate(zip(payloads, expected), start=1):
            await sync.receive(engine, payload, version)
            got = engine.model.state_dict()
            assert engine.policy_version == version
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < 1e-6, worst
    # the second payload was merged into the base weights, not on top of the first adapter
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(expected[0][q], expected[1][q])


def test_a_payload_is_peft_state_and_config_and_scales_by_peft_rules(base_model, tmp_path):
    from peft import PeftModel, get_peft_model_state_dict

    model = peft_model_of(base_model, 2, use_rslora=True, alpha_pattern={"v_proj": 16})
    direct = from_peft_model(model)
    assert direct["state"].keys() == get_peft_model_state_dict(model).keys()
    built = LoraSync("test", lora_alpha=8, use_rslora=True, alpha_pattern={"v_proj": 16}
                     ).payload(get_peft_model_state_dict(model))
    mods, built_mods = lora.modules(direct), lora.modules(built)
    assert mods.keys() == built_mods.keys()
    for name, (a, b, scaling) in mods.items():
        layer = model.get_submodule(f"base_model.model.{name}")
        assert scaling == pytest.approx(layer.scaling["default"]), name  # peft's own value
        assert built_mods[name][2] == pytest.approx(scaling) and torch.equal(built_mods[name][1], b)
    assert mods["model.layers.0.self_attn.v_proj"][2] == pytest.approx(16 / 2)  # 16 / sqrt(4)
    # the payload is a PEFT folder in memory: peft loads what save_folder writes
    import copy

    loaded = PeftModel.from_pretrained(copy.deepcopy(base_model),
                                       lora.save_folder(direct, tmp_path / "adapter"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)
    # LoraSync.send's conversion needs the config when given a raw peft state dict
    with pytest.raises(WeightSyncError, match="lora_alpha"):
        LoraSync("test").payload(get_peft_model_state_dict(model))


Q = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p["state"].update({"base_model.model.model.nope.lora_A.weight":
                                  p["state"][f"{Q}.lora_A.weight"],
                                  "base_model.model.model.nope.lora_B.weight":
                                  p["state"][f"{Q}.lora_B.weight"]}),
     "no weight 'model.nope.weight'"),
    (lambda p: p["state"].update({f"{Q}.lora_A.weight": torch.zeros(3, 7)}), "rank mismatch"),
    (lambda p: p["state"].update({f"{Q}.lora_B.weight": torch.zeros(5, 4)}), "B @ A is"),
    (lambda p: p["config"].update(r=3), "config says rank 3"),
    (lambda p: p["config"].update(use_dora=True), "DoRA"),
    (lambda p: p["config"].update(fan_in_fan_out=True), "fan_in_fan_out"),
    (lambda p: p["state"].update({"base_model.model.lm_head.weight": torch.zeros(2, 2)}),
     "not a LoRA linear weight"),
    (lambda p: p.update(format="other"), "not a LoRA payload"),
    (lambda p: p.update(state={}), "non-empty state"),
])
async def test_bad_lora_payload_is_refused_and_changes_nothing(base_model, mutate, message):
    payload = from_peft_model(peft_model_of(base_model, 3))
    payload = {**payload, "config": dict(payload["config"]), "state": dict(payload["state"])}
    mutate(payload)
    async with engine_on(base_model) as engine:
        before = snapshot(engine)
        with pytest.raises(WeightSyncError, match=message):
            await LoraSync("test").receive(engine, payload, 7)
        after = engine.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert engine.policy_version == 0


async def test_bad_state_dict_is_refused_and_changes_nothing(base_model):
    sync = ObjectStoreSync("test")
    async with engine_on(base_model) as engine:
        before = snapshot(engine)
        good = {k: v + 1 for k, v in list(before.items())[:3]}
        with pytest.raises(EngineError, match="unknown parameter names"):
            await sync.receive(engine, {**good, "not.a.weight": torch.zeros(2)}, 1)
        with pytest.raises(EngineError, match="shape mismatch"):
            await sync.receive(engine, {**good, next(iter(good)): torch.zeros(2)}, 1)
        with pytest.raises(WeightSyncError, match="name -> tensor"):
            await sync.receive(engine, {**good, "x": [1, 2]}, 1)
        assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
        assert engine.policy_version == 0
        await sync.receive(engine, good, 1)  # a partial state dict is fine
        assert engine.policy_version == 1
        assert torch.equal(engine.model.state_dict()[next(iter(good))], next(iter(good.values())))


def test_merge_lora_is_pure_math():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 5, generator=g)
    a, b = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    payload = {"format": "peft", "config": lora.lora_config(2, 1.0, ["m"]),
               "state": {"base_model.model.m.lora_A.weight": a,
                         "base_model.model.m.lora_B.weight": b}}
    merged = merge_lora({"m.weight": w0}, payload)
    assert torch.allclose(merged["m.weight"], w0 + 0.5 * b @ a, atol=1e-6)  # alpha / r
    payload["config"]["use_rslora"] = True  # alpha / sqrt(r)
    assert torch.allclose(merge_lora({"m.weight": w0}, payload)["m.weight"],
                          w0 + 2 ** -0.5 * b @ a, atol=1e-6)


def test_copy_baseline_counts_bytes():
    out = copy_baseline({"a": torch.zeros(10, dtype=torch.float32), "b": torch.zeros(3, 2)})
    assert out["bytes"] == 64 and out["seconds"] >= 0


def test_unknown_sync_kind_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown weight sync 'rsync'.*lora.*nccl.*object_store"):
        make_weight_sync("rsync", "app")


async def test_nccl_sync_imports_without_vllm_and_says_what_is_missing():
    # Importing the module (and clawray) must not import vLLM.
    code = ("import sys, clawray.weights.nccl, clawray.serve.app; "
            "assert 'vllm' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

    from clawray.inference.vllm import VLLMUnavailableError

    sync = make_weight_sync("nccl", "app", ranks_per_replica=2)
    assert sync.kind == "nccl"
    if importlib.util.find_spec("vllm") is None:
        missing = r"vLLM 0\.32\.0.*clawray\[vllm\]"
    elif not torch.cuda.is_available():
        missing = r"needs a CUDA GPU"
    else:
        pytest.skip("a CUDA machine with vLLM: bench/gpu_check.sh runs the NCCL sync there")
    for call in (lambda: sync.prepare(1), lambda: sync.send({"w": torch.zeros(2)}, 1)):
        with pytest.raises(VLLMUnavailableError, match=missing):
            call()
    with pytest.raises(VLLMUnavailableError, match=missing):
        await sync.receive(object(), {}, 1)


def test_nccl_sync_for_an_app_takes_its_ranks_from_tensor_parallelism():
    from clawray.config import ClawRayConfig
    from clawray.weights.nccl import VLLMNcclSync, rank_offsets

    cfg = (ClawRayConfig().inference(engine="vllm", tensor_parallel_size=4,
                                     weight_transfer="nccl").training(app="svc"))
    sync = VLLMNcclSync.for_app(cfg)
    assert (sync.app_name, sync.ranks_per_replica) == ("svc", 4)
    # trainer rank 0; each replica's TP workers in a block, in replica-id order
    assert rank_offsets(["r2", "r1"], 4) == {"r1": 1, "r2": 5}
    with pytest.raises(ValueError, match="weight_transfer: nccl"):
        VLLMNcclSync.for_app(ClawRayConfig().inference(engine="vllm"))
    with pytest.raises(ValueError, match="engine 'hf'"):
        VLLMNcclSync.for_app(ClawRayConfig().inference(engine="hf", weight_transfer="nccl"))


def test_the_publisher_refuses_nccl_where_it_cannot_run_before_starting_anything():
    from clawray.inference.vllm import VLLMUnavailableError
    from clawray.weights.publisher import WeightPublisher

    with pytest.raises(ValueError, match="unknown weight transport 'rsync'"):
        WeightPublisher("app", lora=False, transport="rsync")
    with pytest.raises(ValueError, match="full weights, not LoRA"):
        WeightPublisher("app", lora=True, transport="nccl")
    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("a CUDA machine with vLLM: bench/gpu_nccl.py runs the NCCL publisher there")
    # no Ray here: the check comes before the control actor is created
    with pytest.raises(VLLMUnavailableError):
        WeightPublisher("app", lora=False, transport="nccl")
