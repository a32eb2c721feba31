"""The worker extension vLLM loads into each of its workers (``worker_extension_cls``)."""

from __future__ import annotations

import os
import sys

from clawray.inference.vllm import cpu_lora

# vLLM imports this module in the process where the model runs (its worker), before the model
# loads: the CPU LoRA ops go in there (elsewhere, importing it imports no vLLM).
# CLAWRAY_VLLM_CPU_LORA_OPS=0 keeps vLLM's own (the baseline of bench/lora_prefill.py).
if "vllm" in sys.modules and os.environ.get("CLAWRAY_VLLM_CPU_LORA_OPS", "1") != "0":
    cpu_lora.install()


class WorkerExtension:
    """Mixed into vLLM's worker class through ``worker_extension_cls`` (vLLM refuses an
    extension whose attribute names clash with the worker's, hence the prefix).

    vLLM's in-place reload leaves a tied LM head computing with its *old* weight: the head is
    a module of its own that loads nothing (its weight is the embedding's parameter), so the
    reload puts its previous kernel tensors back ("ParallelLMHead: Failed to load weights"),
    and on CPU its GEMM was prepared once, at load time, from the old tensor (a oneDNN handle
    or a packed copy). Every tied model (Qwen3 up to 4B, the embedded default) would then
    score with a stale head. ``clawray_retie_word_embeddings`` ties the head to the
    embedding's current weight again and redoes the head's post-load processing.
    """

    def clawray_retie_word_embeddings(self) -> bool:
        """Re-tie and re-prepare a tied LM head; False when the model has none."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # vLLM's worker
        config = getattr(model, "config", None)
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if (not getattr(config, "tie_word_embeddings", False) or embed is None
                or not hasattr(head, "tie_weights")):
            return False
        head.tie_weights(embed)
        head.quant_method.process_weights_after_loading(head)
        return True

    def clawray_lora_ops(self) -> str:
        """Whose LoRA ops vLLM's CPU wrapper calls in this worker: ``clawray`` or ``vllm``."""
        return "clawray" if cpu_lora.installed() else "vllm"
