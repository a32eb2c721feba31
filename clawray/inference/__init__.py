"""Inference engines behind one token-in/token-out protocol.

The protocol types and the model-free ``FixedLatencyEngine`` import eagerly; ``HFEngine``
(transformers) and ``VLLMEngine`` (GPU only, optional extra) are loaded on first access, so
importing this package costs neither transformers nor vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from clawray.inference.engine import (
    Engine,
    EngineError,
    EngineOverloaded,
    EngineUnavailable,
    EngineStatus,
    FinishReason,
    SamplingParams,
    TokenDelta,
    TokenOutput,
    check_prompt_fits,
)
from clawray.inference.fixed_latency import FixedLatencyEngine

if TYPE_CHECKING:
    from clawray.inference.hf_engine import HFEngine
    from clawray.inference.vllm.engine import VLLMEngine

_LAZY = {"HFEngine": "clawray.inference.hf_engine", "VLLMEngine": "clawray.inference.vllm.engine"}

__all__ = [
    "Engine",
    "EngineError",
    "EngineOverloaded",
    "EngineUnavailable",
    "EngineStatus",
    "FinishReason",
    "FixedLatencyEngine",
    "HFEngine",
    "SamplingParams",
    "TokenDelta",
    "TokenOutput",
    "VLLMEngine",
    "check_prompt_fits",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
