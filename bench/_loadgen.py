"""Closed-loop HTTP load generator, run as its own process by ``bench/serving.py``.

``concurrency`` workers each hold one keep-alive connection and send the same body back to
back; after ``warmup`` requests (not measured) the next ``requests`` are timed. It prints one
JSON object: per-request latencies, wall time of the measured phase, its own CPU time, errors.

The default client is a minimal HTTP/1.1 client on ``asyncio`` streams (uvloop when present):
writing a prebuilt request and reading a Content-Length or chunked response costs a few tens of
microseconds, so on a 2-core machine the load generator takes as little CPU as possible from
the servers it measures. ``--client httpx`` uses ``httpx.AsyncClient`` instead (a cross-check).

Every response is checked: HTTP 200 and, for streams, a final ``data: [DONE]`` with no in-band
error; for JSON, a ``choices`` list. A failed check counts as an error, never as a latency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

Sender = Callable[[], Awaitable[bytes]]


class RawConnection:
    """One keep-alive HTTP/1.1 connection that sends a fixed request and reads the reply."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self) -> bytes:
        try:
            return await self._exchange()
        except BaseException:
            await self.close()  # a half-read reply leaves the connection unusable
            raise

    async def _exchange(self) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        reader, writer = self.reader, self.writer
        writer.write(self.request)
        status_line = await reader.readline()
        if not status_line:
            await self.close()
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        length, chunked, close = None, False, False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection" and b"close" in value.lower():
                close = True
        if chunked:
            parts = []
            while True:
                size = int((await reader.readline()).split(b";", 1)[0], 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    break
                parts.append((await reader.readexactly(size + 2))[:-2])
            body = b"".join(parts)
        elif length is not None:
            body = await reader.readexactly(length)
        else:
            body = await reader.read()
            close = True
        if close:
            await self.close()
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {body[:300]!r}")
        return body

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


def raw_request(url: str, body: bytes, stream: bool) -> tuple[str, int, bytes]:
    u = urlsplit(url)
    accept = "text/event-stream" if stream else "application/json"
    head = (f"POST {u.path or '/'} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\n"
            f"Content-Type: application/json\r\nAccept: {accept}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n")
    return u.hostname or "127.0.0.1", u.port or 80, head.encode() + body


def check_reply(data: bytes, stream: bool) -> None:
    """Raise if a 200 reply is not a complete chat completion."""
    if stream:
        if not data.endswith(b"data: [DONE]\n\n") or b'"error"' in data:
            raise RuntimeError(f"incomplete or failed stream: ...{data[-300:]!r}")
        return
    if not json.loads(data).get("choices"):
        raise RuntimeError(f"reply without choices: {data[:300]!r}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    body = open(args.body, "rb").read()
    stream = bool(json.loads(body).get("stream"))
    closers: list[Callable[[], Awaitable[None]]] = []
    senders: list[Sender] = []
    if args.client == "raw":
        host, port, request = raw_request(args.url, body, stream)
        for _ in range(args.concurrency):
            conn = RawConnection(host, port, request)
            senders.append(conn.send)
            closers.append(conn.close)
    else:
        import httpx

        client = httpx.AsyncClient(timeout=60, limits=httpx.Limits(
            max_connections=args.concurrency, max_keepalive_connections=args.concurrency))
        headers = {"content-type": "application/json",
                   "accept": "text/event-stream" if stream else "application/json"}

        async def send() -> bytes:
            async with client.stream("POST", args.url, content=body, headers=headers) as r:
                data = await r.aread()
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {data[:300]!r}")
                return data

        senders = [send] * args.concurrency
        closers.append(client.aclose)

    try:
        return await measure(senders, stream, args.warmup, args.requests, args.timeout_s,
                             args.max_s)
    finally:
        for close in closers:
            await close()


async def measure(senders: list[Sender], stream: bool, warmup: int, requests: int,
                  timeout_s: float, max_s: float | None = None) -> dict[str, Any]:
    """Closed loop: one worker per sender; ``warmup`` untimed requests, then ``requests`` timed
    (fewer when the timed phase reaches ``max_s`` seconds: no new request starts after that)."""
    errors: list[str] = []
    latencies: list[float] = []

    async def phase(total: int, record: bool) -> None:
        left = [total]
        stop_at = time.perf_counter() + max_s if record and max_s else float("inf")

        async def worker(send: Sender) -> None:
            while left[0] > 0 and time.perf_counter() < stop_at:
                left[0] -= 1
                t0 = time.perf_counter()
                try:
                    check_reply(await send(), stream)
                except Exception as e:  # counted and reported, never timed as a success
                    errors.append(f"{type(e).__name__}: {e}")
                    await asyncio.sleep(0.01)
                    continue
                if record:
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker(s) for s in senders))

    await asyncio.wait_for(phase(warmup, False), timeout_s)
    warmup_errors = len(errors)
    errors.clear()
    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.wait_for(phase(requests, True), timeout_s)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"latencies_s": latencies, "wall_s": wall, "client_cpu_s": cpu,
            "errors": len(errors), "warmup_errors": warmup_errors,
            "error_sample": errors[0] if errors else None}


def run_loop(coro: Awaitable[Any]) -> Any:
    """Run ``coro`` on uvloop when it is installed (as uvicorn does), else on asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="full URL of /v1/chat/completions")
    p.add_argument("--body", required=True, help="JSON file with the request body")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--client", choices=["raw", "httpx"], default="raw")
    p.add_argument("--timeout-s", type=float, default=300.0)
    p.add_argument("--max-s", type=float, default=None, help="time limit of the timed phase")
    args = p.parse_args(argv)
    json.dump(run_loop(run(args)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
