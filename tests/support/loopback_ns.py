"""Run a command in a network namespace whose only interface is ``lo``, reaching one port of
the host's loopback through a Unix socket (the filesystem is shared across namespaces).

Host side: ``UnixBridge(port)`` accepts on a Unix socket and connects each client to
``127.0.0.1:port``. Inside: this module, run as ``unshare -n python loopback_ns.py --unix PATH
--port P -- CMD…``, brings ``lo`` up, listens on ``127.0.0.1:P``, forwards to the Unix socket and
runs CMD. So CMD (the real OpenClaw agent) can talk to the app on ``127.0.0.1:P`` and to nothing
else at all.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path


def _pipe(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _splice(a: socket.socket, b: socket.socket) -> None:
    threading.Thread(target=_pipe, args=(a, b), daemon=True).start()
    threading.Thread(target=_pipe, args=(b, a), daemon=True).start()


def _serve(listener: socket.socket, connect: "callable[[], socket.socket]") -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        try:
            upstream = connect()
        except OSError:
            client.close()
            continue
        _splice(client, upstream)


class UnixBridge:
    """Host side: a Unix socket whose connections reach ``127.0.0.1:port``."""

    def __init__(self, port: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="lo-bridge-")
        self.path = os.path.join(self.dir, "s")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(64)
        threading.Thread(target=_serve, args=(self.listener, lambda: socket.create_connection(
            ("127.0.0.1", port))), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def namespaces_work() -> bool:
    """Whether this machine lets us make a network namespace (root or user namespaces)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    run = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                         capture_output=True)
    return run.returncode == 0


def isolated(cmd: list[str], bridge: UnixBridge, port: int) -> list[str]:
    """``cmd`` wrapped to run in a fresh loopback-only namespace, with ``port`` bridged."""
    return ["unshare", "-n", sys.executable, str(Path(__file__).resolve()), "--unix",
            bridge.path, "--port", str(port), "--", *cmd]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--unix", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.create_server(("127.0.0.1", args.port))

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(args.unix)
        return s

    threading.Thread(target=_serve, args=(listener, connect), daemon=True).start()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
