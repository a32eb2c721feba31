"""PolicyServer: the deployment that owns an inference engine, and the clients that reach it.

In the default ``colocated`` layout the ingress holds a ``LocalPolicy`` (the engine in its own
process: no extra hop on the hot path). In the ``split`` layout it holds a ``HandlePolicy`` that
calls ``PolicyServer`` replicas through a Serve deployment handle. Admin operations (status,
pause/resume, weight loading) are deployment methods reachable only through Ray handles, never
through an HTTP route.

Inside a Serve replica, ``PolicyCore`` also runs a ``WeightReceiver`` (``weights/receiver.py``):
published weights are swapped in between generation steps, without refusing any request.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import logging
from contextlib import aclosing
from typing import Any, AsyncIterator

from ray import serve

from clawray.config import ClawRayConfig
from clawray.inference.engine import (Engine, EngineError, EngineStatus, SamplingParams,
                                     TokenDelta, TokenOutput)
from clawray.inference.factory import make_engine
from clawray.models.loader import ModelInfo, policy_model_info
from clawray.weights.receiver import WeightReceiver, start_receiver

logger = logging.getLogger(__name__)


def load_policy_engine(cfg: ClawRayConfig) -> tuple[Engine, ModelInfo]:
    info = policy_model_info(cfg)
    engine = make_engine(cfg.model_cfg, cfg.inference_cfg, info)
    logger.info("engine %s ready for %s (context %d)", cfg.inference_cfg.engine, info.name,
                engine.max_model_len)
    return engine, info


class SessionCounts:
    """Requests per session key this replica served (a bounded view, for status and the
    session-affinity tests: a session's turns should all be on one replica)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def seen(self, session_key: str | None) -> None:
        if session_key:
            self.counts[session_key] += 1
            if len(self.counts) > 10_000:  # drop the rarest half
                self.counts = collections.Counter(dict(self.counts.most_common(5_000)))

    def top(self, n: int = 100) -> dict[str, int]:
        return dict(self.counts.most_common(n))


def _serves(engine: Engine, adapter: str) -> bool:
    adapters = getattr(engine, "adapters", None)
    return callable(adapters) and adapter in adapters()


def resolve_adapter(engine: Engine, params: SamplingParams) -> tuple[SamplingParams, bool]:
    """``params`` as this engine can serve them: with ``adapter_fallback``, an adapter the
    engine does not serve now becomes the base policy (then True: fell back)."""
    if params.adapter is None or not params.adapter_fallback or _serves(engine, params.adapter):
        return params, False
    return dataclasses.replace(params, adapter=None, adapter_fallback=False), True


async def generate_on(engine: Engine, prompt_ids: list[int], params: SamplingParams
                      ) -> list[TokenOutput]:
    """``engine.generate`` with ``params.adapter_fallback`` resolved: also when the adapter
    left the engine between the check and the engine taking the request (an LRU eviction, a
    deletion), the base policy serves it; the outputs say ``fell_back``."""
    asked = params
    params, fell_back = resolve_adapter(engine, params)
    try:
        outputs = await engine.generate(prompt_ids, params)
    except EngineError:
        if fell_back or not asked.adapter_fallback or _serves(engine, asked.adapter or ""):
            raise
        params, fell_back = dataclasses.replace(params, adapter=None, adapter_fallback=False), True
        outputs = await engine.generate(prompt_ids, params)
    if fell_back:
        for out in outputs:
            out.fell_back = True
    return outputs


def stream_on(engine: Engine, prompt_ids: list[int], params: SamplingParams
              ) -> AsyncIterator[TokenDelta]:
    """``engine.generate_stream`` with ``params.adapter_fallback`` resolved (the deltas of a
    fallen-back request say ``fell_back``)."""
    params, fell_back = resolve_adapter(engine, params)
    stream = engine.generate_stream(prompt_ids, params)
    return _marked(stream) if fell_back else stream


async def _marked(stream: AsyncIterator[TokenDelta]) -> AsyncIterator[TokenDelta]:
    async with aclosing(stream) as deltas:  # type: ignore[type-var]
        async for delta in deltas:
            delta.fell_back = True
            yield delta


class LocalPolicy:
    """The engine in this process (the colocated layout)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sessions = SessionCounts()

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       session_key: str | None = None) -> list[TokenOutput]:
        self.sessions.seen(session_key)
        return await generate_on(self.engine, prompt_ids, params)

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               session_key: str | None = None) -> AsyncIterator[TokenDelta]:
        self.sessions.seen(session_key)
        return stream_on(self.engine, prompt_ids, params)

    async def status(self) -> EngineStatus:
        status = await self.engine.status()
        status.extra["sessions"] = self.sessions.top()
        return status

    def adapters(self) -> dict[str, int]:
        """Per-user adapters the engine serves now (name -> version)."""
        adapters = getattr(self.engine, "adapters", None)
        return adapters() if callable(adapters) else {}


class HandlePolicy:
    """A PolicyServer deployment behind a Serve handle."""

    def __init__(self, handle: Any, names_adapters: bool = False) -> None:
        self.handle = handle
        self._streaming = handle.options(stream=True)
        # Per-user adapters may be served (inference.max_loras > 0): a request names its
        # user's adapter and the replica falls back to the base if it has none.
        self.names_adapters = names_adapters

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       session_key: str | None = None) -> list[TokenOutput]:
        # session_key is read by the deployment's SessionAffinityRouter (serve/routing.py).
        return await self.handle.generate.remote(prompt_ids, params, session_key=session_key)

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               session_key: str | None = None) -> AsyncIterator[TokenDelta]:
        return self._streaming.generate_stream.remote(prompt_ids, params,
                                                      session_key=session_key)

    async def status(self) -> EngineStatus:
        return await self.handle.status.remote()


class PolicyCore:
    """What a PolicyServer replica does, without Serve (the colocated ingress uses it too).

    In a Serve replica it receives published weights (``self.receiver``); elsewhere (tests,
    scripts) ``receiver`` is None and weights change only through ``load_weights``.
    """

    def __init__(self, cfg: ClawRayConfig) -> None:
        self.engine, self.info = load_policy_engine(cfg)
        self.receiver: WeightReceiver | None = start_receiver(self.engine)
        self.sessions = SessionCounts()
        self.warm_up_s: float | None = None  # set by warm_up (Serve replicas, before traffic)

    async def warm_up(self) -> float:
        """One short request through the engine before the replica takes traffic; returns
        its seconds. vLLM's first request with sampled log-probs (clawray always asks for
        them) costs ~3 s once on CPU (measured: 2.8 s, then 26 ms), which would otherwise land
        on the first user."""
        started = time.monotonic()
        await self.engine.generate([1, 2, 3, 4], SamplingParams(max_tokens=1))
        self.warm_up_s = seconds = time.monotonic() - started
        logger.info("engine warmed up in %.2f s", seconds)
        return seconds

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       session_key: str | None = None) -> list[TokenOutput]:
        self.sessions.seen(session_key)
        return await generate_on(self.engine, prompt_ids, params)

    async def generate_stream(self, prompt_ids: list[int], params: SamplingParams,
                              session_key: str | None = None) -> AsyncIterator[TokenDelta]:
        self.sessions.seen(session_key)
        async for delta in stream_on(self.engine, prompt_ids, params):
            yield delta

    async def prompt_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        return await self.engine.prompt_logprobs(prompt_ids, response_ids)

    async def load_weights(self, state_dict: dict, policy_version: int) -> None:
        await self.engine.load_weights(state_dict, policy_version)

    async def status(self) -> EngineStatus:
        status = await self.engine.status()
        if self.receiver is not None:
            status.extra["replica"] = self.receiver.replica_id
        status.extra["sessions"] = self.sessions.top()
        return status

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    def check_health(self) -> None:
        """Raise when the engine can no longer serve (Serve then restarts the replica)."""
        check = getattr(self.engine, "check_health", None)
        if check is not None:
            check()

    def close(self) -> None:
        receiver = getattr(self, "receiver", None)  # None if the constructor failed early
        if receiver is not None:
            receiver.close()


@serve.deployment(name="PolicyServer")
class PolicyServer(PolicyCore):
    """A Serve replica wrapping one engine (``split`` layout)."""

    async def __init__(self, config: dict) -> None:  # Serve awaits an async constructor
        super().__init__(ClawRayConfig.from_dict(config).apply_log_level())
        await self.warm_up()

    def __del__(self) -> None:  # Serve calls it on shutdown: stop polling, deregister
        self.close()
