"""The in-process floor of ``bench/serving.py`` (rows "a"), run as its own process.

    python bench/_inproc.py --target core --body body.json --config '{...}' --concurrency 8

``--target core`` calls clawray's ``IngressCore.chat_completions`` with an ASGI request built in
memory and drains the response: every byte of serving work (body parsing, chat template,
tokenization, detokenization, JSON/SSE) but no HTTP and no network hop. ``--target engine``
calls the engine alone with the prompt ids of the same body: the 20 ms plus the event loop.
Prints the same JSON object as ``_loadgen.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from _loadgen import Sender, measure, run_loop


def asgi_request(body: bytes) -> Any:
    """A Starlette request for ``POST /v1/chat/completions`` carrying ``body``."""
    from starlette.requests import Request

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http", "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "",
        "query_string": b"", "server": ("127.0.0.1", 0), "client": ("127.0.0.1", 0),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode())],
    }
    return Request(scope, receive)


def core_sender(core: Any, body: bytes) -> Sender:
    async def send() -> bytes:
        response = await core.chat_completions(asgi_request(body))
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {bytes(response.body)[:300]!r}")
        if not hasattr(response, "body_iterator"):
            return bytes(response.body)
        parts = []
        async for chunk in response.body_iterator:
            parts.append(chunk.encode() if isinstance(chunk, str) else chunk)
        return b"".join(parts)

    return send


async def engine_sender(core: Any, body: bytes) -> Sender:
    """The engine alone, with the prompt ids and sampling settings the ingress would use."""
    from clawray.serve.openai_chat import to_turn_request
    from clawray.serve.protocol import parse_request

    req, fields = parse_request(body)
    turn = await core.service.prepare(to_turn_request(req, fields), {})
    prompt_ids, params, stream = turn.prompt_ids, turn.params, req.stream
    engine = core.core.engine

    async def send() -> bytes:
        if stream:
            n = 0
            async for delta in engine.generate_stream(prompt_ids, params):
                n += len(delta.token_ids)
            return b"data: [DONE]\n\n" if n else b""
        outputs = await engine.generate(prompt_ids, params)
        return json.dumps({"choices": [o.token_ids for o in outputs]}).encode()

    return send


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from clawray.config import ClawRayConfig
    from clawray.serve.ingress import IngressCore

    body = open(args.body, "rb").read()
    core = IngressCore(ClawRayConfig.from_dict(json.loads(args.config)))
    send = core_sender(core, body) if args.target == "core" else await engine_sender(core, body)
    senders = [send] * args.concurrency
    return await measure(senders, bool(json.loads(body).get("stream")), args.warmup,
                         args.requests, args.timeout_s, args.max_s)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", choices=["core", "engine"], default="core")
    p.add_argument("--body", required=True)
    p.add_argument("--config", default="{}", help="clawray config as JSON")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--max-s", type=float, default=None, help="time limit of the timed phase")
    args = p.parse_args(argv)
    json.dump(run_loop(run(args)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
