"""Judge backends: who writes the judge's outputs and, for OPD, the teacher log-probs.

- ``FunctionBackend``: a Python callable by import path (the heuristic rule judge by default);
- ``OpenAIBackend``: any OpenAI-compatible chat endpoint (votes only: a chat API cannot score
  given token ids, so it cannot be an OPD teacher);
- ``ServerBackend``: a ``JudgeServer`` deployment behind a Serve handle (votes and teacher).

Retries and timeouts belong to the caller (the voter), so the OpenAI client here does not
retry on its own and retries never multiply.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pkgutil
import re
from typing import Any, Protocol, runtime_checkable

from clawray.config import JudgeConfig
from clawray.judging.formats import output_format
from clawray.judging.prompts import JudgeRequest


class JudgeUnavailable(RuntimeError):
    """The configured backend cannot do what was asked (e.g. teacher log-probs over a chat API)."""


@runtime_checkable
class JudgeBackend(Protocol):
    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        """``n`` sampled judge outputs for ``request.messages``."""
        ...

    async def teacher_logprobs(self, messages: list[dict], tools: list[dict] | None,
                               response_ids: list[int]) -> list[float]:
        """log p(each response id | chat-templated messages with a generation prompt)."""
        ...


def import_object(path: str) -> Any:
    """``"package.module:attr"`` (``attr`` may be dotted) → the object."""
    module_name, sep, attr = path.partition(":")
    try:
        if not sep or not module_name or not attr:
            raise ValueError(path)
        return pkgutil.resolve_name(path)
    except ImportError as e:
        raise ValueError(f"cannot import judge module {module_name!r}: {e}") from e
    except AttributeError:
        raise ValueError(f"judge function {path!r}: {attr!r} not found") from None
    except ValueError as e:  # resolve_name: not identifiers
        raise ValueError(f"judge function {path!r} must look like 'package.module:attr'") from e


async def _call(fn: Any, *args: Any) -> Any:
    """Await an async callable; run a sync one in a worker thread (it may block)."""
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


class FunctionBackend:
    """A callable ``(request: JudgeRequest, n, temperature) -> list[str]`` by import path.

    If the imported object also has a ``teacher_logprobs(messages, tools, response_ids)``
    attribute, it serves OPD teacher log-probs too.
    """

    def __init__(self, import_path: str) -> None:
        self.import_path = import_path
        self.fn = import_object(import_path)
        if not callable(self.fn):
            raise ValueError(f"judge function {import_path!r} is not callable")

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        out = await _call(self.fn, request, n, temperature)
        if not isinstance(out, (list, tuple)) or not all(isinstance(t, str) for t in out):
            raise TypeError(f"judge function {self.import_path!r} must return a list of str, "
                            f"got {type(out).__name__}")
        if len(out) != n:
            raise ValueError(f"judge function {self.import_path!r} returned {len(out)} outputs, "
                             f"expected n={n}")
        return list(out)

    async def teacher_logprobs(self, messages: list[dict], tools: list[dict] | None,
                               response_ids: list[int]) -> list[float]:
        scorer = getattr(self.fn, "teacher_logprobs", None)
        if scorer is None:
            raise JudgeUnavailable(
                f"judge function {self.import_path!r} has no teacher_logprobs: a function "
                "backend cannot compute teacher log-probs; use judge.backend=server")
        return list(await _call(scorer, messages, tools, response_ids))


class OpenAIBackend:
    """An OpenAI-compatible chat endpoint (``…/v1``), through the official ``openai`` client.

    The ``n`` votes are one request with ``n=n``; an endpoint that rejects ``n > 1`` (HTTP 400
    naming ``n``) or returns fewer choices gets the missing ones as concurrent ``n=1`` calls.
    """

    def __init__(self, base_url: str, api_key: str | None, model: str,
                 timeout_s: float = 60.0, max_retries: int = 0) -> None:
        from openai import AsyncOpenAI

        self.model = model
        self.client = AsyncOpenAI(base_url=base_url, api_key=api_key or "none",
                                  timeout=timeout_s, max_retries=max_retries)
        self._single_only = False  # learned once: the endpoint rejects n > 1

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        import openai

        out: list[str] = []
        if n > 1 and not self._single_only:
            try:
                out = await self._create(request, n, temperature, max_tokens)
            except openai.BadRequestError as e:
                if not _rejects_n(e):
                    raise
                self._single_only = True
        else:
            out = await self._create(request, 1, temperature, max_tokens)
        missing = n - len(out)
        if missing > 0:
            more = await asyncio.gather(*(self._create(request, 1, temperature, max_tokens)
                                          for _ in range(missing)))
            out += [t for batch in more for t in batch]
        return out[:n]

    async def _create(self, request: JudgeRequest, n: int, temperature: float,
                      max_tokens: int) -> list[str]:
        kwargs: dict[str, Any] = {} if n == 1 else {"n": n}
        resp = await self.client.chat.completions.create(
            model=self.model, messages=request.messages, temperature=temperature,
            max_tokens=max_tokens, **kwargs)
        choices = sorted(resp.choices, key=lambda c: c.index)
        return [c.message.content or "" for c in choices]

    async def teacher_logprobs(self, messages: list[dict], tools: list[dict] | None,
                               response_ids: list[int]) -> list[float]:
        raise JudgeUnavailable(
            "judge.backend='openai' cannot compute teacher log-probs: an external chat API "
            "cannot score given token ids; use judge.backend=server for OPD")


def _rejects_n(e: Exception) -> bool:
    if getattr(e, "param", None) == "n":
        return True
    message = str(getattr(e, "message", "") or e)
    return bool(re.search(r"(?<![\w.])n(?![\w])|\bnum_choices\b|multiple choices", message))


class ServerBackend:
    """A ``JudgeServer`` deployment behind a Serve handle.

    A call its caller gives up on (the voter's timeout cancels the awaiting task) is cancelled
    in the JudgeServer too, whose engine then aborts it. Awaiting a Serve ``DeploymentResponse``
    does not do that by itself: a cancelled awaiter leaves the request running on the replica.
    Before this, every timed-out judge call (and each of its retries) kept generating on the
    judge engine, so a judge that fell behind fell further behind.

    With ``constrained`` (``judge.constrained``, the default) the JudgeServer's engine samples
    each output in the shape its kind asks for (``formats.py``): reasoning, then one verdict
    box, a hint or a JSON answer, so that no vote is lost to the parser.
    """

    def __init__(self, handle: Any, constrained: bool = True, hint_max_chars: int = 600) -> None:
        self.handle, self.constrained, self.hint_max_chars = handle, constrained, hint_max_chars

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        fmt = (output_format(request, max_tokens, self.hint_max_chars) if self.constrained
               else None)
        return await _cancellable(self.handle.judge.remote(request.messages, n, temperature,
                                                           max_tokens, structural_tag=fmt))

    async def teacher_logprobs(self, messages: list[dict], tools: list[dict] | None,
                               response_ids: list[int]) -> list[float]:
        return await _cancellable(self.handle.teacher_logprobs.remote(messages, tools,
                                                                      response_ids))


async def _cancellable(response: Any) -> Any:
    """Await a Serve ``DeploymentResponse``; if the awaiting task is cancelled, cancel the
    request on its replica as well."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


class TeacherFrom:
    """Votes and hints from one backend, OPD teacher log-probs from another
    (``judge.teacher='server'``: a rule judge or an external API writes the hints, the app's
    JudgeServer scores the sampled ids under the hinted prompt)."""

    def __init__(self, judge: JudgeBackend, teacher: JudgeBackend) -> None:
        self.judge, self.teacher = judge, teacher

    async def complete(self, request: JudgeRequest, n: int, temperature: float,
                       max_tokens: int) -> list[str]:
        return await self.judge.complete(request, n, temperature, max_tokens)

    async def teacher_logprobs(self, messages: list[dict], tools: list[dict] | None,
                               response_ids: list[int]) -> list[float]:
        return await self.teacher.teacher_logprobs(messages, tools, response_ids)


def needs_server(cfg: JudgeConfig) -> bool:
    """Whether the judge calls the app's JudgeServer (for votes or for teacher log-probs)."""
    return cfg.backend == "server" or cfg.teacher == "server"


def make_backend(cfg: JudgeConfig, server_handle: Any = None) -> JudgeBackend:
    """The backend ``cfg.backend`` names (with ``cfg.teacher='server'``: its teacher log-probs
    from the JudgeServer); a JudgeServer needs its deployment handle."""
    if needs_server(cfg) and server_handle is None:
        raise ValueError(f"judge.backend={cfg.backend!r} with judge.teacher={cfg.teacher!r} "
                         "needs a JudgeServer deployment handle")
    if cfg.backend == "function":
        backend: JudgeBackend = FunctionBackend(cfg.function)
    elif cfg.backend == "openai":
        if not (cfg.url and cfg.model):
            raise ValueError("judge.backend='openai' needs judge.url and judge.model")
        backend = OpenAIBackend(cfg.url, os.environ.get(cfg.api_key_env), cfg.model,
                                cfg.timeout_s)
    elif cfg.backend == "server":
        return ServerBackend(server_handle, cfg.constrained, cfg.hint_max_chars)
    else:
        raise ValueError(f"unknown judge backend {cfg.backend!r}")
    if cfg.teacher == "server":
        return TeacherFrom(backend, ServerBackend(server_handle, cfg.constrained,
                                                  cfg.hint_max_chars))
    return backend
