"""VLLMEngine: the token-in/token-out Engine protocol over vLLM's ``AsyncLLM`` (GPU only).

vLLM is an optional extra, imported only inside the engine: this module imports on a CPU
machine, and constructing the engine there raises :class:`VLLMUnavailableError`. The
conversions between clawray's types and vLLM's are plain functions over plain data (tested
without vLLM); the engine class is a thin shell around ``AsyncLLM``.

Weights are swapped in place between engine steps: ``pause_generation(mode="keep")`` freezes
in-flight requests and drops the KV/prefix cache, ``collective_rpc`` runs
:meth:`WorkerExtension.clawray_load_weights` on every worker (the model's own
``load_weights`` with (name, tensor) pairs), and ``resume_generation`` lets the frozen
requests go on under the new weights. Shipping tensors through the RPC is the simple path;
NCCL transfer through vLLM's weight-transfer API replaces it in a later issue.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import torch

from clawray.inference.engine import (
    EngineError,
    EngineStatus,
    FinishReason,
    SamplingParams,
    TokenDelta,
    TokenOutput,
    check_prompt_fits,
)

logger = logging.getLogger(__name__)

VLLM_VERSION = "0.32.0"  # the release this module is written against (pyproject extra)
WORKER_EXTENSION = "clawray.inference.vllm_engine.WorkerExtension"
DEFAULT_WEIGHT_CHUNK_BYTES = 256 << 20
_GREEDY_EPS = 1e-5  # vLLM samples greedily below this temperature and then requires n == 1
_MAX_TEMPERATURE = 2.0  # vLLM rejects higher temperatures

# vLLM's finish reasons (FINISH_REASON_STRINGS in vllm/v1/engine/__init__.py) -> ours. "error"
# is raised instead. "repetition" (vLLM's degenerate-output detector, which clawray never
# turns on) cut the completion short, so it counts as an abort.
_FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop", "length": "length", "abort": "abort", "repetition": "abort",
}

# One tensor on the wire: (name, dtype name, shape, raw bytes). Plain types only: vLLM's
# msgpack RPC sends a torch.Tensor argument as a (dtype, shape, data) triple that an untyped
# call does not turn back into a tensor (vllm/v1/serial_utils.py).
PackedTensor = tuple[str, str, list[int], bytes]


class VLLMUnavailableError(RuntimeError):
    """vLLM or a CUDA GPU is missing on this machine."""


def vllm_unavailable_reason(*, vllm_installed: bool, cuda_available: bool) -> str | None:
    """Why VLLMEngine cannot run here, or None when it can."""
    if not vllm_installed:
        return "vLLM is not installed"
    if not cuda_available:
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def check_vllm_available() -> None:
    """Raise :class:`VLLMUnavailableError`, with install instructions, unless vLLM can run."""
    reason = vllm_unavailable_reason(
        vllm_installed=importlib.util.find_spec("vllm") is not None,
        cuda_available=torch.cuda.is_available(),
    )
    if reason is not None:
        raise VLLMUnavailableError(
            f"VLLMEngine cannot start: {reason}. Install the pinned vLLM with "
            f"`pip install 'clawray[vllm]'` (vllm=={VLLM_VERSION}) on a machine with an "
            "NVIDIA GPU, or use inference.engine='hf'."
        )


# ---------------------------------------------------------------------------- conversions


def engine_args_kwargs(
    model_path: str,
    *,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.85,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    seed: int = 0,
    enforce_eager: bool = False,
    max_num_seqs: int | None = None,
    enable_prefix_caching: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.engine.arg_utils.AsyncEngineArgs`` for the policy model."""
    kwargs: dict[str, Any] = dict(
        model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
        enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
        logprobs_mode="raw_logprobs",  # the Engine protocol's log-prob convention
        worker_extension_cls=WORKER_EXTENSION,  # adds clawray_load_weights to the workers
    )
    if max_num_seqs is not None:
        kwargs["max_num_seqs"] = max_num_seqs
    kwargs.update(extra or {})
    return kwargs


def sampling_kwargs(params: SamplingParams) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` (the caller adds ``output_kind``).

    ``logprobs=0`` returns the sampled token's log-prob at every position; text is only
    detokenized when stop strings need it (vLLM matches them on text).
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
        ignore_eos=params.ignore_eos, logprobs=0, detokenize=bool(params.stop),
    )


def prompt_logprobs_kwargs() -> dict[str, Any]:
    """``vllm.SamplingParams`` kwargs of a teacher prefill: score the prompt, sample 1 token."""
    return {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}


def map_finish_reason(reason: str | None) -> FinishReason | None:
    """vLLM's ``CompletionOutput.finish_reason`` as ours; None while still generating."""
    if reason is None:
        return None
    if reason == "error":
        raise EngineError("vLLM failed this request with an internal error; retry it")
    try:
        return _FINISH_REASONS[reason]
    except KeyError:
        raise EngineError(f"vLLM reported an unknown finish reason {reason!r}") from None


def stop_string_of(stop_reason: int | str | None) -> str | None:
    """The stop string that ended a completion (vLLM gives an int for a stop token id)."""
    return stop_reason if isinstance(stop_reason, str) else None


def _token_logprob(position: Mapping[int, Any] | None, token_id: int, where: str) -> float:
    if position is None or token_id not in position:
        raise EngineError(f"vLLM returned no log-prob for token {token_id} at {where}")
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
        raise EngineError(f"vLLM returned {have} log-probs for {len(token_ids)} tokens")
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
        raise EngineError(f"vLLM returned {have} prompt log-probs for {len(token_ids)} tokens")
    start = len(token_ids) - num_response
    if start < 1:
        raise EngineError("the response must follow at least one prompt token")
    return [
        _token_logprob(prompt_logprobs[i], token_ids[i], f"prompt position {i}")
        for i in range(start, len(token_ids))
    ]


def completion_to_output(completion: Any, *, version_start: int, version_now: int) -> TokenOutput:
    """A finished vLLM ``CompletionOutput`` as a TokenOutput, stamped with policy versions."""
    finish = map_finish_reason(completion.finish_reason)
    if finish is None:
        raise EngineError("vLLM returned a completion that has not finished")
    token_ids = list(completion.token_ids)
    return TokenOutput(
        token_ids=token_ids,
        logprobs=sampled_logprobs(token_ids, completion.logprobs),
        finish_reason=finish,
        policy_version=version_start,
        policy_version_end=version_now if version_now != version_start else None,
        stop_string=stop_string_of(completion.stop_reason),
        index=completion.index,
    )


def completion_to_delta(completion: Any, *, version_start: int, version_now: int) -> TokenDelta:
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
        policy_version=version_start,
        finish_reason=finish,
        stop_string=stop_string_of(completion.stop_reason) if finish else None,
        index=completion.index,
        policy_version_end=version_now if swapped else None,
    )


# ---------------------------------------------------------------------------- weights


def pack_tensor(name: str, tensor: torch.Tensor) -> PackedTensor:
    """One tensor as plain data (CPU bytes) for vLLM's RPC."""
    t = tensor.detach().to("cpu").contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return name, str(t.dtype).removeprefix("torch."), list(t.shape), data


def unpack_tensor(packed: Sequence[Any]) -> tuple[str, torch.Tensor]:
    """Inverse of :func:`pack_tensor` (the RPC may have turned tuples into lists)."""
    name, dtype_name, shape, data = packed
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype_name!r} for weight {name!r}")
    if data:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:  # torch.frombuffer refuses an empty buffer
        raw = torch.empty(0, dtype=torch.uint8)
    return name, raw.view(dtype).reshape(list(shape))


def pack_weights(
    state_dict: Mapping[str, torch.Tensor], max_chunk_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES
) -> Iterator[list[PackedTensor]]:
    """Yield the state dict lazily as chunks of at most ``max_chunk_bytes`` of tensor data.

    A tensor larger than the limit travels alone; one chunk is in host memory at a time.
    """
    chunk: list[PackedTensor] = []
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(pack_tensor(name, tensor))
        size += nbytes
    if chunk:
        yield chunk


class WorkerExtension:
    """Mixed into vLLM's GPU worker class through ``worker_extension_cls``.

    vLLM refuses an extension whose attribute names clash with the worker's, so this class
    holds one uniquely named method. It runs on every worker (every TP rank); the model's
    ``load_weights`` shards the full tensors it receives.
    """

    def clawray_load_weights(self, chunk: Sequence[Sequence[Any]]) -> int:
        """Load one chunk of packed tensors into the model in place; return how many."""
        weights = [unpack_tensor(packed) for packed in chunk]
        device = torch.device(self.device)  # type: ignore[attr-defined]  # vLLM's worker
        with device:
            self.model_runner.model.load_weights(weights)  # type: ignore[attr-defined]
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the next step must see the new weights
        return len(weights)


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
        weight_chunk_bytes: int = DEFAULT_WEIGHT_CHUNK_BYTES,
    ) -> None:
        check_vllm_available()
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._vllm_version = importlib.metadata.version("vllm")
        if self._vllm_version != VLLM_VERSION:
            logger.warning("vLLM %s is installed; clawray is written against vLLM %s",
                           self._vllm_version, VLLM_VERSION)
        self._sampling_cls = VLLMSamplingParams
        self._tokens_prompt = TokensPrompt
        self._kind = RequestOutputKind
        self._llm = llm
        self.model = model
        self.max_model_len = int(llm.model_config.max_model_len)
        self._policy_version = policy_version
        self._weight_chunk_bytes = weight_chunk_bytes
        self._paused = False
        self._closed = False
        self._in_flight = 0
        self._control = asyncio.Lock()  # serializes pause / resume / load_weights
        self._no_swap = asyncio.Event()  # cleared while weights are being swapped
        self._no_swap.set()

    @classmethod
    def from_config(
        cls, model_path: str, *, policy_version: int = 0, **settings: Any
    ) -> VLLMEngine:
        """Start vLLM on a local HF model folder (blocks while the model loads).

        ``settings`` are :func:`engine_args_kwargs`'s keywords: max_model_len,
        gpu_memory_utilization, tensor_parallel_size, dtype, seed, enforce_eager,
        max_num_seqs, enable_prefix_caching, extra (more AsyncEngineArgs fields).
        """
        check_vllm_available()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**engine_args_kwargs(model_path, **settings))
        return cls(AsyncLLM.from_engine_args(args), model=model_path, policy_version=policy_version)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[TokenOutput]:
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        vllm_params = self._sampling_cls(**sampling_kwargs(params),
                                         output_kind=self._kind.FINAL_ONLY)
        version = await self._admit()
        final = None
        async with aclosing(self._request(list(prompt_ids), vllm_params)) as outputs:
            async for final in outputs:
                pass
        if final is None or not final.finished:
            raise EngineError("vLLM ended a request without its final output")
        return [
            completion_to_output(c, version_start=version, version_now=self._policy_version)
            for c in sorted(final.outputs, key=lambda c: c.index)
        ]

    async def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Yield new ids as vLLM samples them (DELTA outputs); closing the iterator aborts."""
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        vllm_params = self._sampling_cls(**sampling_kwargs(params), output_kind=self._kind.DELTA)
        version = await self._admit()
        async with aclosing(self._request(list(prompt_ids), vllm_params)) as outputs:
            async for out in outputs:
                for completion in out.outputs:
                    delta = completion_to_delta(
                        completion, version_start=version, version_now=self._policy_version
                    )
                    if delta.token_ids or delta.finish_reason is not None:
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
        vllm_params = self._sampling_cls(**prompt_logprobs_kwargs(),
                                         output_kind=self._kind.FINAL_ONLY)
        await self._admit()
        final = None
        async with aclosing(self._request(token_ids, vllm_params)) as outputs:
            async for final in outputs:
                pass
        if final is None:
            raise EngineError("vLLM ended a prompt-log-prob request without output")
        return response_prompt_logprobs(final.prompt_logprobs, token_ids, len(response_ids))

    async def load_weights(self, state_dict: dict, policy_version: int) -> None:
        """Load ``state_dict`` (HF names -> tensors) in place and adopt ``policy_version``.

        In-flight requests are frozen, not aborted, and continue under the new weights; the
        KV and prefix caches are dropped so no token is computed from stale keys/values.
        Requests that arrive meanwhile wait and start on the new version.
        """
        async with self._control:
            started = time.monotonic()
            self._no_swap.clear()
            try:
                if not self._paused:  # else pause() already froze and dropped the caches
                    await self._llm.pause_generation(mode="keep", clear_cache=True)
                try:
                    count = await self._ship_weights(state_dict)
                    self._policy_version = policy_version
                except Exception:
                    logger.exception("loading policy version %d into vLLM failed; the weights "
                                     "may be partly updated (still version %d)",
                                     policy_version, self._policy_version)
                    raise
                finally:
                    if not self._paused:
                        await self._llm.resume_generation()
            finally:
                self._no_swap.set()
        logger.info("vLLM loaded %d tensors as policy version %d in %.2fs",
                    count, policy_version, time.monotonic() - started)

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
        # vLLM schedules internally; clawray only counts the requests it has in flight.
        return EngineStatus(
            engine="vllm", model=self.model, policy_version=self._policy_version,
            max_model_len=self.max_model_len, running=self._in_flight, waiting=0,
            paused=self._paused,
            extra={"vllm_version": self._vllm_version, "swapping": not self._no_swap.is_set()},
        )

    async def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._llm.shutdown()

    async def _admit(self) -> int:
        """Wait out a weight swap in progress; return the version a new request starts on."""
        if self._closed:
            raise EngineError("the engine is shut down")
        await self._no_swap.wait()
        return self._policy_version

    async def _request(self, token_ids: list[int], vllm_params: Any) -> AsyncIterator[Any]:
        """Run one request through ``AsyncLLM.generate``; abort it if the caller goes away."""
        request_id = f"clawray-{uuid.uuid4().hex}"
        prompt = self._tokens_prompt(prompt_token_ids=token_ids)
        self._in_flight += 1
        try:
            async with aclosing(self._llm.generate(prompt, vllm_params, request_id)) as stream:
                async for out in stream:
                    yield out
        except (asyncio.CancelledError, GeneratorExit):
            await self._llm.abort(request_id)
            raise
        finally:
            self._in_flight -= 1

    async def _ship_weights(self, state_dict: Mapping[str, torch.Tensor]) -> int:
        chunks = pack_weights(state_dict, self._weight_chunk_bytes)
        count = 0
        # Packing copies tensors into host bytes: keep it off the event loop.
        while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
            await self._llm.collective_rpc("clawray_load_weights", args=(chunk,))
            count += len(chunk)
        return count
