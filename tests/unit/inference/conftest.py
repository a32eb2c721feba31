"""The engines' unit tests share one tiny random Qwen3."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 512


@pytest.fixture(scope="session")
def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(1234)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        # Wider init than the default so the distribution is peaked: greedy ties cannot flip.
        initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).eval()
