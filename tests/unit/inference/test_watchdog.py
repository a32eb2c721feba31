"""The engine-process watchdog (clawray/inference/watchdog.py) on plain processes: an owner that
starts a child and a watchdog on it, then dies or stops the watchdog."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil

from clawray.inference.watchdog import ProcessWatchdog, children_now

# The owner: starts a long sleep (the "engine"), a watchdog on it, prints both pids, then waits
# for a line on stdin: "stop" stops the watchdog; anything else (or nothing) waits forever.
OWNER = """
import json, subprocess, sys
from clawray.inference.watchdog import ProcessWatchdog, children_now
before = children_now()
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
dog = ProcessWatchdog.start(children_now() - before)
print(json.dumps({"engine": engine.pid, "watchdog": dog.pid}), flush=True)
if sys.stdin.readline().strip() == "stop":
    dog.stop()
    print("stopped", flush=True)
sys.stdin.readline()
"""


def _gone(pid: int, timeout_s: float = 30.0) -> bool:
    """Whether ``pid`` has ended (or is a zombie nobody reaped yet) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _owner():
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, json.loads(proc.stdout.readline())


def _kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_watched_process_dies_when_its_owner_is_killed():
    owner, pids = _owner()
    try:
        assert psutil.Process(pids["engine"]).is_running()
        owner.kill()  # SIGKILL: the owner cannot clean up
        owner.wait()
        assert _gone(pids["engine"]), "the engine outlived its owner"
        assert _gone(pids["watchdog"])
    finally:
        _kill(pids["engine"], pids["watchdog"], owner.pid)


def test_a_stopped_watchdog_leaves_the_process_alone():
    owner, pids = _owner()
    try:
        owner.stdin.write("stop\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "stopped"
        assert _gone(pids["watchdog"])
        owner.kill()
        owner.wait()
        time.sleep(1.5)  # three of the watchdog's polls, had it still run
        assert psutil.Process(pids["engine"]).is_running()
    finally:
        _kill(pids["engine"], owner.pid)


def test_the_watchdog_exits_once_the_watched_processes_have():
    before = children_now()
    engine = subprocess.Popen([sys.executable, "-c", "pass"])
    dog = ProcessWatchdog.start(children_now() - before)
    try:
        engine.wait()
        assert _gone(dog.pid)  # nothing left to guard; the owner lives on
    finally:
        dog.stop()


def test_nothing_to_watch_starts_no_process():
    assert ProcessWatchdog.start([]) is None
