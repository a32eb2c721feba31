"""The public HTTP surface, as a Ray Serve ingress deployment.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses`` (+
``GET`` / ``DELETE /v1/responses/{id}``) (OpenAI), ``POST /v1/messages`` (Anthropic),
``POST /v1/feedback``,
``GET /v1/models``, ``GET /healthz`` — docs/api.md. Everything else a deployment can do (status,
pause/resume, weights, the collecting switch) is a plain method, reachable only through a Ray
handle from inside the cluster — never through HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from clawray.config import ClawRayConfig
from clawray.gate.core import ServingTally
from clawray.inference.engine import SamplingParams, TokenOutput
from clawray.models.importer import provenance
from clawray.models.loader import load_tokenizer, policy_model_info
from clawray.records import GatedSink, RecordSink, TeeSink, make_sink, session_key
from clawray.serve.auth import KeyChecker
from clawray.serve import anthropic_messages, openai_chat, openai_completions, openai_responses
from clawray.serve.chat import ChatService
from clawray.serve.metrics import CountingSink, ServingMetrics
from clawray.serve.response_store import start_response_store
from clawray.serve.policy_server import HandlePolicy, LocalPolicy, PolicyCore
from clawray.serve.protocol import APIError, parse_feedback, parse_request
from clawray.serve.replica_http import ReplicaHTTP, http_app
from clawray.sessions.pipeline import HubSink, HubUnavailable, start_live_pipeline
from clawray.weights.control import start_app_control
from clawray.weights.receiver import WeightReceiver, start_receiver

logger = logging.getLogger(__name__)

def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def internal_error(what: str) -> JSONResponse:
    """500 with OpenAI's error object for an unexpected failure (logged with its traceback);
    the message names no internals beyond the exception's type."""
    logger.exception("%s failed with an internal error", what)
    return error_response(APIError(500, f"{what} failed with an internal error; retry the "
                                   "request", type="server_error", code="internal_error"))


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over ``limit`` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class IngressCore:
    """The route handlers, independent of Serve so tests and benchmarks can mount them anywhere."""

    def __init__(self, cfg: ClawRayConfig, policy_handle: Any = None,
                 app_name: str = "clawray") -> None:
        self.cfg = cfg
        s = cfg.serving_cfg
        if policy_handle is None:
            self.core: PolicyCore | None = PolicyCore(cfg)
            info, policy = self.core.info, LocalPolicy(self.core.engine)
            max_len = self.core.engine.max_model_len
        else:
            self.core = None
            info = policy_model_info(cfg)
            policy = HandlePolicy(policy_handle,
                                  names_adapters=cfg.inference_cfg.max_loras > 0)
            max_len = cfg.model_cfg.max_model_len or info.max_model_len
        # Mirrors the app's switches (and, colocated, applies published weights).
        self.receiver: WeightReceiver | None = (
            self.core.receiver if self.core is not None else start_receiver(None))
        self.app_name = app_name
        self.info = info
        prov = provenance(info.path) or {}
        self.provenance = {k: prov[k] for k in ("format", "package", "package_version", "file",
                                                "sha256", "quantization", "context_extension",
                                                "origin") if k in prov}
        self.keys = KeyChecker(s.key_digests())
        self.hub_sink: Any = None
        sinks: list[RecordSink] = []
        for kind in s.record_sink:
            if kind == "hub":
                self.hub_sink = HubSink(start_live_pipeline(cfg, app_name))
                # Training data only while the operator's collecting switch is on.
                sinks.append(GatedSink(self.hub_sink, self.collecting))
            else:
                sinks.append(make_sink(kind, s.records_path, s.records_system_prompt))
        self.metrics = ServingMetrics(app_name)  # Prometheus series (serve/metrics.py)
        self.sink = CountingSink(sinks[0] if len(sinks) == 1 else TeeSink(sinks), self.metrics)
        self.responses_store = start_response_store(app_name, s.responses_kept)
        # The policy gate's serving signals (errors, latency per canary side), reported to
        # the control actor by the receiver.
        self.serving_tally = ServingTally()
        if self.receiver is not None:
            self.receiver.serving_tally = self.serving_tally
        self.service = ChatService(load_tokenizer(info.path), policy, info.name, max_len, s,
                                   self.sink, routing=self.routing, tally=self.serving_tally,
                                   sampling_defaults=info.sampling_defaults)
        self.started = int(time.time())
        # Lets a launcher tell this app's replicas from another cluster's on a probed port.
        self.instance_id = uuid.uuid4().hex[:16]

    async def chat_completions(self, request: Request) -> Response:
        """OpenAI Chat Completions."""
        async def turn_of(raw: bytes, tenant: str) -> tuple[Any, bool, Any, Any]:
            req, body_fields = parse_request(raw)
            turn = await self.service.prepare(openai_chat.to_turn_request(req, body_fields),
                                              request.headers, tenant)
            return (turn, req.stream, lambda: openai_chat.complete(self.service, turn),
                    lambda: openai_chat.stream(self.service, turn))
        return await self._serve_turn(request, turn_of, error_response, "chat completion")

    async def completions(self, request: Request) -> Response:
        """OpenAI (legacy) Completions: plain prompts, no chat template; side turns."""
        async def turn_of(raw: bytes, tenant: str) -> tuple[Any, bool, Any, Any]:
            req, body_fields = openai_completions.parse_request(raw)
            prepared = await openai_completions.prepare(self.service, req, body_fields,
                                                        request.headers, tenant)
            return (prepared, req.stream,
                    lambda: openai_completions.complete(self.service, prepared),
                    lambda: openai_completions.stream(self.service, prepared))
        return await self._serve_turn(request, turn_of, error_response, "completion")

    async def responses(self, request: Request) -> Response:
        """OpenAI Responses: ``previous_response_id`` continues a conversation kept here."""
        async def turn_of(raw: bytes, tenant: str) -> tuple[Any, bool, Any, Any]:
            req = openai_responses.parse_request(raw)
            history, chain_session = [], None
            if req.previous_response_id:
                prev = await self.responses_store.history(req.previous_response_id, tenant)
                if "error" in prev:
                    raise APIError(400, f"previous response with id '{req.previous_response_id}'"
                                   f" {'not found' if prev['error'] == 'not_found' else 'expired'}"
                                   " (responses are kept per API key, the latest "
                                   f"{self.cfg.serving_cfg.responses_kept} of this app)",
                                   param="previous_response_id",
                                   code="previous_response_not_found")
                history, chain_session = prev["messages"], prev["session_id"]
            turn = await self.service.prepare(
                openai_responses.to_turn_request(req, history, chain_session),
                request.headers, tenant)
            store = self.responses_store
            return (turn, req.stream,
                    lambda: openai_responses.complete(self.service, turn, req, store),
                    lambda: openai_responses.stream(self.service, turn, req, store))
        return await self._serve_turn(request, turn_of, error_response, "response")

    async def stored_response(self, request: Request, response_id: str,
                              delete: bool = False) -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}``: only the key that created it."""
        try:
            tenant = self.keys.check(request.headers)
            if delete:
                if not await self.responses_store.delete(response_id, tenant):
                    raise openai_responses.not_found(response_id)
                return JSONResponse({"id": response_id, "object": "response", "deleted": True})
            body = await self.responses_store.get(response_id, tenant)
            if body is None:
                raise openai_responses.not_found(response_id)
            return JSONResponse(body)
        except APIError as e:
            return error_response(e)
        except Exception:  # noqa: BLE001 - e.g. the store actor restarting
            return internal_error("response lookup")

    async def messages(self, request: Request) -> Response:
        """Anthropic Messages: the same turn path, Anthropic's wire format and errors."""
        async def turn_of(raw: bytes, tenant: str) -> tuple[Any, bool, Any, Any]:
            req = anthropic_messages.parse_request(raw)
            turn = await self.service.prepare(anthropic_messages.to_turn_request(req),
                                              request.headers, tenant)
            return (turn, req.stream, lambda: anthropic_messages.complete(self.service, turn),
                    lambda: anthropic_messages.stream(self.service, turn))

        def anthropic_error(e: APIError) -> JSONResponse:
            return JSONResponse(anthropic_messages.error_body(e), status_code=e.status,
                                headers=e.headers)
        return await self._serve_turn(request, turn_of, anthropic_error, "message")

    async def _serve_turn(self, request: Request, turn_of: Any, render_error: Any,
                          what: str) -> Response:
        """Auth, body, then the API's ``turn_of``: the prepared turn, whether it streams, and
        the API's renderers of its answer and of its stream. Every outcome is counted
        (``clawray_requests_total``), answers timed to the answer or the first event."""
        started, stream = time.perf_counter(), False
        try:
            tenant = self.keys.check(request.headers)
            raw = await read_body(request, self.cfg.serving_cfg.max_body_bytes)
            _, stream, complete, events_of = await turn_of(raw, tenant)
            if not stream:
                answer = JSONResponse(await complete())
                self.metrics.request(what, 200, time.perf_counter() - started, False)
                return answer
            events = events_of()
            first = await anext(events)  # engine errors surface here, before any byte is sent
        except APIError as e:
            self.metrics.request(what, e.status, None, stream)
            return render_error(e)
        except Exception:  # a bug of ours: the client still gets the API's error object
            logger.exception("%s failed with an internal error", what)
            self.metrics.request(what, 500, None, stream)
            return render_error(APIError(500, f"{what} failed with an internal error; retry "
                                         "the request", type="server_error",
                                         code="internal_error"))
        self.metrics.request(what, 200, time.perf_counter() - started, True)
        return StreamingResponse(_prepend(first, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def feedback(self, request: Request) -> Response:
        try:
            tenant = self.keys.check(request.headers)
            raw = await read_body(request, 64_000)
            fb = parse_feedback(raw)
            if self.hub_sink is None:
                raise APIError(400, "feedback needs the session pipeline: add 'hub' to "
                               "serving.record_sink", code="feedback_disabled")
            user = fb.user or request.headers.get("x-user-id") or None
            # Only this key's sessions and turns: another tenant's look exactly like none (404).
            result = await self.hub_sink.feedback(
                fb.value(), fb.text, fb.response_id,
                session_key(tenant, user, fb.session_id) if fb.session_id else None, tenant)
        except APIError as e:
            return error_response(e)
        except HubUnavailable as e:  # restarting, or on a lost host: the feedback can be resent
            return error_response(APIError(503, f"feedback could not be applied now ({e}); "
                                           "retry shortly", type="server_error",
                                           code="hub_unavailable", headers={"Retry-After": "5"}))
        except Exception:  # e.g. a session hub restarting: retryable
            return internal_error("feedback")
        what = f"response '{fb.response_id}'" if fb.response_id else f"session '{fb.session_id}'"
        if result["status"] == "unknown":
            return error_response(APIError(404, f"no live turn or session matches {what}",
                                           param="response_id" if fb.response_id else "session_id",
                                           code="not_found"))
        if result["status"] == "sealed":
            return error_response(APIError(
                409, f"{what} was already written to the sample log; feedback must arrive within "
                f"sessions.feedback_window_s={self.cfg.sessions_cfg.feedback_window_s:g} s of the "
                "turn being judged", code="feedback_too_late"))
        return JSONResponse({"object": "feedback", "status": "applied", "rating": fb.value(),
                             "response_id": result.get("response_id"),
                             "session_id": result.get("client_session_id"),
                             "turns": result.get("turns", 0)})

    async def models(self, request: Request) -> Response:
        try:
            self.keys.check(request.headers)
        except APIError as e:
            return error_response(e)
        model = {"id": self.info.name, "object": "model", "created": self.started,
                 "owned_by": "clawray", "max_model_len": self.service.max_model_len}
        if self.provenance:  # an imported model: where its weights came from
            model["provenance"] = self.provenance
        return JSONResponse({"object": "list", "data": [model]})

    async def status(self) -> dict[str, Any]:
        st = await self.service.policy.status()
        return {"model": self.info.name, "engine": st.engine, "policy_version": st.policy_version,
                "running": st.running, "waiting": st.waiting, "paused": st.paused,
                "max_model_len": st.max_model_len, "collecting": self.collecting(),
                "routing": self.routing(),
                # colocated: requests per session key this replica served (split: on the
                # PolicyServer replicas' status)
                "sessions": st.extra.get("sessions", {}) if self.core is not None else {},
                "replica": self.receiver.replica_id if self.receiver is not None else None,
                # seconds of the engine's warm-up request at replica start (colocated layout)
                "warm_up_s": self.core.warm_up_s if self.core is not None else None}

    def routing(self) -> dict[str, Any] | None:
        """The policy gate's routing table as this replica mirrors it (None: no gate)."""
        return self.receiver.routing if self.receiver is not None else None

    def collecting(self) -> bool:
        """Whether this replica hands turn records to the session pipeline."""
        return self.receiver.collecting if self.receiver is not None else True

    async def set_collecting(self, enabled: bool, wait_s: float = 10.0) -> dict[str, Any]:
        """Flip the app's collecting switch; returns once every live replica mirrors it."""
        control = await asyncio.to_thread(start_app_control, self.app_name)
        await control.set_collecting.remote(bool(enabled))
        replicas = await control.wait_collecting.remote(bool(enabled), wait_s)
        return {"collecting": bool(enabled), "replicas": replicas}

    async def gate_replies(self, prompts: list[list[dict[str, Any]]], adapter: str | None, *,
                           seed: int = 0, max_tokens: int = 48, temperature: float = 1.0
                           ) -> list[dict[str, Any]]:
        """One policy version's replies to held-out prompts (``adapter``: its adapter; None:
        the base model) for the policy gate's shadow evaluation: prompt ``i`` samples with
        seed ``seed + i``; never recorded. A version the engine does not serve is an error
        (no fallback: the gate must compare the versions it names)."""
        svc = self.service

        async def one(i: int, messages: list[dict[str, Any]]) -> dict[str, Any]:
            ids, _ = svc._template(messages, None)
            params = SamplingParams(max_tokens=max(1, min(max_tokens, svc.max_model_len - len(ids))),
                                    temperature=temperature, seed=seed + i, adapter=adapter)
            out = (await svc.policy.generate(ids, params))[0]
            return {"text": svc.tokenizer.decode(out.token_ids, skip_special_tokens=True),
                    "tokens": len(out.token_ids), "version": out.policy_version}

        return list(await asyncio.gather(*(one(i, m) for i, m in enumerate(prompts))))

    async def weights_version(self) -> dict[str, Any]:
        """The version this replica serves and the app's published one, per replica."""
        st = await self.service.policy.status()
        control = await (await asyncio.to_thread(start_app_control, self.app_name)).status.remote()
        return {"replica": st.policy_version, "published": control["version"],
                "replicas": {rid: r["version"] for rid, r in control["replicas"].items()
                             if r["weights"] and r["live"]}}


async def _prepend(first: str, rest: Any) -> Any:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


@serve.deployment(name="Ingress")
@serve.ingress()  # the routes: __serve_build_asgi_app__, one table with the replica's server
class Ingress:
    """Serve shell around ``IngressCore``; admin methods are handle-only."""

    async def __init__(self, config: dict, policy_handle: Any = None,
                       judge_handle: Any = None) -> None:  # Serve awaits an async constructor
        # judge_handle only keeps a JudgeServer in the app; PRM voters look it up by name.
        app_name = serve.get_replica_context().app_name
        cfg = ClawRayConfig.from_dict(config).apply_log_level()
        self._core = IngressCore(cfg, policy_handle, app_name)
        self._app = http_app(self._core)  # Serve's path and the replica's own server share it
        self._http: ReplicaHTTP | None = None
        if self._core.core is not None:  # colocated: the engine is here
            await self._core.core.warm_up()
            s = cfg.serving_cfg
            if s.replica_http_port is not None:  # clawray's own server, on the engine's loop
                self._http = await ReplicaHTTP.start(self._app, s.host, s.replica_http_port)
                logger.warning("clawray: ingress replica serving HTTP itself at %s/v1",
                               self._http.url)

    def __serve_build_asgi_app__(self) -> Any:
        """The public routes Serve's path serves (Serve calls it after ``__init__``)."""
        return self._app

    def check_health(self) -> None:
        """Serve's replica health check: fails once a colocated engine cannot serve."""
        if self._core.core is not None:
            self._core.core.check_health()

    # ---- handle-only admin surface (no route) ----
    def instance_id(self) -> str:
        return self._core.instance_id

    async def status(self) -> dict[str, Any]:
        return await self._core.status()

    async def load_weights(self, state_dict: dict, policy_version: int) -> None:
        if self._core.core is None:
            raise RuntimeError("split layout: load weights into the PolicyServer deployment")
        await self._core.core.load_weights(state_dict, policy_version)

    async def prompt_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """Teacher log-probs of ``response_ids`` under the weights this replica serves."""
        if self._core.core is None:
            raise RuntimeError("split layout: ask the PolicyServer deployment")
        return await self._core.core.prompt_logprobs(prompt_ids, response_ids)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[TokenOutput]:
        """Token-in/token-out generation for env runners (colocated or split alike); these
        turns are not recorded as live samples: runners write their own rows."""
        return await self._core.service.policy.generate(prompt_ids, params)

    def collecting(self) -> bool:
        return self._core.collecting()

    async def set_collecting(self, enabled: bool, wait_s: float = 10.0) -> dict[str, Any]:
        """Operator switch: turn records to the session pipeline on/off (serving goes on)."""
        return await self._core.set_collecting(enabled, wait_s)

    async def weights_version(self) -> dict[str, Any]:
        return await self._core.weights_version()

    async def gate_replies(self, prompts: list[list[dict[str, Any]]], adapter: str | None,
                           **kwargs: Any) -> list[dict[str, Any]]:
        """The policy gate's shadow replies (``IngressCore.gate_replies``; handle only)."""
        return await self._core.gate_replies(prompts, adapter, **kwargs)

    def replica_http_url(self) -> str | None:
        """Where this replica serves HTTP itself (``serving.replica_http_port``), or None."""
        return self._http.url if self._http is not None else None

    def __del__(self) -> None:  # Serve calls it on shutdown: stop polling, deregister
        http = getattr(self, "_http", None)
        if http is not None:
            http.close()
        receiver = getattr(getattr(self, "_core", None), "receiver", None)
        if receiver is not None:
            receiver.close()
