"""clawray's CPU LoRA ops compute what vLLM's own torch ops compute (one product per adapter
instead of one per token), and give a token without an adapter no LoRA term."""

from __future__ import annotations

import pytest
import torch

from clawray.inference.vllm import cpu_lora

ops = pytest.importorskip("vllm.lora.ops.torch_ops")

SLOTS, RANK, IN, OUT = 3, 8, 24, 40


def _case(seed: int, indices: list[int]):
    g = torch.Generator().manual_seed(seed)
    n = len(indices)
    return (torch.randn(n, IN, generator=g), torch.randn(SLOTS, 1, RANK, IN, generator=g),
            torch.randn(SLOTS, 1, OUT, RANK, generator=g), torch.tensor(indices),
            torch.randn(n, RANK, generator=g), torch.randn(n, OUT + 10, generator=g))


@pytest.mark.parametrize("indices", [[1] * 7, [0, 0, 2, 2, 2, 1, 0], [2], [0, 1, 2, 1, 0]])
def test_the_ops_equal_vllms_for_tokens_with_adapters(indices):
    x, a, b, idx, mid, y = _case(0, indices)
    for add in (True, False):
        want, got = y.clone(), y.clone()
        ops.bgmv_expand(mid, b, want, idx, add_inputs=add)
        cpu_lora.bgmv_expand(mid, b, got, idx, add_inputs=add)
        torch.testing.assert_close(got, want)
        want, got = y.clone(), y.clone()
        ops.bgmv_expand_slice(mid, b, want, idx, 5, OUT, add_inputs=add)
        cpu_lora.bgmv_expand_slice(mid, b, got, idx, 5, OUT, add_inputs=add)
        torch.testing.assert_close(got, want)
    want, got = torch.zeros(len(indices), RANK), torch.zeros(len(indices), RANK)
    ops.bgmv_shrink(x, a, want, idx, 0.5)
    cpu_lora.bgmv_shrink(x, a, got, idx, 0.5)
    torch.testing.assert_close(got, want)


def test_the_prefill_ops_equal_vllms_over_sequences():
    # three sequences of 4, 2 and 3 tokens on slots 2, -1 (none) and 0; vLLM's ops read the
    # last slot for -1, so that sequence's rows are compared with zero, the others with vLLM
    x, a, b, _, mid, y = _case(1, [0] * 9)
    starts, lens, slots = torch.tensor([0, 4, 6]), torch.tensor([4, 2, 3]), torch.tensor([2, -1, 0])
    meta = (starts, lens, slots, 3, 4, 9)
    want, got = torch.zeros(9, RANK), torch.zeros(9, RANK)
    ops.sgmv_shrink(x, a, want, *meta, 2.0)
    cpu_lora.sgmv_shrink(x, a, got, *meta, 2.0)
    keep = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1, 1], dtype=torch.bool)
    torch.testing.assert_close(got[keep], want[keep])
    assert torch.count_nonzero(got[~keep]) == 0
    want, got = y.clone(), y.clone()
    ops.sgmv_expand(mid, b, want, *meta, True)
    cpu_lora.sgmv_expand(mid, b, got, *meta, True)
    torch.testing.assert_close(got[keep], want[keep])
    torch.testing.assert_close(got[~keep], y[~keep])  # nothing added without an adapter
    want, got = y.clone(), y.clone()
    ops.sgmv_expand_slice(mid, b, want, *meta, 3, OUT, False)
    cpu_lora.sgmv_expand_slice(mid, b, got, *meta, 3, OUT, False)
    torch.testing.assert_close(got[keep], want[keep])


def _vllms_own(monkeypatch):
    """vLLM's CPU wrapper as vLLM ships it (its ops and its add_lora_linear) for this test."""
    punica_cpu = pytest.importorskip("vllm.lora.punica_wrapper.punica_cpu")
    for name in cpu_lora.INSTALLED_NAMES:
        monkeypatch.setattr(punica_cpu, name, getattr(ops, name))
    original = cpu_lora._VLLM_ADD_LORA_LINEAR or punica_cpu.PunicaWrapperCPU.add_lora_linear
    monkeypatch.setattr(punica_cpu.PunicaWrapperCPU, "add_lora_linear", original)
    monkeypatch.setattr(cpu_lora, "_VLLM_ADD_LORA_LINEAR", None)
    return punica_cpu


@pytest.mark.parametrize("prefill", [False, True])
@pytest.mark.parametrize("indices", [[1, 1, 1, 1, 1], [0, 2, 2, 0, 1]])
def test_add_lora_linear_equals_vllms_over_every_slice(monkeypatch, prefill, indices):
    punica_cpu = _vllms_own(monkeypatch)
    g = torch.Generator().manual_seed(3)
    n, slices = len(indices), (16, 8, 8)  # a fused q/k/v projection's three slices
    x = torch.randn(n, IN, generator=g)
    a = tuple(torch.randn(SLOTS, 1, RANK, IN, generator=g) for _ in slices)
    b = tuple(torch.randn(SLOTS, 1, size, RANK, generator=g) for size in slices)
    y = torch.randn(n, sum(slices), generator=g)
    wrapper = punica_cpu.PunicaWrapperCPU(64, 8, "cpu")
    wrapper._token_lora_indices[:n].copy_(torch.tensor(indices))
    wrapper.indices_len = [n, n, n, n]
    wrapper.is_prefill = prefill
    if prefill:
        wrapper._update_prefill_metadata(wrapper.token_lora_indices)
    want, got = y.clone(), y.clone()
    wrapper.add_lora_linear(want, x, a, b, 0.5, slices)  # vLLM's method and ops
    cpu_lora.add_lora_linear(wrapper, got, x, a, b, 0.5, slices)
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, y)


def test_install_puts_the_ops_where_vllms_cpu_wrapper_calls_them(monkeypatch):
    punica_cpu = _vllms_own(monkeypatch)
    assert not cpu_lora.installed()
    assert cpu_lora.install()
    assert cpu_lora.installed()
    for name in cpu_lora.INSTALLED_NAMES:
        assert getattr(punica_cpu, name) is getattr(cpu_lora, name)
    assert punica_cpu.PunicaWrapperCPU.add_lora_linear is cpu_lora.add_lora_linear


def test_expand_keeps_vllms_rule_for_one_input_row_and_many_output_rows():
    x, a, b, _, mid, y = _case(2, [1])
    idx = torch.tensor([1])
    for add in (True, False):
        want, got = y[:1].expand(5, -1).clone(), y[:1].expand(5, -1).clone()
        ops.bgmv_expand(mid[:1], b, want, idx, add_inputs=add)
        cpu_lora.bgmv_expand(mid[:1], b, got, idx, add_inputs=add)
        torch.testing.assert_close(got, want)
