"""The HFEngine's scheduler: one background thread that owns the model and every KV cache.

Each loop iteration is one "step": queued jobs (weight loads, pause barriers) run first, then
cancelled requests are dropped, then at most ``prefill_chunk`` prompt tokens are prefilled
(while others decode, prefill gets about half the time), then one decode step runs for up to
``max_batch`` running sequences. That interleaving is what keeps a long prompt
from freezing everyone else, and taking decode batches round-robin from a deque is what lets a
short request finish while an unrelated long one is still generating. Because jobs only run at
the top of a step, a weight swap never lands in the middle of a forward pass.

Everything here runs on the scheduler thread except the small methods marked "any thread",
which only touch state guarded by ``_cv``. Results leave through each request's ``emit``
callback (the engine wires it to ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable, ContextManager

import torch

from clawray.inference.engine import (
    EngineError,
    EngineInternalError,
    EngineOverloaded,
    EngineUnavailable,
    SamplingParams,
    TokenDelta,
)
from clawray.inference.kv_cache import KV, PaddedBatch, cache_keyword, cache_tensors, make_cache
from clawray.inference.sampling import RowSampling, StopMatcher, make_generator, sample_rows

if TYPE_CHECKING:
    from clawray.inference.multi_lora import MultiLora

logger = logging.getLogger(__name__)
# Pushes one item to the request's consumer; False when the consumer's loop is gone.
Emit = Callable[[object], bool]

_request_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Sequence:
    """One completion being decoded: its cache, its sampled ids, and the next id to feed."""

    req: Request
    index: int
    sampling: RowSampling
    stop: StopMatcher | None
    kv: KV | None = None
    next_input: int = -1
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False


@dataclasses.dataclass(eq=False)
class Request:
    """A generation (``params`` set) or a scoring pass (``params`` None) over ``ids``.

    For scoring, ``ids`` is prompt + response and ``score_from`` the response's first index.
    """

    ids: list[int]
    emit: Emit
    params: SamplingParams | None = None
    max_new: int = 0
    score_from: int = 0
    n: int = 1
    rid: int = dataclasses.field(default_factory=lambda: next(_request_ids))
    cancelled: bool = False  # set from any thread; read by the scheduler
    done: bool = False
    held: int = 0  # KV slots reserved for this request
    policy_version: int = -1
    prefill_pos: int = 0
    kv: KV | None = None
    seqs: list[Sequence] = dataclasses.field(default_factory=list)
    scores: list[float] = dataclasses.field(default_factory=list)
    # Constrained decoding: makes one grammar.RowGrammar per completion (None: free sampling).
    grammar: Callable[[], object] | None = None
    # The LoRA adapter this request runs on (None: the base policy); pinned while it runs.
    adapter: str | None = None
    pinned: bool = False


class Scheduler:
    """Admission (bounded running set + bounded FIFO) and the stepping thread."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        device: torch.device,
        eos_ids: frozenset[int],
        decode: Callable[[list[int]], str] | None,
        max_running: int,
        max_waiting: int,
        prefill_chunk: int,
        max_batch: int,
        policy_version: int,
        lora: MultiLora | None = None,
    ) -> None:
        self.model = model
        self.lora = lora
        self.adapter_versions: dict[str, int] = {}  # per adapter, the version it serves
        self._cache_kw = cache_keyword(model)
        self.device = device
        self.eos_ids = eos_ids
        self.decode = decode
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.policy_version = policy_version
        self.steps = 0
        self.tokens_generated = 0
        # Guarded by _cv.
        self._cv = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()
        self._admitted: list[Request] = []
        self._reserved = 0
        self._jobs: collections.deque[tuple[Callable[[], None], Callable]] = collections.deque()
        self._paused = False
        self._stopping = False
        self._dirty = False
        # Owned by the scheduler thread.
        self._prefilling: collections.deque[Request] = collections.deque()
        self._decoding: collections.deque[Sequence] = collections.deque()
        self._batch: PaddedBatch | None = None  # the last decode batch, reusable by the next
        self._prefill_time = 0.0  # seconds the last prefill round took
        self._decode_time = 0.0  # seconds spent decoding since then
        self._batch_seqs: list[Sequence] = []
        self._thread = threading.Thread(target=self._run, name="hf-engine-scheduler", daemon=True)
        self._thread.start()

    # ---- any thread ------------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Admit ``req`` now, queue it, or raise EngineOverloaded when the queue is full."""
        if req.n > self.max_running:
            raise EngineError(f"n={req.n} exceeds the engine's max_running={self.max_running}")
        with self._cv:
            if self._stopping:
                raise EngineUnavailable("the engine is shut down")
            if not self._waiting and self._reserved + req.n <= self.max_running:
                self._reserve_locked(req)
            elif len(self._waiting) < self.max_waiting:
                self._waiting.append(req)
            else:
                raise EngineOverloaded(
                    f"engine overloaded: {self._reserved} sequences running and "
                    f"{len(self._waiting)} requests waiting (max_waiting={self.max_waiting}); "
                    "retry later"
                )

    def abort(self, req: Request) -> None:
        """Drop ``req``; its cache is freed at the next step."""
        with self._cv:
            req.cancelled = True
            if req in self._waiting:
                self._waiting.remove(req)
            else:
                self._dirty = True
                self._cv.notify()

    def run_between_steps(
        self, fn: Callable[[], None], done: Callable[[BaseException | None], None]
    ) -> None:
        """Run ``fn`` on the scheduler thread before the next step; report through ``done``."""
        with self._cv:
            if self._stopping:
                raise EngineUnavailable("the engine is shut down")
            self._jobs.append((fn, done))
            self._cv.notify()

    def set_paused(self, paused: bool) -> None:
        with self._cv:
            self._paused = paused
            self._cv.notify()

    def counts(self) -> tuple[int, int, bool]:
        """(sequences holding a KV slot, requests waiting, paused)."""
        with self._cv:
            return self._reserved, len(self._waiting), self._paused

    def stop(self) -> None:
        """Stop the thread (blocking) and fail whatever was still in flight."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()

    # ---- slot bookkeeping (any thread, under _cv) --------------------------------------------

    def _reserve_locked(self, req: Request) -> None:
        self._reserved += req.n
        req.held = req.n
        self._admitted.append(req)
        self._cv.notify()

    def _release(self, req: Request, k: int) -> None:
        with self._cv:
            self._reserved -= k
            req.held -= k
            while self._waiting and self._reserved + self._waiting[0].n <= self.max_running:
                self._reserve_locked(self._waiting.popleft())

    # ---- the scheduler thread ----------------------------------------------------------------

    def _ready_locked(self) -> bool:
        busy = bool(self._admitted or self._prefilling or self._decoding)
        return self._stopping or bool(self._jobs) or self._dirty or (not self._paused and busy)

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._ready_locked():
                        self._cv.wait()
                    if self._stopping:
                        break
                    jobs = list(self._jobs)
                    self._jobs.clear()
                    self._prefilling.extend(self._admitted)
                    self._admitted = []
                    paused, self._dirty = self._paused, False
                for fn, done in jobs:
                    try:
                        fn()
                    except Exception as exc:  # reported to the caller, never kills the loop
                        done(exc)
                    else:
                        done(None)
                self._reap()
                if paused:
                    continue
                try:
                    self._step()
                except Exception as exc:
                    logger.exception("scheduler step failed; failing every in-flight request")
                    for req in self._active():
                        self._fail(req, EngineInternalError(f"engine step failed: {exc!r}"))
        with self._cv:
            left = list(self._waiting) + self._admitted
            self._waiting.clear()
            self._admitted = []
        for req in left + self._active():
            self._fail(req, EngineUnavailable("the engine was shut down"))

    def _active(self) -> list[Request]:
        reqs = {id(r): r for r in self._prefilling}
        reqs.update((id(s.req), s.req) for s in self._decoding)
        return [r for r in reqs.values() if not r.done]

    def _reap(self) -> None:
        """Free the caches of cancelled or finished work."""
        for req in [r for r in self._prefilling if r.cancelled or r.done]:
            self._prefilling.remove(req)
            self._drop(req)
        if any(s.finished or s.req.cancelled for s in self._decoding):
            for seq in self._decoding:
                if seq.req.cancelled:
                    self._drop(seq.req)
            self._decoding = collections.deque(s for s in self._decoding if not s.finished)

    def _drop(self, req: Request) -> None:
        if req.done:
            return
        req.done = True
        self._unpin(req)
        req.kv = None
        for seq in req.seqs:
            seq.finished, seq.kv = True, None
        self._release(req, req.held)

    def _fail(self, req: Request, exc: BaseException) -> None:
        if not req.done:
            logger.error(
                "request %d failed (policy version %d): %r", req.rid, req.policy_version, exc
            )
            req.emit(exc)
            self._drop(req)

    def _step(self) -> None:
        """Maybe a prefill round, then one decode batch.

        A prefill round feeds up to ``prefill_chunk`` prompt tokens (several short prompts, or
        one chunk of a long one; each prompt visited once, in rotation). While sequences are
        decoding, a round only starts once decode steps have had as much time as the previous
        round took: a chunk deep into an 18k-token prompt costs far more than a decode step,
        and this keeps running requests at no less than about half their speed.
        """
        self.steps += 1
        if self._prefilling and (not self._decoding or self._decode_time >= self._prefill_time):
            started = time.perf_counter()
            budget = self.prefill_chunk
            for _ in range(len(self._prefilling)):
                if budget <= 0:
                    break
                req = self._prefilling.popleft()
                try:
                    budget -= self._prefill_chunk(req, budget)
                except EngineError as exc:  # the request's own fault (an unknown adapter)
                    self._fail(req, exc)
                except Exception as exc:
                    self._fail(req, EngineInternalError(f"prefill failed: {exc!r}"))
            self._prefill_time, self._decode_time = time.perf_counter() - started, 0.0
        started = time.perf_counter()
        self._decode_step()
        self._decode_time += time.perf_counter() - started

    def _prefill_chunk(self, req: Request, budget: int) -> int:
        """Feed up to ``budget`` more prompt ids of ``req`` and return how many were fed.

        After the last chunk the request starts decoding (or, for scoring, is answered).
        """
        if req.prefill_pos == 0:
            if req.adapter is not None:
                if self.lora is None or req.adapter not in self.lora:
                    raise EngineError(f"adapter {req.adapter!r} is not loaded")
                self.lora.pin(req.adapter)
                req.pinned = True
            req.policy_version = self._version(req)
        scoring = req.params is None
        # A scoring pass never needs the cache entry of its last id.
        feed_len = len(req.ids) - 1 if scoring else len(req.ids)
        start = req.prefill_pos
        end = min(start + budget, feed_len)
        keep = end - max(start, req.score_from - 1) if scoring else 1
        cache = make_cache(req.kv)
        inputs = torch.tensor([req.ids[start:end]], device=self.device)
        with self._rows([req.adapter]):
            out = self.model(input_ids=inputs, **{self._cache_kw: cache}, use_cache=True,
                             logits_to_keep=max(keep, 1))
        req.kv, req.prefill_pos = cache_tensors(cache), end
        if scoring and keep > 0:
            logp = torch.log_softmax(out.logits[0].float(), dim=-1)
            targets = torch.tensor(req.ids[end - keep + 1 : end + 1], device=logp.device)
            req.scores.extend(logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist())
        if end < feed_len:
            self._prefilling.append(req)
        elif scoring:
            req.emit(req.scores)
            self._drop(req)
        else:
            self._start_decoding(req, out.logits[0, -1])
        return end - start

    def _start_decoding(self, req: Request, last_logits: torch.Tensor) -> None:
        """Sample every completion's first token from the prompt's logits; they share its cache."""
        params = req.params
        assert params is not None
        for i in range(req.n):
            gen = make_generator(params.seed, i, self.device) if params.temperature > 0 else None
            stop = StopMatcher(params.stop, self.decode) if params.stop and self.decode else None
            generated: list[int] = []
            sampling = RowSampling(
                params.temperature, params.top_p, gen, params.top_logprobs,
                params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                params.logit_bias, generated, req.ids,
                req.grammar() if req.grammar is not None else None)
            req.seqs.append(Sequence(req, i, sampling, stop, req.kv, token_ids=generated))
        req.kv = None
        logits = last_logits.unsqueeze(0).expand(req.n, -1)
        ids, lps, tops = sample_rows(logits, [s.sampling for s in req.seqs])
        deltas = [self._accept(seq, tok, lp, top)
                  for seq, tok, lp, top in zip(req.seqs, ids, lps, tops)]
        self._emit(req, deltas)
        self._decoding.extend(s for s in req.seqs if not s.finished)

    def _decode_step(self) -> None:
        """One token for up to ``max_batch`` sequences, taken round-robin from the deque."""
        batch: list[Sequence] = []
        while self._decoding and len(batch) < self.max_batch:
            seq = self._decoding.popleft()
            if not (seq.finished or seq.req.done):
                batch.append(seq)
        if not batch:
            self._batch, self._batch_seqs = None, []  # free the last padded batch
            return
        try:
            logits, kvs = self._forward_decode(batch)
            ids, lps, tops = sample_rows(logits, [s.sampling for s in batch])
        except Exception as exc:
            for req in {id(s.req): s.req for s in batch}.values():
                self._fail(req, EngineInternalError(f"decode step failed: {exc!r}"))
            return
        by_req: dict[int, tuple[Request, list[TokenDelta]]] = {}
        for seq, kv, tok, lp, top in zip(batch, kvs, ids, lps, tops):
            seq.kv = kv
            by_req.setdefault(id(seq.req), (seq.req, []))[1].append(
                self._accept(seq, tok, lp, top))
        for req, deltas in by_req.values():
            self._emit(req, deltas)
        self._decoding.extend(s for s in batch if not s.finished)

    def _forward_decode(self, batch: list[Sequence]) -> tuple[torch.Tensor, list[KV]]:
        """Run one decode forward; several sequences go in one left-padded batch.

        The padded batch is kept and stepped again while the same sequences decode together
        (the common case when no more than ``max_batch`` are running); it is rebuilt, one copy
        of the caches, when a sequence joins or leaves. On a 2-core CPU a batched step of 16
        sequences is several times faster than 16 single-sequence steps.
        """
        inputs = torch.tensor([[s.next_input] for s in batch], device=self.device)
        same = self._batch is not None and len(batch) == len(self._batch_seqs) and all(
            a is b for a, b in zip(batch, self._batch_seqs)
        )
        padded = self._batch if same else None
        self._batch, self._batch_seqs = None, []  # a failed forward may leave it half-updated
        rows = self._rows([s.req.adapter for s in batch])
        if len(batch) == 1:
            cache = make_cache(batch[0].kv)
            with rows:
                out = self.model(input_ids=inputs, **{self._cache_kw: cache}, use_cache=True)
            return out.logits[:, -1], [cache_tensors(cache)]
        if padded is None:
            padded = PaddedBatch.stack([s.kv for s in batch], self.device)  # type: ignore[misc]
        with rows:
            out = self.model(
                input_ids=inputs, **{self._cache_kw: padded.cache}, attention_mask=padded.mask,
                position_ids=padded.positions, use_cache=True,
            )
        self._batch, self._batch_seqs = padded, batch
        return out.logits[:, -1], padded.stepped()

    def _accept(self, seq: Sequence, token: int, logprob: float,
                top: list[tuple[int, float]] | None = None) -> TokenDelta:
        """Record a sampled token and decide whether its completion is finished."""
        req = seq.req
        now = self._version(req)
        delta = TokenDelta([token], [logprob], req.policy_version, index=seq.index,
                           token_versions=[now],
                           top_logprobs=[top] if top is not None else None)
        if req.done:  # failed earlier in this step; its consumer already has the error
            return delta
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        self.tokens_generated += 1
        grammar = seq.sampling.grammar
        if grammar is not None and not grammar.accept(token):
            self._fail(req, EngineInternalError(f"token {token} was sampled but the output "
                                                "grammar refuses it"))
            return delta
        stop_string = None
        if seq.stop is not None and token not in self.eos_ids:
            try:
                stop_string = seq.stop.check(seq.token_ids)
            except Exception as exc:  # a broken detokenizer fails this request only
                self._fail(req, EngineInternalError(f"stop-string check failed: {exc!r}"))
                return delta
        is_eos = token in self.eos_ids and not (req.params is not None and req.params.ignore_eos)
        if is_eos or stop_string is not None or (grammar is not None and grammar.terminated):
            finish = "stop"
        elif len(seq.token_ids) >= req.max_new:
            finish = "length"
        else:
            finish = None
        delta.finish_reason, delta.stop_string = finish, stop_string
        if finish is None:
            seq.next_input = token
            return delta
        if now != req.policy_version:
            delta.policy_version_end = now
        seq.finished, seq.kv = True, None
        self._release(req, 1)
        if all(s.finished for s in req.seqs):
            req.done = True
            self._unpin(req)
        return delta

    def _unpin(self, req: Request) -> None:
        if req.pinned and self.lora is not None:
            req.pinned = False
            self.lora.unpin(req.adapter)

    def _version(self, req: Request) -> int:
        """The version ``req``'s policy is at now: its adapter's, or the base weights'."""
        if req.adapter is None:
            return self.policy_version
        return self.adapter_versions.get(req.adapter, 0)

    def _rows(self, adapters: list[str | None]) -> ContextManager[None]:
        """Run the next forward with each row on its adapter (a no-op without adapters)."""
        if self.lora is None or all(a is None for a in adapters):
            return contextlib.nullcontext()
        return self.lora.rows(adapters)

    def _emit(self, req: Request, deltas: list[TokenDelta]) -> None:
        if not req.emit(deltas):
            req.cancelled = True
