"""Per-sequence KV caches as plain tensors, and their packing into one batched decode step.

Each running sequence keeps its own cache (a list of per-layer ``(keys, values)``, each
``[1, kv_heads, seq_len, head_dim]``), so sequences can join and leave the running set at any
step. A batched decode step left-pads the caches to the longest, masks the pad columns, and
slices each row's cache back out afterwards; while the same rows keep decoding together, the
padded batch is reused from step to step instead of being rebuilt.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

KV = list[tuple[torch.Tensor, torch.Tensor]]


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of the cache argument of ``model.forward``: transformers 5.20 renamed
    ``past_key_values`` to ``cache`` (vLLM's CPU build pins transformers below 5.20)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def make_cache(kv: KV | None) -> DynamicCache:
    """Wrap cached tensors in a DynamicCache without copying them (None: an empty cache)."""
    cache = DynamicCache()
    for keys, values in kv or ():
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        cache.layers.append(layer)
    return cache


def cache_tensors(cache: DynamicCache) -> KV:
    return [(layer.keys, layer.values) for layer in cache.layers]


def cache_len(kv: KV) -> int:
    return kv[0][0].shape[-2]


@dataclasses.dataclass
class PaddedBatch:
    """Several sequences' caches left-padded into one, steppable while its rows stay the same.

    ``mask`` covers the padded cache plus the next token of each row, and each row's position
    is its own length, so rotary embeddings match an unbatched step. Building one copies every
    row's cache once; stepping an unchanged batch again costs nothing extra.
    """

    cache: DynamicCache
    mask: torch.Tensor  # [rows, cached + 1], 0 on pad columns
    positions: torch.Tensor  # [rows, 1], the position of each row's next token

    @classmethod
    def stack(cls, kvs: list[KV], device: torch.device) -> PaddedBatch:
        lens = [cache_len(kv) for kv in kvs]
        longest = max(lens)
        layers: KV = []
        for layer in range(len(kvs[0])):
            padded = []
            for which in (0, 1):  # keys, values
                first = kvs[0][layer][which]
                out = first.new_zeros((len(kvs), first.shape[1], longest, first.shape[3]))
                for row, (kv, n) in enumerate(zip(kvs, lens)):
                    out[row, :, longest - n :] = kv[layer][which][0]
                padded.append(out)
            layers.append((padded[0], padded[1]))
        mask = torch.ones(len(kvs), longest + 1, dtype=torch.long, device=device)
        for row, n in enumerate(lens):
            mask[row, : longest - n] = 0
        positions = torch.tensor(lens, device=device).unsqueeze(1)
        return cls(make_cache(layers), mask, positions)

    def stepped(self) -> list[KV]:
        """After a forward appended one token per row: advance, and return each row's cache.

        The rows are views into the batched tensors (no copy), without their padding.
        """
        self.positions = self.positions + 1
        self.mask = F.pad(self.mask, (0, 1), value=1)
        merged = cache_tensors(self.cache)
        total = cache_len(merged)
        rows = []
        for row, n in enumerate(self.positions.flatten().tolist()):
            keep = slice(total - n, None)
            rows.append([(k[row : row + 1, :, keep], v[row : row + 1, :, keep]) for k, v in merged])
        return rows
