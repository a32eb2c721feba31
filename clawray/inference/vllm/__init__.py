"""vLLM as clawray's engine: ``engine.py`` (``VLLMEngine``, the Engine protocol over vLLM's
``AsyncLLM``), ``convert.py`` (plain conversions between clawray's types and vLLM's),
``checkpoint.py`` (the weights file vLLM reloads), ``worker.py`` (the extension vLLM loads into
its workers), ``availability.py`` (whether and which vLLM can run here). Nothing here imports
vLLM until an engine is built: ``import clawray.inference.vllm`` works without it.
"""

from clawray.inference.vllm.availability import (VLLM_VERSION, VLLMUnavailableError,
                                                 check_vllm_available, installed_vllm)

__all__ = ["VLLM_VERSION", "VLLMUnavailableError", "check_vllm_available", "installed_vllm"]
