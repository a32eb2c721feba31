"""Build the engine named in the config, for the model a ``ModelInfo`` describes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from clawray.config import InferenceConfig, ModelConfig

if TYPE_CHECKING:
    from clawray.inference.engine import Engine
    from clawray.models.loader import ModelInfo

logger = logging.getLogger(__name__)


def resolve_engine(name: str) -> str:
    """``auto``: vLLM where it can run here (bench/README.md: faster on agent sessions and
    at concurrency 8 and 32), else the transformers engine; other names as they are."""
    if name != "auto":
        return name
    from clawray.inference.vllm import VLLMUnavailableError, check_vllm_available

    try:
        check_vllm_available()
    except VLLMUnavailableError as e:
        logger.warning("inference.engine=auto: using the transformers engine (%s)", e)
        return "hf"
    return "vllm"


def make_engine(model: ModelConfig, inference: InferenceConfig, info: "ModelInfo") -> "Engine":
    max_len = model.max_model_len or info.max_model_len
    engine = resolve_engine(inference.engine)
    if engine == "hf":
        from clawray.inference.hf_engine import HFEngine

        return HFEngine.from_path(
            info.path,
            max_model_len=max_len,
            max_running=inference.max_running,
            max_waiting=inference.max_waiting,
            prefill_chunk=inference.prefill_chunk,
            dtype=model.dtype,
            device=model.device,
            max_loras=inference.max_loras,
            max_lora_rank=inference.max_lora_rank or 64,
        )
    if engine == "vllm":
        from clawray.inference.vllm.engine import VLLMEngine

        kv_bytes = None if inference.kv_cache_gib is None else int(inference.kv_cache_gib * 2**30)
        return VLLMEngine.from_config(
            str(info.path),
            max_model_len=max_len,
            gpu_memory_utilization=inference.gpu_memory_utilization,
            kv_cache_memory_bytes=kv_bytes,
            tensor_parallel_size=inference.tensor_parallel_size,
            dtype=model.dtype,
            seed=model.seed,
            enforce_eager=inference.enforce_eager,
            max_num_seqs=inference.max_running,
            max_waiting=inference.max_waiting,
            enable_prefix_caching=inference.enable_prefix_caching,
            enable_lora=inference.max_lora_rank > 0,
            max_lora_rank=max(inference.max_lora_rank, 1),
            max_loras=inference.max_loras or 2,
            weight_transfer=inference.weight_transfer,
            engine_threads=inference.engine_threads,
        )
    if engine == "fixed_latency":
        from clawray.inference.fixed_latency import FixedLatencyEngine

        return FixedLatencyEngine(latency_s=inference.fixed_latency_s, max_model_len=max_len)
    raise ValueError(f"unknown engine {inference.engine!r}")
