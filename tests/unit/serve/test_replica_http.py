"""``clawray/serve/replica_http.py`` without Serve: the port it takes, how it fails, the
routes it serves, and the config rule that only a colocated replica has one."""

from __future__ import annotations

import socket

import httpx
import pytest

from clawray.config import ClawRayConfig
from clawray.serve.replica_http import ReplicaHTTP, bind_first_free, http_app


def test_a_taken_port_is_skipped_and_a_full_range_is_a_clear_error():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        sock = bind_first_free("127.0.0.1", port, span=4)
        try:
            assert port < sock.getsockname()[1] < port + 4
        finally:
            sock.close()
        with pytest.raises(OSError, match=rf"no free port on 127.0.0.1 in {port}-{port}"):
            bind_first_free("127.0.0.1", port, span=1)
    finally:
        taken.close()


class _Core:
    """What ``http_app`` calls on an ``IngressCore``: each route says which method it hit."""

    instance_id = "inst-1"

    def __getattr__(self, name):
        from fastapi.responses import JSONResponse

        async def route(request, *args, **kwargs):
            return JSONResponse({"method": name, "args": list(args), **kwargs})
        return route


async def test_every_public_route_reaches_its_core_method_and_nothing_else_is_served():
    app = http_app(_Core())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://replica") as client:
        hits = {}
        for method, path in (("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                             ("POST", "/v1/messages"), ("POST", "/v1/responses"),
                             ("GET", "/v1/responses/r1"), ("DELETE", "/v1/responses/r1"),
                             ("POST", "/v1/feedback"), ("GET", "/v1/models")):
            r = await client.request(method, path)
            assert r.status_code == 200, (method, path, r.text)
            hits[(method, path)] = r.json()
        assert hits[("GET", "/v1/responses/r1")] == {"method": "stored_response",
                                                     "args": ["r1"]}
        assert hits[("DELETE", "/v1/responses/r1")] == {"method": "stored_response",
                                                        "args": ["r1"], "delete": True}
        assert hits[("POST", "/v1/messages")]["method"] == "messages"
        assert (await client.get("/healthz")).json() == {"status": "ok", "instance": "inst-1"}
        for method, path in (("POST", "/status"), ("POST", "/load_weights"),
                             ("GET", "/v1/chat/completions")):
            r = await client.request(method, path)
            assert r.status_code in (404, 405)
            assert r.json()["error"]["type"] == "invalid_request_error"  # OpenAI's format


async def test_the_server_runs_on_the_callers_loop_and_stops():
    server = await ReplicaHTTP.start(http_app(_Core()), "127.0.0.1", _free())
    try:
        async with httpx.AsyncClient() as client:
            r = await client.get(server.url + "/healthz")
        assert r.json()["instance"] == "inst-1"
    finally:
        await server.stop()
    assert server.task.done()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/healthz", timeout=2)


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_only_a_colocated_replica_serves_http_itself():
    split = ClawRayConfig.from_dict({"serving": {"layout": "split", "replica_http_port": 8200}})
    with pytest.raises(ValueError, match="replica_http_port needs serving.layout 'colocated'"):
        split.check()
    ClawRayConfig.from_dict({"serving": {"replica_http_port": 8200}}).check()
