"""LoRA adapters in PEFT's own format: the one payload clawray sends, stores and serves.

A payload is a PEFT adapter folder held in memory::

    {"format": "peft",
     "config": the LoraConfig as a dict (peft's ``to_dict``, as adapter_config.json holds it),
     "state": the adapter's tensors (``get_peft_model_state_dict``, as
              adapter_model.safetensors holds them: ``base_model.model.<module>.lora_A.weight``)}

The learner sends it as peft gives it (``from_peft_model``); vLLM loads it as a LoRA request
folder and peft as a ``PeftModel`` (``save_folder``); the transformers engine's multi-LoRA
serving and the merging weight sync read each module's ``(A, B, scaling)`` (``modules``), by
peft's own rules (``scaling = lora_alpha / r``, ``/ sqrt(r)`` with rsLoRA; ``rank_pattern``
and ``alpha_pattern`` matched per module with peft's ``get_pattern_key``). Plain LoRA on
linear layers only: DoRA, LoRA bias, ``fan_in_fan_out`` and ``modules_to_save`` are refused
with the reason, everywhere alike.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Mapping

import torch

PEFT_FORMAT = "peft"
PREFIX = "base_model.model."  # peft's prefix of the base model's module names
_KEY = re.compile(r"(.+)\.lora_([AB])\.weight")


class LoraFormatError(ValueError):
    """Not a LoRA adapter clawray can send, merge or serve; the message says why."""


def lora_config(r: int, lora_alpha: float, target_modules: list[str] | set[str], *,
                use_rslora: bool = False) -> dict[str, Any]:
    """The adapter_config.json of a plain LoRA adapter (as peft's LoraConfig writes it)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(r),
            "lora_alpha": float(lora_alpha), "target_modules": sorted(target_modules),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": bool(use_rslora), "use_dora": False, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}}


def config_dict(config: Any) -> dict[str, Any]:
    """A peft ``LoraConfig`` (or its dict) as plain JSON-able data."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.loads(json.dumps(d, default=lambda v: sorted(v) if isinstance(v, (set, frozenset))
                                 else str(getattr(v, "value", v))))


def from_peft_model(model: torch.nn.Module, adapter: str = "default") -> dict[str, Any]:
    """The payload of a peft model's ``adapter``: its config and ``get_peft_model_state_dict``."""
    from peft import get_peft_model_state_dict

    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or adapter not in configs:
        raise LoraFormatError(f"not a peft model with adapter {adapter!r}")
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    payload = {"format": PEFT_FORMAT, "config": config_dict(configs[adapter]),
               "state": {k: v.detach().to("cpu", copy=True) for k, v in state.items()}}
    modules(payload)  # refuses what cannot be merged or served, naming it
    return payload


def from_state_dict(state: Mapping[str, torch.Tensor], config: Mapping[str, Any] | Any
                    ) -> dict[str, Any]:
    """The payload of a ``get_peft_model_state_dict``-style dict and its LoRA config (a
    LoraConfig or a dict; ``r`` and ``target_modules`` default to what the tensors show)."""
    cfg = config_dict(config)
    keys = [_KEY.fullmatch(k) for k in state]
    names = sorted({m.group(1) for m in keys if m is not None})
    if names and "r" not in cfg:
        first = state[f"{names[0]}.lora_A.weight"]
        cfg["r"] = int(first.shape[0]) if torch.is_tensor(first) else 0
    base = lora_config(cfg.get("r", 0), cfg.get("lora_alpha", 0.0),
                       {n.rsplit(".", 1)[-1] for n in names})
    payload = {"format": PEFT_FORMAT, "config": {**base, **cfg},
               "state": {k: v.detach().cpu() if torch.is_tensor(v) else v
                         for k, v in state.items()}}
    modules(payload)
    return payload


def modules(payload: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{base module name: (A [r, in], B [out, r], scaling)}`` of a payload, checked: a bad
    one raises LoraFormatError naming up to five problems, and yields nothing."""
    if not isinstance(payload, Mapping) or payload.get("format") != PEFT_FORMAT:
        raise LoraFormatError(f"not a LoRA payload (expected format {PEFT_FORMAT!r}: a peft "
                              "adapter, e.g. models.lora.from_peft_model(model))")
    cfg, state = payload.get("config"), payload.get("state")
    if not isinstance(cfg, Mapping) or not isinstance(state, Mapping) or not state:
        raise LoraFormatError("the LoRA payload needs its config and a non-empty state")
    problems = [f"{what} adapters are not supported" for what, on in (
        ("DoRA", cfg.get("use_dora")), ("LoRA bias", cfg.get("lora_bias")),
        ("fan_in_fan_out", cfg.get("fan_in_fan_out")),
        ("modules_to_save", cfg.get("modules_to_save")),
        (f"bias={cfg.get('bias')!r}", cfg.get("bias", "none") != "none")) if on]
    pairs: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        m = _KEY.fullmatch(key)
        if m is None:
            problems.append(f"not a LoRA linear weight: {key!r} (lora_A/lora_B only)")
            continue
        pairs.setdefault(m.group(1).removeprefix(PREFIX), {})[m.group(2)] = value
    out = {}
    for name, ab in pairs.items():
        a, b = ab.get("A"), ab.get("B")
        if not (torch.is_tensor(a) and torch.is_tensor(b) and a.dim() == 2 and b.dim() == 2):
            problems.append(f"{name}: needs 2-D lora_A and lora_B tensors")
        elif a.shape[0] != b.shape[1]:
            problems.append(f"{name}: rank mismatch, A is {tuple(a.shape)}, B is "
                            f"{tuple(b.shape)}")
        else:
            r, alpha = rank_and_alpha(cfg, name)
            if r != a.shape[0]:
                problems.append(f"{name}: the config says rank {r}, the tensors {a.shape[0]}")
                continue
            scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            if not math.isfinite(scaling):
                problems.append(f"{name}: scaling must be a finite number")
                continue
            out[name] = (a, b, float(scaling))
    if problems:
        raise LoraFormatError("bad LoRA payload: " + "; ".join(problems[:5]))
    return out


def fitted_modules(payload: Any, weight_shapes: Mapping[str, Any]
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``modules(payload)``, each also checked against the model: ``weight_shapes`` maps
    weight names (``<module>.weight``) to their ``[out, in]`` shapes. Raises LoraFormatError
    naming up to five problems (a module the model lacks, a ``B @ A`` of another shape)."""
    mods = modules(payload)
    problems = []
    for name, (a, b, _) in mods.items():
        shape = weight_shapes.get(f"{name}.weight")
        if shape is None:
            problems.append(f"{name}: the model has no weight '{name}.weight'")
        elif (b.shape[0], a.shape[1]) != tuple(shape):
            problems.append(f"{name}: B @ A is {(b.shape[0], a.shape[1])}, the weight is "
                            f"{tuple(shape)}")
    if problems:
        raise LoraFormatError("bad LoRA payload: " + "; ".join(problems[:5]))
    return mods


def rank_and_alpha(cfg: Mapping[str, Any], module: str) -> tuple[int, float]:
    """The rank and alpha peft gives ``module`` (``rank_pattern`` / ``alpha_pattern``)."""
    from peft.utils.other import get_pattern_key

    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    r = ranks.get(get_pattern_key(list(ranks), module), cfg.get("r")) if ranks else cfg.get("r")
    alpha = (alphas.get(get_pattern_key(list(alphas), module), cfg.get("lora_alpha"))
             if alphas else cfg.get("lora_alpha"))
    try:
        return int(r), float(alpha)
    except (TypeError, ValueError):
        raise LoraFormatError(f"{module}: the config has no valid r / lora_alpha") from None


def max_rank(payload: Mapping[str, Any]) -> int:
    """The largest rank of any module (what an engine's max_lora_rank must cover)."""
    return max(int(a.shape[0]) for a, _, _ in modules(payload).values())


def nbytes(payload: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in payload["state"].values())


def save_folder(payload: Mapping[str, Any], dest: str | Path) -> Path:
    """Write the payload as a PEFT adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``): what vLLM's LoRA requests and ``PeftModel.from_pretrained``
    load."""
    from safetensors.torch import save_file

    modules(payload)
    dest = Path(dest).expanduser()
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in payload["state"].items()},
              str(dest / "adapter_model.safetensors"))
    (dest / "adapter_config.json").write_text(json.dumps(payload["config"], indent=1))
    return dest


def zero_adapter(module: str, in_features: int, out_features: int) -> dict[str, Any]:
    """An adapter that adds nothing (one module, rank 1, B = 0): a base policy as an adapter."""
    return {"format": PEFT_FORMAT, "config": lora_config(1, 1.0, [module.rsplit(".", 1)[-1]]),
            "state": {f"{PREFIX}{module}.lora_A.weight": torch.zeros(1, in_features),
                      f"{PREFIX}{module}.lora_B.weight": torch.zeros(out_features, 1)}}
