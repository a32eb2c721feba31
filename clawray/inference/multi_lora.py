"""Several LoRA adapters in one batch of a transformers model (the transformers engine's
multi-LoRA serving; vLLM has its own).

Each adapted linear layer gets a forward hook that adds, for every row of the batch, that row's
adapter's delta ``scaling · (x @ Aᵀ) @ Bᵀ``: rows of different adapters (and rows of the base
policy, adapter ``None``) share one forward, as punica / S-LoRA batch them on GPUs. The rows'
adapters are set around a forward with ``with lora.rows([...])``; outside it the hooks add
nothing, so the model is exactly the base model.

Adapters arrive as PEFT payloads (``clawray/models/lora.py``: peft's adapter config and state
dict, read per module as ``A``, ``B`` and peft's scaling). At most
``max_loras`` are resident; adding one more evicts the least recently used adapter that no
running sequence uses (the engine reloads an evicted adapter from where it keeps them).
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator, Sequence

import torch

from clawray.models import lora


class LoraError(ValueError):
    """A payload or request the multi-LoRA layer cannot serve; nothing was changed."""


class MultiLora:
    """Per-row LoRA adapters on ``model``'s linear layers (hooks installed once)."""

    def __init__(self, model: torch.nn.Module, max_loras: int = 8, max_rank: int = 64) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        # adapter name -> base module name -> (A [r, in], B [out, r] already times scaling)
        self._adapters: collections.OrderedDict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] \
            = collections.OrderedDict()
        self._pinned: collections.Counter[str] = collections.Counter()
        self._groups: list[tuple[str, torch.Tensor]] | None = None  # (adapter, row index)
        self._hooks = [m.register_forward_hook(self._hook(n)) for n, m in self.linears.items()]

    # ------------------------------------------------------------------ adapters

    def add(self, name: str, payload: Any) -> list[str]:
        """Load (or replace) adapter ``name``; the names it evicted to make room."""
        modules = self._check(payload)
        evicted: list[str] = []
        if name not in self._adapters:
            while len(self._adapters) >= self.max_loras:
                victim = next((a for a in self._adapters if not self._pinned[a]), None)
                if victim is None:
                    raise LoraError(f"all {self.max_loras} resident adapters are in use by "
                                    "running requests; raise max_loras")
                del self._adapters[victim]
                evicted.append(victim)
        self._adapters[name] = modules
        self._adapters.move_to_end(name)
        return evicted

    def remove(self, name: str) -> bool:
        if self._pinned[name]:
            raise LoraError(f"adapter {name!r} is in use by running requests")
        return self._adapters.pop(name, None) is not None

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def names(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._adapters)

    def pin(self, name: str) -> None:
        """A running sequence uses ``name``: it cannot be evicted until ``unpin``."""
        if name not in self._adapters:
            raise LoraError(f"adapter {name!r} is not loaded")
        self._pinned[name] += 1
        self._adapters.move_to_end(name)

    def unpin(self, name: str) -> None:
        if self._pinned[name] > 0:
            self._pinned[name] -= 1

    def nbytes(self, name: str) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self._adapters[name].values())

    def _check(self, payload: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        try:
            modules = lora.modules(payload)
        except lora.LoraFormatError as e:
            raise LoraError(str(e)) from None
        out, problems = {}, []
        for name, (a, b, scaling) in modules.items():
            layer = self.linears.get(name)
            if layer is None:
                problems.append(f"{name}: not a linear layer of this model")
                continue
            r = a.shape[0]
            if a.shape != (r, layer.in_features) or b.shape != (layer.out_features, r):
                problems.append(f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit "
                                f"({layer.out_features} x {layer.in_features})")
                continue
            if r > self.max_rank:
                problems.append(f"{name}: rank {r} > max_rank {self.max_rank}")
                continue
            w = layer.weight
            out[name] = (a.to(w.device, w.dtype).contiguous(),
                         (b * scaling).to(w.device, w.dtype).contiguous())
        if problems:
            raise LoraError("bad LoRA payload: " + "; ".join(problems[:5]))
        return out

    # ------------------------------------------------------------------ forward

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within this block, row ``i`` of a forward runs on ``adapters[i]`` (None: base)."""
        groups: dict[str, list[int]] = {}
        for i, name in enumerate(adapters):
            if name is None:
                continue
            if name not in self._adapters:
                raise LoraError(f"adapter {name!r} is not loaded")
            groups.setdefault(name, []).append(i)
        device = next(iter(self.linears.values())).weight.device if self.linears else "cpu"
        self._groups = [(n, torch.tensor(ix, device=device)) for n, ix in groups.items()] or None
        try:
            yield
        finally:
            self._groups = None

    def _hook(self, module_name: str):
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: torch.Tensor):
            if self._groups is None:
                return None
            x = inputs[0]
            out = output
            for name, idx in self._groups:
                ab = self._adapters[name].get(module_name)
                if ab is None:
                    continue
                a, b = ab
                delta = (x.index_select(0, idx) @ a.T) @ b.T
                if out is output:
                    out = output.clone()
                out.index_add_(0, idx, delta.to(out.dtype))
            return out
        return hook

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
