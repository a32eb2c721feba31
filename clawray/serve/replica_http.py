"""clawray's own HTTP server inside an ingress replica (``serving.replica_http_port``).

Serve hands a request to the replica's code through its proxy (or its direct-ingress server)
and a per-request path in the replica; vLLM's own server (`vllm serve`) runs uvicorn in the
process that holds the engine. With ``replica_http_port`` set, each colocated ingress replica
also runs that shape: uvicorn on the event loop that runs the engine, serving the same routes
(``http_app``) over the same ``IngressCore`` — the same keys, records, sessions and metrics.
bench/README.md measures it against Serve's path and `vllm serve`.

    server = await ReplicaHTTP.start(http_app(core), "127.0.0.1", 8200)
    server.url   # http://127.0.0.1:8200 (or the next free port)
    await server.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from clawray.serve.protocol import APIError


def http_app(core: Any) -> FastAPI:
    """Every public route of the ingress (``clawray.serve.ingress.Ingress``) over ``core``,
    an ``IngressCore``; admin operations stay handle-only, as on Serve's path."""
    app = FastAPI(title="clawray", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await core.chat_completions(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await core.completions(request)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await core.messages(request)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await core.responses(request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await core.stored_response(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await core.stored_response(request, response_id, delete=True)

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        return await core.feedback(request)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await core.models(request)

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"status": "ok", "instance": core.instance_id})

    return app


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the replica's process (Ray's worker) owns them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_first_free(host: str, port: int, span: int = 16) -> socket.socket:
    """A listening TCP socket on ``host`` at the first free port of ``port .. port+span-1``
    (replicas on one node take the next ones); OSError naming the range when none is."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for p in range(port, min(port + span, 65536)):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, p))
        except OSError:
            sock.close()
            continue
        sock.listen(2048)
        sock.setblocking(False)
        return sock
    raise OSError(f"serving.replica_http_port: no free port on {host} in {port}-"
                  f"{min(port + span, 65536) - 1}")


class ReplicaHTTP:
    """A uvicorn server running as a task on the caller's event loop."""

    def __init__(self, server: _Server, task: asyncio.Task, host: str, port: int) -> None:
        self.server, self.task, self.host, self.port = server, task, host, port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    async def start(cls, app: FastAPI, host: str, port: int, span: int = 16,
                    timeout_s: float = 30.0) -> "ReplicaHTTP":
        sock = bind_first_free(host, port, span)
        bound = sock.getsockname()[1]
        server = _Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                        timeout_keep_alive=120, lifespan="off"))
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not server.started:
            if task.done():  # a failed start: its exception, not a hang
                sock.close()
                task.result()
                raise RuntimeError(f"clawray's replica HTTP server on {host}:{bound} stopped "
                                   "while starting")
            if asyncio.get_running_loop().time() > deadline:
                server.should_exit = True
                raise RuntimeError(f"clawray's replica HTTP server on {host}:{bound} did not "
                                   f"start within {timeout_s:g} s")
            await asyncio.sleep(0.05)
        return cls(server, task, host, bound)

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)

    def close(self) -> None:
        """Ask it to stop without waiting (``__del__`` of the replica)."""
        self.server.should_exit = True
