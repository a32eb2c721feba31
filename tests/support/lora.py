"""Random LoRA payloads (PEFT's format, clawray/models/lora.py) for a model's linear layers, and
the merged model an adapter stands for: what multi-LoRA serving must reproduce."""

from __future__ import annotations

import copy

import torch

from clawray.models.lora import PEFT_FORMAT, PREFIX, lora_config
from clawray.weights.sync import merge_lora


def random_lora(model: torch.nn.Module, seed: int, rank: int = 4,
                targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
                scale: float = 0.2, scaling: float = 2.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            state[f"{PREFIX}{name}.lora_A.weight"] = torch.randn(rank, m.in_features,
                                                                 generator=g) * scale
            state[f"{PREFIX}{name}.lora_B.weight"] = torch.randn(m.out_features, rank,
                                                                 generator=g) * scale
    return {"format": PEFT_FORMAT, "config": lora_config(rank, scaling * rank, targets),
            "state": state}


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
