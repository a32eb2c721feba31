"""A context window extended by ``clawray model import --context`` (YaRN RoPE scaling in the
folder's config.json) is served the same by both engines and by the learner's model: each
engine's window is the extended one, and its log-probs equal the transformers model of the
extended folder (what the learner computes), not the original's, which differs by ~0.06 nats
on the embedded model (a served model that ignored the scaling would fail here)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from clawray.inference import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = [5, 311, 42, 99, 7, 250, 11, 1024, 77]
ATOL = 2e-3  # as in the conformance suite


@pytest.fixture(scope="module")
def extended(tiny_model_path, tmp_path_factory):
    from clawray.models.importer import import_model

    return import_model(tiny_model_path, tmp_path_factory.mktemp("yarn") / "tiny-64k",
                        context=65536)


def logprobs(path, response: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + response])).logits[0, len(PROMPT) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response).unsqueeze(-1))[:, 0]


@pytest.mark.parametrize("name", ["hf", "vllm"])
async def test_both_engines_serve_the_extended_window_as_the_learner_computes_it(
        name, extended, tiny_model_path):
    from clawray.models.loader import ModelInfo

    window = ModelInfo.from_path(extended).max_model_len
    assert window == 65536
    if name == "hf":
        from clawray.inference.hf_engine import HFEngine

        engine = HFEngine.from_path(extended, dtype="float32")
    else:
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vLLM is not installed here (make setup installs it)")
        from clawray.inference.vllm.engine import VLLMEngine

        # the window the app gives it (the folder's, ModelInfo); vLLM checks it against its
        # own reading of the folder (max_position_embeddings with the YaRN factor)
        engine = VLLMEngine.from_config(str(extended), dtype="float32", max_model_len=window,
                                        kv_cache_memory_bytes=256 << 20, max_num_seqs=2)
    try:
        assert engine.max_model_len == window
        out = (await engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                            ignore_eos=True)))[0]
        served = torch.tensor(out.logprobs)
        scored = torch.tensor(await engine.prompt_logprobs(PROMPT, out.token_ids))
    finally:
        await engine.shutdown()
    learner, original = logprobs(extended, out.token_ids), logprobs(tiny_model_path,
                                                                    out.token_ids)
    assert torch.allclose(served, learner, atol=ATOL), (served - learner).abs().max()
    assert torch.allclose(scored, learner, atol=ATOL), (scored - learner).abs().max()
    assert (learner - original).abs().max() > 20 * ATOL  # the scaling is what was served
