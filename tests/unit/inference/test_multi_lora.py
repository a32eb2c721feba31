"""MultiLora (clawray/inference/multi_lora.py): rows of different adapters in one forward give
what each adapter merged into its own copy of the weights gives; no rows, no change; LRU
eviction spares adapters in use; bad payloads are refused whole."""

from __future__ import annotations

import pytest
import torch

from clawray.inference.multi_lora import LoraError, MultiLora
from tests.support.lora import merged, random_lora


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


@torch.no_grad()
def test_rows_of_different_adapters_in_one_batch_match_each_merged_adapter(model):
    lora = MultiLora(model, max_loras=4)
    try:
        a, b = random_lora(model, 1), random_lora(model, 2, rank=8)
        lora.add("alice", a)
        lora.add("bob", b)
        ids = torch.randint(5, 200, (4, 9), generator=torch.Generator().manual_seed(0))
        base = model(input_ids=ids).logits
        with lora.rows(["alice", None, "bob", "alice"]):
            mixed = model(input_ids=ids).logits
        want_a = merged(model, a)(input_ids=ids).logits
        want_b = merged(model, b)(input_ids=ids).logits
        assert torch.allclose(mixed[[0, 3]], want_a[[0, 3]], atol=1e-4)
        assert torch.allclose(mixed[2], want_b[2], atol=1e-4)
        assert torch.equal(mixed[1], base[1])  # the base row is untouched
        assert (want_a[0] - base[0]).abs().max() > 1e-2  # the adapters do change the output
        # outside ``rows`` the model is the base model again
        assert torch.equal(model(input_ids=ids).logits, base)
    finally:
        lora.close()


def test_the_least_recently_used_adapter_not_in_use_is_evicted(model):
    lora = MultiLora(model, max_loras=2)
    try:
        lora.add("a", random_lora(model, 1))
        lora.add("b", random_lora(model, 2))
        lora.pin("a")  # a running request uses "a"
        assert lora.add("c", random_lora(model, 3)) == ["b"]
        assert lora.names() == ["a", "c"]
        lora.pin("c")
        with pytest.raises(LoraError, match="in use"):
            lora.add("d", random_lora(model, 4))
        lora.unpin("a")
        assert lora.add("d", random_lora(model, 4)) == ["a"]
        with pytest.raises(LoraError, match="not loaded"):
            with lora.rows(["a"]):
                pass
        with pytest.raises(LoraError, match="in use"):
            lora.remove("c")
        assert lora.nbytes("d") > 0
    finally:
        lora.close()


def test_bad_payloads_are_refused_whole(model):
    lora = MultiLora(model, max_loras=2, max_rank=4)
    try:
        with pytest.raises(LoraError, match="not a LoRA payload"):
            lora.add("x", {"modules": {}})
        good = random_lora(model, 1)
        key = next(k for k in good["state"] if k.endswith("lora_A.weight"))
        bad = {**good, "state": {**good["state"],
                                 "base_model.model.model.nope.lora_A.weight": good["state"][key],
                                 "base_model.model.model.nope.lora_B.weight":
                                     good["state"][key.replace("lora_A", "lora_B")]}}
        with pytest.raises(LoraError, match="not a linear layer"):
            lora.add("x", bad)
        with pytest.raises(LoraError, match="max_rank"):
            lora.add("x", random_lora(model, 1, rank=8))
        wrong = {**good, "state": {**good["state"], key: torch.zeros(4, 3)}}
        with pytest.raises(LoraError, match="do not fit"):
            lora.add("x", wrong)
        assert "x" not in lora and lora.names() == []
    finally:
        lora.close()
