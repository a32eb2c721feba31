"""FixedLatencyEngine: the Engine protocol with no model, for benchmarks and protocol tests.

Every request costs ``latency_s`` of ``asyncio.sleep`` (so concurrent requests overlap, like a
batching engine whose step time does not grow with load) and returns either the fixed
``tokens`` or a sequence drawn from ``random.Random(f"{seed}/{index}")``. Log-probs are a pure
function of (position, token id), so ``prompt_logprobs`` of a returned completion equals the
log-probs it came with, as with a real engine. Stop strings are ignored (there is no tokenizer).
"""

from __future__ import annotations

import asyncio
import random
from typing import AsyncIterator, Sequence

from clawray.inference.engine import (
    EngineError,
    EngineOverloaded,
    EngineStatus,
    EngineUnavailable,
    SamplingParams,
    TokenDelta,
    TokenOutput,
    check_prompt_fits,
)


def fake_logprob(position: int, token: int) -> float:
    """A deterministic log-prob in [-5.01, -0.01] for ``token`` at absolute ``position``."""
    return -0.01 - ((position * 7919 + token * 104729) % 1000) / 200.0


class FixedLatencyEngine:
    """A model-free engine with a fixed per-request latency.

    ``tokens`` fixes every reply (cut to ``max_tokens``); without it, replies are
    ``response_len`` ids below ``vocab_size`` from a generator seeded by the request's seed and
    completion index. ``max_running`` bounds in-flight requests (``EngineOverloaded`` beyond it)
    so callers can exercise their overload path.
    """

    def __init__(
        self,
        latency_s: float = 0.02,
        tokens: Sequence[int] | None = None,
        max_model_len: int = 4096,
        *,
        response_len: int = 8,
        vocab_size: int = 256,
        max_running: int | None = None,
        policy_version: int = 0,
        model_name: str = "fixed-latency",
    ) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self.latency_s = latency_s
        self.tokens = list(tokens) if tokens is not None else None
        self.max_model_len = max_model_len
        self.response_len = response_len
        self.vocab_size = vocab_size
        self.max_running = max_running
        self.policy_version = policy_version
        self.model_name = model_name
        self._running = 0
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._closed = False

    def _reply(self, prompt_len: int, params: SamplingParams, index: int) -> tuple[list[int], str]:
        max_new = min(params.max_tokens, self.max_model_len - prompt_len)
        if self.tokens is not None:
            ids = self.tokens
        else:
            rng = random.Random(f"{params.seed}/{index}")
            ids = [rng.randrange(self.vocab_size) for _ in range(self.response_len)]
        return ids[:max_new], "length" if len(ids) > max_new else "stop"

    async def _run(self, prompt_ids: list[int], params: SamplingParams) -> list[TokenOutput]:
        if self._closed:
            raise EngineUnavailable("the engine is shut down")
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        if self.max_running is not None and self._running >= self.max_running:
            raise EngineOverloaded(
                f"engine overloaded: {self._running} requests running; retry later"
            )
        self._running += 1
        try:
            await self._unpaused.wait()
            start = self.policy_version
            await asyncio.sleep(self.latency_s)
            await self._unpaused.wait()
        finally:
            self._running -= 1
        end = self.policy_version if self.policy_version != start else None
        outputs = []
        for i in range(params.n):
            ids, finish = self._reply(len(prompt_ids), params, i)
            logprobs = [fake_logprob(len(prompt_ids) + j, t) for j, t in enumerate(ids)]
            outputs.append(
                TokenOutput(ids, logprobs, finish, start, end, index=i)  # type: ignore[arg-type]
            )
        return outputs

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[TokenOutput]:
        return await self._run(list(prompt_ids), params)

    async def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """After the latency, one delta per token; the last one of each completion finishes it."""
        for out in await self._run(list(prompt_ids), params):
            for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
                last = j == len(out.token_ids) - 1
                yield TokenDelta(
                    [tok],
                    [lp],
                    out.policy_version,
                    out.finish_reason if last else None,
                    index=out.index,
                    policy_version_end=out.policy_version_end if last else None,
                )

    async def prompt_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        check_prompt_fits(len(prompt_ids), self.max_model_len)
        if len(prompt_ids) + len(response_ids) > self.max_model_len:
            raise EngineError("prompt + response is longer than the context window")
        await asyncio.sleep(self.latency_s)
        return [fake_logprob(len(prompt_ids) + j, t) for j, t in enumerate(response_ids)]

    async def load_weights(self, state_dict: dict, policy_version: int) -> None:
        self.policy_version = policy_version

    async def pause(self) -> None:
        self._unpaused.clear()

    async def resume(self) -> None:
        self._unpaused.set()

    async def status(self) -> EngineStatus:
        return EngineStatus(
            engine="fixed_latency",
            model=self.model_name,
            policy_version=self.policy_version,
            max_model_len=self.max_model_len,
            running=self._running,
            waiting=0,
            paused=not self._unpaused.is_set(),
            extra={"latency_s": self.latency_s},
        )

    async def shutdown(self) -> None:
        self._closed = True
