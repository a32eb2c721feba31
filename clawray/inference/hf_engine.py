"""HFEngine: the transformers inference engine (CPU or GPU), token-in/token-out.

The asyncio side is thin: it validates a request, hands it to the scheduler thread
(``hf_scheduler.py``) and reads results from a per-request ``asyncio.Queue`` that the thread
fills through ``loop.call_soon_threadsafe``. The event loop never runs a forward pass.

Conventions every caller should know:

* The returned ids are exactly what was sampled. An end-of-sequence id (``<|im_end|>`` ...) is
  *included*, with its log-prob, because the learner must learn to stop.
* On a stop string the ids keep every generated token, including the one that completed the
  string; ``stop_string`` says which one matched, and the caller cuts the decoded text before it
  (OpenAI semantics). Stop strings need a ``tokenizer`` or ``decode`` function.
* Log-probs are those of the raw model distribution (temperature 1, before top-p), one per id,
  and equal what ``prompt_logprobs`` computes for the same ids.
* ``max_tokens`` is clamped so prompt + output never exceeds ``max_model_len``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import numbers
import os
from typing import Any, AsyncIterator, Callable, Iterable

import torch

from clawray.files import write_atomic
from clawray.inference.engine import (
    EngineError,
    EngineStatus,
    EngineUnavailable,
    SamplingParams,
    TokenDelta,
    TokenOutput,
    gather_outputs,
    check_prompt_fits,
)
from clawray.inference.hf_scheduler import Emit, Request, Scheduler

_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")


def _ids(value: int | Iterable[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def resolve_eos_ids(model: torch.nn.Module, tokenizer: Any | None) -> frozenset[int]:
    """End-of-sequence ids from the model's configs and the tokenizer's chat end tokens."""
    ids = _ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    ids |= _ids(getattr(getattr(model, "config", None), "eos_token_id", None))
    if tokenizer is not None:
        ids |= _ids(getattr(tokenizer, "eos_token_id", None))
        # tokenizers.Tokenizer has token_to_id; transformers tokenizers convert_tokens_to_ids.
        to_id = getattr(tokenizer, "token_to_id", None) or getattr(
            tokenizer, "convert_tokens_to_ids", None
        )
        unk = getattr(tokenizer, "unk_token_id", None)
        for token in _EOS_TOKENS:
            found = to_id(token) if to_id else None
            if isinstance(found, int) and found != unk:
                ids.add(found)
    return frozenset(ids)


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """``"auto"`` means CUDA when present, else CPU; ``None`` keeps the model where it is."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return None if device is None else torch.device(device)


def copy_weights(model: torch.nn.Module, state_dict: dict) -> None:
    """Copy ``state_dict`` (all or some of the model's names) into ``model`` in place.

    Every name and shape is checked before the first copy, so a bad state dict changes nothing.
    """
    own = model.state_dict()
    unknown = sorted(k for k in state_dict if k not in own)
    if unknown:
        raise EngineError(f"load_weights: unknown parameter names {unknown[:5]}")
    wrong = sorted(k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape))
    if wrong:
        raise EngineError(f"load_weights: shape mismatch for {wrong[:5]}")
    with torch.no_grad():
        for name, value in state_dict.items():
            own[name].copy_(value)


def _emitter(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> Emit:
    def emit(item: object) -> bool:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            return False
        return True

    return emit


class HFEngine:
    """Serves a transformers causal LM with per-request KV caches and a stepping thread.

    At most ``max_running`` sequences hold a KV cache; up to ``max_waiting`` more requests wait
    in FIFO order, beyond that ``EngineOverloaded`` is raised. Prompts are prefilled in chunks
    of ``prefill_chunk`` tokens interleaved with decode steps of up to ``max_batch`` sequences.
    ``decode`` (or the tokenizer's ``decode``) is only needed for stop strings; end-of-sequence
    ids default to the model's and the tokenizer's (``<|im_end|>``, ``<|endoftext|>`` ...).

    On a small shared CPU machine, give torch one intra-op thread (Ray actors get
    ``OMP_NUM_THREADS=1`` by default): with 2 threads on 2 busy cores, decoding was measured
    up to ~50x slower than with one.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any | None = None,
        max_model_len: int | None = None,
        *,
        eos_token_ids: Iterable[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        max_running: int = 16,
        max_waiting: int = 256,
        prefill_chunk: int = 512,
        max_batch: int = 16,
        policy_version: int = 0,
        device: str | torch.device | None = None,
        model_name: str | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 64,
    ) -> None:
        sizes = {"max_running": max_running, "prefill_chunk": prefill_chunk, "max_batch": max_batch}
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        target = resolve_device(device)
        if target is not None:
            model = model.to(target)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        config = model.config
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.model_name = model_name or getattr(config, "_name_or_path", "") or type(model).__name__
        if decode is None and tokenizer is not None:

            def decode(ids: list[int]) -> str:
                return tokenizer.decode(ids, skip_special_tokens=True)

        self._decode = decode
        self._tokenizer = tokenizer
        self._grammars: Any = None  # grammar.Grammars, built on the first constrained request
        if eos_token_ids is not None:
            eos = frozenset(eos_token_ids)
        else:
            eos = resolve_eos_ids(model, tokenizer)
        self.eos_token_ids = eos
        # Per-user policies: up to ``max_loras`` LoRA adapters resident, rows of different
        # adapters decoded in one batch (clawray/inference/multi_lora.py); 0: none.
        self._lora = None
        # Every adapter loaded is also written to a private folder on disk (name -> (file,
        # version)): one evicted from the resident set is still served, read back on its next
        # request (as vLLM does with its PEFT folders), so users are bounded by disk.
        self._stored: dict[str, tuple[str, int]] = {}
        self._store_dir: str | None = None
        if max_loras:
            from clawray.inference.multi_lora import MultiLora

            self._lora = MultiLora(model, max_loras=max_loras, max_rank=max_lora_rank)
        self._scheduler = Scheduler(
            model,
            device=self.device,
            eos_ids=eos,
            decode=decode,
            max_running=max_running,
            max_waiting=max_waiting,
            prefill_chunk=prefill_chunk,
            max_batch=max_batch,
            policy_version=policy_version,
            lora=self._lora,
        )
        self._closed = False

    @classmethod
    def from_path(
        cls, path: str | os.PathLike, *, dtype: torch.dtype | str | None = None, **kwargs: Any
    ) -> HFEngine:
        """Load a local Hugging Face checkpoint (model + tokenizer) and serve it.

        ``dtype`` is a torch dtype, its name (``"bfloat16"``) or ``"auto"``; other keywords go to
        the constructor (``device="auto"`` picks CUDA when present).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        load_kw: dict[str, Any] = {"local_files_only": True, "attn_implementation": "sdpa"}
        if dtype is not None:
            named = isinstance(dtype, str) and dtype != "auto"
            load_kw["dtype"] = getattr(torch, dtype) if named else dtype
        model = AutoModelForCausalLM.from_pretrained(path, **load_kw)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        kwargs.setdefault("model_name", str(path))
        return cls(model, tokenizer, **kwargs)

    @property
    def policy_version(self) -> int:
        return self._scheduler.policy_version

    # ---- requests ----------------------------------------------------------------------------

    def _as_ids(self, ids: Iterable[int], what: str) -> list[int]:
        """``ids`` as a list of Python ints, rejecting anything outside the vocabulary."""
        ids = list(ids)
        bad = [t for t in ids if not (isinstance(t, numbers.Integral) and 0 <= t < self.vocab_size)]
        if bad:
            raise EngineError(
                f"{what} holds ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )
        return [int(t) for t in ids]

    def _request(self, ids: list[int], **fields: Any) -> tuple[Request, asyncio.Queue]:
        if self._closed:
            raise EngineUnavailable("the engine is shut down")
        queue: asyncio.Queue = asyncio.Queue()
        return Request(ids=ids, emit=_emitter(asyncio.get_running_loop(), queue), **fields), queue

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[TokenOutput]:
        """Sample ``params.n`` completions; cancelling the awaiting task aborts them."""
        async with contextlib.aclosing(self.generate_stream(prompt_ids, params)) as stream:
            return await gather_outputs(stream, params.n)

    async def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Yield one delta per sampled token (``index`` tells completions apart).

        Closing the iterator early (``break`` then ``aclose()``, or garbage collection) aborts
        the request and frees its cache at the next step.
        """
        prompt_ids = self._as_ids(prompt_ids, "the prompt")
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        if params.stop and self._decode is None:
            raise EngineError("stop strings need an engine built with a tokenizer or decode=")
        max_new = min(params.max_tokens, self.max_model_len - len(prompt_ids))
        grammar = None
        if params.structural_tag is not None:
            grammar = await asyncio.to_thread(self._grammar_factory, params.structural_tag)
        if params.adapter is not None and self._lora is None:
            raise EngineError("this engine serves no LoRA adapters (start it with max_loras > 0)")
        if params.adapter is not None and params.adapter not in self._lora:
            await self._restore(params.adapter)
        req, queue = self._request(prompt_ids, params=params, max_new=max_new, n=params.n,
                                   grammar=grammar, adapter=params.adapter)
        self._scheduler.submit(req)
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                for delta in item:
                    if delta.finish_reason is not None:
                        remaining -= 1
                    yield delta
        finally:
            if remaining:
                self._scheduler.abort(req)

    def _grammar_factory(self, structural_tag: str) -> Callable[[], Any]:
        """Compile ``structural_tag`` (any thread) and return a maker of per-completion matchers."""
        if self._tokenizer is None:
            raise EngineError("constrained decoding needs an engine built with a tokenizer")
        if self._grammars is None:
            from clawray.inference.grammar import Grammars

            self._grammars = Grammars(self._tokenizer, self.vocab_size, self.eos_token_ids)
        compiled = self._grammars.compile(structural_tag)
        return functools.partial(self._grammars.row, compiled)

    async def prompt_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Raw log-prob of each response id given the prompt and the response ids before it.

        Runs through the same chunked prefill as generation, so a long teacher prompt is
        interleaved with other requests instead of stalling them.
        """
        prompt_ids = self._as_ids(prompt_ids, "the prompt")
        response_ids = self._as_ids(response_ids, "the response")
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        total = len(prompt_ids) + len(response_ids)
        if total > self.max_model_len:
            raise EngineError(
                f"prompt + response is {total} tokens, more than the context window of "
                f"{self.max_model_len}"
            )
        if not response_ids:
            return []
        req, queue = self._request(prompt_ids + response_ids, score_from=len(prompt_ids))
        self._scheduler.submit(req)
        finished = False
        try:
            item = await queue.get()
            finished = True
        finally:
            if not finished:
                self._scheduler.abort(req)
        if isinstance(item, BaseException):
            raise item
        return item

    # ---- control -----------------------------------------------------------------------------

    async def _between_steps(self, fn: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if not future.done():
                future.set_exception(exc) if exc else future.set_result(None)

        def done(exc: BaseException | None) -> None:
            loop.call_soon_threadsafe(settle, exc)

        self._scheduler.run_between_steps(fn, done)
        await future

    async def load_weights(self, state_dict: dict, policy_version: int) -> None:
        """Copy new weights in between two steps; in-flight requests continue on them.

        Requests that started on the old weights report ``policy_version_end``. A state dict
        with unknown names or wrong shapes raises EngineError and changes nothing. Names may
        be a subset of the model's (e.g. only the trained layers).
        """
        def swap() -> None:  # runs on the scheduler thread, between two steps
            copy_weights(self.model, state_dict)
            self._scheduler.policy_version = policy_version

        await self._between_steps(swap)

    async def load_adapter(self, name: str, payload: Any, version: int) -> list[str]:
        """Serve ``name`` (a clawray LoRA payload) at ``version`` from the next step on,
        replacing an adapter of that name; requests already running on it continue on the new
        tensors and report ``policy_version_end``. Returns the adapters evicted to make room
        (least recently used, none in use). A bad payload raises EngineError, changing nothing.
        """
        if self._lora is None:
            raise EngineError("this engine serves no LoRA adapters (start it with max_loras > 0)")
        from clawray.inference.multi_lora import LoraError

        evicted: list[str] = []

        def add() -> None:
            try:
                evicted.extend(self._lora.add(name, payload))
            except LoraError as exc:
                raise EngineError(str(exc)) from None
            self._scheduler.adapter_versions[name] = int(version)

        await self._between_steps(add)
        self._stored[name] = (await asyncio.to_thread(self._store, name, payload), int(version))
        return evicted

    def _store(self, name: str, payload: Any) -> str:
        import hashlib
        import tempfile

        if self._store_dir is None:
            self._store_dir = tempfile.mkdtemp(prefix="clawray-adapters-")
        path = os.path.join(self._store_dir,
                            hashlib.sha256(name.encode()).hexdigest()[:24] + ".pt")
        write_atomic(path, lambda f: torch.save(payload, f))
        return path

    async def _restore(self, name: str) -> None:
        """Make a stored adapter resident again (evicting the least recently used idle one);
        an adapter never loaded stays an error at admission ("not loaded")."""
        stored = self._stored.get(name)
        if stored is None:
            return
        path, version = stored
        payload = await asyncio.to_thread(torch.load, path, weights_only=True)

        def add() -> None:
            if name not in self._lora and self._stored.get(name) == stored:
                self._lora.add(name, payload)
                self._scheduler.adapter_versions[name] = version

        await self._between_steps(add)

    async def unload_adapter(self, name: str) -> bool:
        """Forget adapter ``name`` (refused while requests run on it); False if not loaded."""
        if self._lora is None:
            return False
        from clawray.inference.multi_lora import LoraError

        removed: list[bool] = []

        def remove() -> None:
            try:
                removed.append(self._lora.remove(name))
            except LoraError as exc:
                raise EngineError(str(exc)) from None
            self._scheduler.adapter_versions.pop(name, None)

        await self._between_steps(remove)
        stored = self._stored.pop(name, None)
        if stored is not None:
            with contextlib.suppress(OSError):
                os.unlink(stored[0])
        return removed[0] or stored is not None

    def adapters(self) -> dict[str, int]:
        """Adapters served and the version of each: the resident ones (least recently used
        first), then those read back from disk on their next request."""
        if self._lora is None:
            return {}
        versions = dict(self._scheduler.adapter_versions)
        out = {n: versions.get(n, 0) for n in self._lora.names()}
        out.update((n, v) for n, (_, v) in self._stored.items() if n not in out)
        return out

    def resident_adapters(self) -> list[str]:
        """The adapters in memory now (at most ``max_loras``), least recently used first."""
        return [] if self._lora is None else self._lora.names()

    async def pause(self) -> None:
        """Hold generation between steps (nothing is dropped); returns once no step runs."""
        self._scheduler.set_paused(True)
        await self._between_steps(lambda: None)

    async def resume(self) -> None:
        self._scheduler.set_paused(False)

    async def status(self) -> EngineStatus:
        running, waiting, paused = self._scheduler.counts()
        return EngineStatus(
            engine="hf",
            model=self.model_name,
            policy_version=self._scheduler.policy_version,
            max_model_len=self.max_model_len,
            running=running,
            waiting=waiting,
            paused=paused,
            extra={
                "device": str(self.device),
                "steps": self._scheduler.steps,
                "tokens_generated": self._scheduler.tokens_generated,
                **({"adapters": self.adapters(), "max_loras": self._lora.max_loras}
                   if self._lora is not None else {}),
            },
        )

    async def shutdown(self) -> None:
        """Stop the scheduler thread; requests still in flight fail with EngineError."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._scheduler.stop)
        if self._store_dir is not None:
            import shutil

            shutil.rmtree(self._store_dir, ignore_errors=True)
