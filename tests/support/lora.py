"""Random LoRA payloads (clawray.lora/1) for a model's linear layers, and the merged model an
adapter stands for: what multi-LoRA serving must reproduce."""

from __future__ import annotations

import copy

import torch

from clawray.inference.multi_lora import LORA_FORMAT
from clawray.weights.sync import merge_lora


def random_lora(model: torch.nn.Module, seed: int, rank: int = 4,
                targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
                scale: float = 0.2, scaling: float = 2.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    modules = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            modules[name] = {"A": torch.randn(rank, m.in_features, generator=g) * scale,
                             "B": torch.randn(m.out_features, rank, generator=g) * scale,
                             "scaling": scaling, "fan_in_fan_out": False}
    return {"format": LORA_FORMAT, "modules": modules}


def merged(model: torch.nn.Module, payload: dict) -> torch.nn.Module:
    """A copy of ``model`` with ``payload`` merged into its weights."""
    m = copy.deepcopy(model)
    m.load_state_dict(merge_lora(m.state_dict(), payload), strict=False)
    return m


def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy ids after ``prompt``, one plain forward per id (the served ids to match)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
