"""How far apart two learners' updates are, relative to the update itself."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def update_distance(model_path: str | Path, a: dict[str, torch.Tensor],
                    b: dict[str, torch.Tensor], atol: float = 1e-5) -> dict[str, float]:
    """``rel_l2``: |a - b| / |a - base|; ``off_frac``: share of elements further than ``atol``.

    Adam's first step is about ``lr * sign(grad)``, so an element whose gradient is float noise
    near zero can step differently in a different summation order: compare in norm, and count
    such elements, rather than demand every element match."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path)).state_dict()
    num = sum(float(((a[k] - b[k]) ** 2).sum()) for k in a)
    den = sum(float(((a[k] - base[k]) ** 2).sum()) for k in a)
    off = sum(int(((a[k] - b[k]).abs() > atol).sum()) for k in a)
    total = sum(v.numel() for v in a.values())
    return {"rel_l2": math.sqrt(num / den) if den else math.inf, "off_frac": off / total,
            "update_l2": math.sqrt(den)}
