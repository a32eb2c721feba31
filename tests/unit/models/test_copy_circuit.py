"""The hand-seeded copy circuit (tiny.seed_copy_circuit) at head sizes other than 16.

The construction is written for 16-dim heads; wider heads (the default is 32, what vLLM's CPU
attention serves) must get the same seeded attention patterns, before any training."""

from __future__ import annotations

import random

import pytest
import torch

from clawray.models.corpus import imprint_example
from clawray.models.tiny import TinyModelSpec, init_model, seed_copy_circuit


def seeded(tokenizer, head_dim: int):
    spec = TinyModelSpec(head_dim=head_dim)
    model = init_model(spec, tokenizer)
    keep = seed_copy_circuit(model, tokenizer, spec)
    assert keep is not None, head_dim
    model.config._attn_implementation = "eager"  # returns the attention probabilities
    return model.eval()


def prompts(tokenizer, n: int = 4) -> list[torch.Tensor]:
    rng, out = random.Random(5), []
    while len(out) < n:
        messages, tools, answer = imprint_example(rng)
        if tools:
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=True) + answer
            out.append(torch.tensor([tokenizer.encode(text, add_special_tokens=False)]))
    return out


def layer1_head0(model, hidden: torch.Tensor) -> torch.Tensor:
    """Layer 1's attention probabilities of query head 0 (the copy head) for ``hidden``."""
    layer, n = model.model.layers[1], hidden.shape[1]
    pos = model.model.rotary_emb(hidden, torch.arange(n)[None])
    causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
    _, probs = layer.self_attn(layer.input_layernorm(hidden), position_embeddings=pos,
                               attention_mask=causal)
    return probs[0, 0]


@pytest.mark.parametrize("head_dim", [16, 24, 32, 64])
def test_layer0_heads_attend_exactly_two_to_five_tokens_back(tiny_tokenizer, head_dim):
    model = seeded(tiny_tokenizer, head_dim)
    ids = prompts(tiny_tokenizer, 1)[0]
    with torch.no_grad():
        probs = model(ids, output_attentions=True).attentions[0][0]
    n = ids.shape[1]
    for h in range(4):
        rows = torch.arange(8, n)
        assert torch.equal(probs[h, rows].argmax(-1), rows - (2 + h)), (head_dim, h)
        # 0.9995 with the 16-dim frequencies (head_dim a multiple of 16), 0.978 at 24 (nearest)
        assert probs[h, rows, rows - (2 + h)].min() > (0.999 if head_dim % 16 == 0 else 0.97)


@pytest.mark.parametrize("head_dim", [32, 64])
def test_wider_heads_reproduce_the_16_dim_circuit(tiny_tokenizer, head_dim):
    base, wide = seeded(tiny_tokenizer, 16), seeded(tiny_tokenizer, head_dim)
    for ids in prompts(tiny_tokenizer):
        with torch.no_grad():
            out16 = base(ids, output_attentions=True, output_hidden_states=True)
            out = wide(ids, output_attentions=True)
            # Layer 0 is positional: the same patterns whatever the rest of the weights.
            assert torch.allclose(out.attentions[0][0, :4], out16.attentions[0][0, :4],
                                  atol=1e-5)
            # Layer 1's copy head reads only the seeded features: on the same residual stream
            # it attends where the 16-dim one does.
            hidden = out16.hidden_states[1]
            assert torch.allclose(layer1_head0(wide, hidden), layer1_head0(base, hidden),
                                  atol=2e-3)


def test_spec_outside_the_construction_gets_no_circuit(tiny_tokenizer):
    for head_dim in (8, 14):  # (transformers refuses odd head sizes itself)
        spec = TinyModelSpec(head_dim=head_dim)
        assert seed_copy_circuit(init_model(spec, tiny_tokenizer), tiny_tokenizer, spec) is None
