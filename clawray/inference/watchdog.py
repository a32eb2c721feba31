"""Child processes that die with their owner: a watchdog for an engine's helper processes.

vLLM runs its engine core (``VLLM::EngineCore``) and workers (``VLLM::Worker``) as processes of
their own. The workers watch the engine core (vLLM's death pipe); nothing watches the process
that started the engine core. When that process exits normally it shuts the engine down, and
when Ray kills a replica the raylet kills the replica's children; but when the Ray node itself
dies (its raylet killed, a crash, ``kill -9`` of ``serve run``'s process group), the replica
dies with nobody left to clean up, and the engine processes stay alive under init holding
gigabytes of memory for as long as the machine runs.

:class:`ProcessWatchdog` closes that gap: a small process of its own (``python -m
clawray.inference.watchdog``) that polls its parent (the owner) and, once the owner is gone,
terminates the watched processes and their descendants (SIGTERM, then SIGKILL after a grace
period). It is not ``PR_SET_PDEATHSIG``, which fires when the *thread* that forked a process
exits, and a replica builds its engine on whatever thread Ray gives it.

Usage (in the owner)::

    before = children_now()
    start_the_engine()
    watchdog = ProcessWatchdog.start(children_now() - before)
    ...
    watchdog.stop()  # the engine was shut down normally
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable

POLL_S = 0.5  # how often the watchdog checks its owner
GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long


def children_now() -> set[int]:
    """The pids of this process's children (direct ones: an engine's own children follow)."""
    import psutil

    return {p.pid for p in psutil.Process().children()}


class ProcessWatchdog:
    """The owner's handle on a running watchdog process."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc

    @classmethod
    def start(cls, pids: Iterable[int]) -> ProcessWatchdog | None:
        """Watch ``pids`` (and whatever they start) for as long as this process lives; None
        when there is nothing to watch."""
        pids = sorted(set(pids))
        if not pids:
            return None
        proc = subprocess.Popen(
            [sys.executable, "-m", "clawray.inference.watchdog", "--owner", str(os.getpid()),
             *map(str, pids)],
            stdin=subprocess.DEVNULL, start_new_session=True)  # not in the owner's signals
        return cls(proc)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def stop(self) -> None:
        """The watched processes were shut down by their owner: the watchdog's job is done."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _tree(procs: list) -> list:
    """``procs`` that still run, with all their descendants."""
    import psutil

    out = []
    for p in procs:
        try:
            if p.is_running():  # psutil compares the start time too: never a reused pid
                out += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    return out


def reap(procs: list, grace_s: float = GRACE_S) -> None:
    """SIGTERM ``procs`` and their descendants, SIGKILL what still runs after ``grace_s``."""
    import psutil

    tree = _tree(procs)
    for p in tree:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


def watch(owner: int, pids: list[int], poll_s: float = POLL_S) -> str:
    """Block until the owner is gone (then reap ``pids``) or every watched process has exited;
    which of the two happened."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    while True:
        if os.getppid() != owner:  # re-parented: the owner died
            reap(procs)
            return "owner gone"
        if not any(p.is_running() for p in procs):
            return "watched processes exited"
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--owner", type=int, required=True, help="the pid that started us")
    parser.add_argument("pids", type=int, nargs="+", help="the processes to reap")
    args = parser.parse_args(argv)
    # stop() is the owner's "done": exit quietly, leaving the watched processes alone.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    watch(args.owner, args.pids)  # an owner already gone is seen at the first poll


if __name__ == "__main__":
    main()
