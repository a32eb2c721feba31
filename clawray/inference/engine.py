"""The token-in/token-out inference protocol every engine implements.

Engines never see text: the ingress applies the chat template and hands over prompt ids, and
gets back the exact ids the engine sampled with their log-probs. That is what keeps training
samples token-exact (no re-tokenization anywhere between serving and the learner).

Log-probs are those of the *raw* model distribution (temperature 1, no top-p), the same
convention as vLLM's default ``logprobs_mode="raw_logprobs"``; the sampling settings that
shaped the behaviour policy travel with the record.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one request (OpenAI names, engine-neutral)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1
    # Keep sampling past end-of-sequence tokens (benchmarks, tests); vLLM has the same flag.
    ignore_eos: bool = False
    # The most likely alternatives (id, raw log-prob) to report at each position, 0-20.
    top_logprobs: int = 0
    # OpenAI's penalties (-2..2), vLLM's repetition penalty (> 0, 1 = off), and additive
    # biases for named token ids (-100..100), applied before sampling.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Constrained decoding: an xgrammar structural tag (JSON text, ``{"type": "structural_tag",
    # "format": ...}``) the completion must match; every token outside it is masked before
    # sampling. vLLM takes it as ``structured_outputs.structural_tag``; the transformers engine
    # compiles it with xgrammar. Built by clawray.serve.structured (JSON answers, tool calls).
    structural_tag: str | None = None
    # The LoRA adapter to sample from (per-user policies: the engine's ``load_adapter``);
    # None: the base (shared) policy.
    adapter: str | None = None
    # With ``adapter``: when the engine does not serve that adapter (not published yet,
    # evicted, a replica that has not caught up), the base policy samples instead and the
    # outputs say so (``fell_back``); without it, such a request fails. Resolved by the policy
    # clients of clawray.serve.policy_server, in front of the engine.
    adapter_fallback: bool = False

    def __post_init__(self) -> None:
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"adapter must be a non-empty name or None, got {self.adapter!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")


@dataclasses.dataclass
class TokenOutput:
    """One finished completion: the ids the engine produced, exactly."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    policy_version: int
    # Set when the weights changed while this completion was being generated.
    policy_version_end: int | None = None
    # Index of the stop string that ended generation, if any (text is cut before it).
    stop_string: str | None = None
    index: int = 0
    # Prompt tokens served from the engine's prefix cache (None: the engine has no such cache).
    cached_tokens: int | None = None
    # The policy version that sampled each token (one per id): a completion that spans a
    # weight swap is described exactly. None: every token is on ``policy_version``.
    token_versions: list[int] | None = None
    # With params.top_logprobs > 0: per token, the most likely (id, raw log-prob), best first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # params.adapter was not served here and the base policy sampled this (adapter_fallback).
    fell_back: bool = False

    def versions(self) -> list[int]:
        """One policy version per token id."""
        return _versions(self)


@dataclasses.dataclass
class TokenDelta:
    """A streamed piece of one completion: new token ids since the last delta.

    The final delta of a completion has ``finish_reason`` set (and may carry no new ids).
    """

    token_ids: list[int]
    logprobs: list[float]
    policy_version: int
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    index: int = 0
    # On the final delta only: the version in force at the end, when the weights changed mid-way.
    policy_version_end: int | None = None
    # On the first delta of a completion: prompt tokens served from the prefix cache.
    cached_tokens: int | None = None
    # The policy version that sampled each of ``token_ids`` (None: all on policy_version).
    token_versions: list[int] | None = None
    # With params.top_logprobs > 0: per token id, the most likely (id, raw log-prob).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # params.adapter was not served here and the base policy sampled this (adapter_fallback).
    fell_back: bool = False

    def versions(self) -> list[int]:
        """One policy version per token id."""
        return _versions(self)


def _versions(out: TokenOutput | TokenDelta) -> list[int]:
    if out.token_versions is not None:
        return list(out.token_versions)
    return [out.policy_version] * len(out.token_ids)


@dataclasses.dataclass
class EngineStatus:
    engine: str
    model: str
    policy_version: int
    max_model_len: int
    running: int
    waiting: int
    paused: bool
    extra: dict = dataclasses.field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What the PolicyServer (and later the judge and env runners) need from an engine."""

    max_model_len: int

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[TokenOutput]:
        """Sample ``params.n`` completions of ``prompt_ids``."""
        ...

    def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenDelta]:
        """Yield tokens as they are sampled; cancelling the iterator aborts the request."""
        ...

    async def prompt_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Log-prob of each of ``response_ids`` given ``prompt_ids`` and the ids before it."""
        ...

    async def load_weights(self, state_dict: dict, policy_version: int) -> None:
        """Swap in new weights between generation steps and adopt ``policy_version``."""
        ...

    async def pause(self) -> None:
        """Hold generation between steps (nothing is dropped) until ``resume``."""
        ...

    async def resume(self) -> None: ...

    async def status(self) -> EngineStatus: ...

    async def shutdown(self) -> None: ...


async def gather_outputs(stream: AsyncIterator[TokenDelta], n: int) -> list[TokenOutput]:
    """The ``n`` finished completions of a ``generate_stream``, every token with its version.

    A completion whose final delta never came stays ``finish_reason="abort"`` with
    ``policy_version == -1``.
    """
    outputs = [TokenOutput([], [], "abort", -1, index=i, token_versions=[]) for i in range(n)]
    async for delta in stream:
        out = outputs[delta.index]
        out.token_ids.extend(delta.token_ids)
        out.logprobs.extend(delta.logprobs)
        out.token_versions.extend(delta.versions())  # type: ignore[union-attr]
        if delta.top_logprobs is not None:
            out.top_logprobs = (out.top_logprobs or []) + list(delta.top_logprobs)
        out.policy_version = delta.policy_version
        if delta.cached_tokens is not None:
            out.cached_tokens = delta.cached_tokens
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
            out.stop_string = delta.stop_string
            out.policy_version_end = delta.policy_version_end
    return outputs


class EngineError(RuntimeError):
    """An engine could not serve a request for a reason the client should see (e.g. length):
    HTTP 400; a retry of the same request fails the same way."""


class EngineInternalError(EngineError):
    """The engine failed a request for a reason of its own (a failed step, an internal vLLM
    error, inconsistent output): HTTP 500, which clients retry."""


class EngineUnavailable(EngineError):
    """The engine cannot serve at all (shut down, or its process died): HTTP 503; the replica
    is restarted through its health check."""


class EngineOverloaded(EngineError):
    """The engine's waiting queue is full; the client should retry later (HTTP 429/503)."""


def check_prompt_fits(prompt_len: int, max_model_len: int) -> None:
    """Raise a precise error when a prompt leaves no room for even one new token."""
    if prompt_len == 0:
        raise EngineError("the prompt is empty")
    if prompt_len >= max_model_len:
        raise EngineError(
            f"the prompt has {prompt_len} tokens but the model's context window is "
            f"{max_model_len} tokens, leaving no room for a reply"
        )
