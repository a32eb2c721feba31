"""VLLMEngine on a machine without vLLM or a GPU: import, the clear error, the pure conversions.

The conversions are fed plain objects shaped like vLLM's (``CompletionOutput`` fields, the
per-position ``{token_id: Logprob}`` dicts); nothing here imports or fakes the vllm package.
The engine itself is verified on a GPU only (see docs/vllm.md).
"""

import dataclasses
import importlib.util
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from clawray.inference.engine import EngineError, SamplingParams
from clawray.inference.vllm_engine import (
    VLLM_VERSION,
    WORKER_EXTENSION,
    VLLMEngine,
    VLLMUnavailableError,
    WorkerExtension,
    completion_to_delta,
    completion_to_output,
    engine_args_kwargs,
    map_finish_reason,
    pack_weights,
    prompt_logprobs_kwargs,
    response_prompt_logprobs,
    sampled_logprobs,
    sampling_kwargs,
    stop_string_of,
    unpack_tensor,
    vllm_unavailable_reason,
)

VLLM_RUNNABLE = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


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
    code = "import sys, clawray.inference.vllm_engine; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(VLLM_RUNNABLE, reason="vLLM and a GPU are present here")
def test_constructing_without_vllm_or_gpu_says_how_to_install():
    for build in (lambda: VLLMEngine(object(), model="m"),
                  lambda: VLLMEngine.from_config("/models/m", max_model_len=4096)):
        with pytest.raises(VLLMUnavailableError) as err:
            build()
        message = str(err.value)
        assert "pip install 'clawray[vllm]'" in message
        assert f"vllm=={VLLM_VERSION}" in message
        assert "NVIDIA GPU" in message


def test_unavailable_reason_names_what_is_missing():
    assert "not installed" in vllm_unavailable_reason(vllm_installed=False, cuda_available=True)
    assert "CUDA" in vllm_unavailable_reason(vllm_installed=True, cuda_available=False)
    assert vllm_unavailable_reason(vllm_installed=True, cuda_available=True) is None


def test_engine_args_load_the_worker_extension_and_raw_logprobs():
    kwargs = engine_args_kwargs("/models/m", max_model_len=4096, tensor_parallel_size=2,
                                dtype="bfloat16", max_num_seqs=32, extra={"enforce_eager": True})
    assert kwargs["model"] == "/models/m" and kwargs["max_model_len"] == 4096
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["dtype"] == "bfloat16"
    assert kwargs["max_num_seqs"] == 32 and kwargs["enforce_eager"] is True
    assert kwargs["logprobs_mode"] == "raw_logprobs"
    module, _, name = kwargs["worker_extension_cls"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is WorkerExtension
    assert "max_num_seqs" not in engine_args_kwargs("/models/m")  # vLLM's default then


def test_sampling_kwargs_carry_every_setting_and_ask_for_sampled_logprobs():
    params = SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, stop=("</s>",), seed=3,
                            n=2, ignore_eos=True)
    assert sampling_kwargs(params) == {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "max_tokens": 64, "stop": ["</s>"],
        "seed": 3, "ignore_eos": True, "logprobs": 0, "detokenize": True,
    }
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


def test_finished_completion_keeps_ids_logprobs_and_stop_string():
    out = completion_to_output(
        completion([4, 2], [{4: Logprob(-0.3)}, {2: Logprob(-0.6)}], "stop", "\nUser:", index=1),
        version_start=7, version_now=7,
    )
    assert out.token_ids == [4, 2] and out.logprobs == [-0.3, -0.6]
    assert out.finish_reason == "stop" and out.stop_string == "\nUser:" and out.index == 1
    assert out.policy_version == 7 and out.policy_version_end is None


def test_completion_spanning_a_weight_swap_records_both_versions():
    out = completion_to_output(completion([4], [{4: Logprob(-0.3)}], "length"),
                               version_start=7, version_now=8)
    assert (out.policy_version, out.policy_version_end) == (7, 8)
    with pytest.raises(EngineError, match="not finished"):
        completion_to_output(completion([4], [{4: Logprob(-0.3)}], None),
                             version_start=7, version_now=7)


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


def test_stream_reports_a_weight_swap_on_the_final_delta_only():
    mid = completion_to_delta(completion([4], [{4: Logprob(-0.3)}]), version_start=3,
                              version_now=4)
    assert (mid.policy_version, mid.policy_version_end) == (3, None)
    last = completion_to_delta(completion([5], [{5: Logprob(-0.1)}], "length"),
                               version_start=3, version_now=4)
    assert (last.policy_version, last.policy_version_end) == (3, 4)


def test_weights_round_trip_through_packing_in_every_dtype():
    state = {
        "embed.weight": torch.randn(5, 3, dtype=torch.bfloat16),
        "norm.weight": torch.randn(3),
        "rope.inv_freq": torch.arange(4, dtype=torch.float16),
        "counter": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "empty": torch.zeros(0, 3),
        "transposed": torch.randn(3, 4).t(),  # not contiguous
    }
    chunks = list(pack_weights(state))
    assert len(chunks) == 1
    restored = dict(unpack_tensor(p) for p in chunks[0])
    assert restored.keys() == state.keys()
    for name, tensor in state.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor)


def test_weight_packing_splits_into_bounded_chunks():
    state = {f"w{i}": torch.zeros(256) for i in range(5)}  # 1 KiB each
    state["big"] = torch.zeros(1024)  # 4 KiB: over the limit, so it travels alone
    chunks = list(pack_weights(state, max_chunk_bytes=2048))
    assert [[p[0] for p in c] for c in chunks] == [["w0", "w1"], ["w2", "w3"], ["w4"], ["big"]]


def test_packed_tensors_survive_lists_from_the_rpc():
    [[packed]] = list(pack_weights({"w": torch.ones(2, 2, dtype=torch.bfloat16)}))
    name, tensor = unpack_tensor(list(packed))  # msgpack turns tuples into lists
    assert name == "w" and tensor.shape == (2, 2) and tensor.dtype == torch.bfloat16


def test_worker_extension_loads_weights_through_the_models_load_weights():
    class TinyModel(torch.nn.Module):
        """A stand-in for a vLLM model: load_weights takes (name, tensor) pairs."""

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(3, 2, bias=False)

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for name, tensor in weights:
                params[name].data.copy_(tensor)
            return {name for name, _ in weights}

    # vLLM's GPU worker (which needs a GPU) holds the model at model_runner.model.
    worker = type("Worker", (WorkerExtension,), {})()
    worker.device = torch.device("cpu")
    worker.model_runner = SimpleNamespace(model=TinyModel())
    new = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    [chunk] = pack_weights({"proj.weight": new})
    assert worker.clawray_load_weights(chunk) == 1
    assert torch.equal(worker.model_runner.model.proj.weight, new)


def test_worker_extension_adds_a_single_uniquely_named_method():
    # vLLM refuses an extension whose attributes clash with its worker's.
    assert [a for a in dir(WorkerExtension) if not a.startswith("__")] == ["clawray_load_weights"]
    assert WORKER_EXTENSION.endswith(".WorkerExtension")
