"""The field's serving design, as the baseline of ``bench/serving.py`` (row "b").

OpenClaw-RL style: a single-process FastAPI/uvicorn proxy in front of a separate engine server
process; the proxy forwards every ``/v1/chat/completions`` over loopback HTTP with one reused
``httpx.AsyncClient``. Two servers, each run as its own process:

    python bench/_baseline_servers.py engine --port 9001 --config '{...clawray config...}'
    python bench/_baseline_servers.py proxy --port 9000 --upstream http://127.0.0.1:9001

The engine server is an OpenAI-compatible server, as SGLang's or vLLM's is in the field: here
clawray's own ``IngressCore`` (chat template, tokenization, detokenization, JSON/SSE) over the
same ``FixedLatencyEngine`` in a plain uvicorn app. Both designs therefore do exactly the same
work per request and the benchmark measures only how requests travel.

The proxy is the competent version of the design, not a strawman: it forwards the raw body
without parsing it, relays the upstream stream byte for byte as it arrives, keeps pooled
keep-alive connections (enough for any tested concurrency), and runs uvicorn with access logs
off (uvloop and httptools, uvicorn's defaults when installed). A real peer proxy also parses
the body and records the turn; this one skips that work, so the baseline is a best case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any, AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

# Request headers that mean something to an OpenAI-compatible server (auth, session metadata).
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-api-key", "x-session-id",
                     "x-turn-type", "x-session-done", "session_id", "x-session-affinity")


def engine_app(config: dict[str, Any]) -> FastAPI:
    """An OpenAI-compatible server: clawray's routes (those of its replica's own server,
    ``clawray/serve/replica_http.py``) over the configured engine."""
    from clawray.config import ClawRayConfig
    from clawray.serve.ingress import IngressCore
    from clawray.serve.replica_http import http_app

    return http_app(IngressCore(ClawRayConfig.from_dict(config)))


def proxy_app(upstream: str, max_connections: int = 1024) -> FastAPI:
    """The peer design's proxy: forward to ``upstream`` over one pooled ``httpx.AsyncClient``."""
    client_box: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=max_connections,
                              max_keepalive_connections=max_connections, keepalive_expiry=120)
        async with httpx.AsyncClient(base_url=upstream, limits=limits,
                                     timeout=httpx.Timeout(600.0)) as client:
            client_box["client"] = client
            yield

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    async def forward(request: Request, method: str, path: str) -> Response:
        client = client_box["client"]
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        body = await request.body() if method == "POST" else None
        upstream_req = client.build_request(method, path, content=body, headers=headers)
        r = await client.send(upstream_req, stream=True)
        media_type = r.headers.get("content-type", "application/json")
        if media_type.startswith("text/event-stream"):
            return StreamingResponse(r.aiter_raw(), status_code=r.status_code,
                                     media_type=media_type, background=BackgroundTask(r.aclose),
                                     headers={"Cache-Control": "no-cache"})
        try:
            data = await r.aread()
        finally:
            await r.aclose()
        return Response(data, status_code=r.status_code, media_type=media_type)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "POST", "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await forward(request, "GET", "/v1/models")

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        return await forward(request, "GET", "/healthz")

    return app


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Baseline servers of bench/serving.py.")
    p.add_argument("role", choices=["engine", "proxy"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--config", default="{}", help="clawray config as JSON (engine)")
    p.add_argument("--upstream", help="engine server base URL (proxy)")
    args = p.parse_args(argv)
    if args.role == "engine":
        app = engine_app(json.loads(args.config))
    else:
        if not args.upstream:
            p.error("proxy needs --upstream")
        app = proxy_app(args.upstream)
    uvicorn.run(app, host=args.host, port=args.port, access_log=False, log_level="warning",
                timeout_keep_alive=120)


if __name__ == "__main__":
    main()
