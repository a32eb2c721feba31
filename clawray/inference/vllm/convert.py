"""Conversions between clawray's types and vLLM's, plain functions over plain data: engine
arguments, sampling parameters, finish reasons, log-probs, a completion as a ``TokenDelta``,
and the check of a LoRA adapter against the model before vLLM loads it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from clawray.inference.engine import (
    EngineError,
    EngineInternalError,
    FinishReason,
    SamplingParams,
    TokenDelta,
)
from clawray.models.lora import LoraFormatError, fitted_modules


WORKER_EXTENSION = "clawray.inference.vllm.worker.WorkerExtension"
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
        modules = fitted_modules(payload, {n: shape for n, (shape, _) in shapes.items()})
    except LoraFormatError as e:
        raise EngineError(str(e)) from None
    return max(int(a.shape[0]) for a, _, _ in modules.values())
