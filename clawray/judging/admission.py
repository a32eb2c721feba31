"""How many turns a VoterPool judges at once, and which waiting turn goes next.

Without a bound, every turn's judge call is sent at once: when turns arrive faster than the
judge answers, calls queue on the judge, time out while still queued, are retried at the back
of the same queue, and the judge spends its time on calls nobody waits for any more (measured
in the live demo: 3,492 of 7,144 calls timed out). ``Admission`` lets ``max_inflight`` turns be
judged at once; the others wait here, so a call's timeout measures the judge's own time. The
backlog is served oldest first (every turn gets its turn) or newest first (under overload the
freshest turns are judged, the ones a staleness-bounded learner can still use), and beyond
``max_backlog`` the oldest waiting turn is shed: it is returned unjudged and counted, never
dropped silently.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Literal


class Admission:
    def __init__(self, max_inflight: int, order: Literal["oldest", "newest"] = "oldest",
                 max_backlog: int | None = None) -> None:
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        if order not in ("oldest", "newest"):
            raise ValueError(f"backlog order must be 'oldest' or 'newest', got {order!r}")
        self.max_inflight, self.order, self.max_backlog = max_inflight, order, max_backlog
        self.running = 0
        self._waiting: collections.deque[asyncio.Future[bool]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self) -> bool:
        """Wait for a slot: True once admitted (call ``release`` after), False if shed."""
        if self.running < self.max_inflight and not self._waiting:
            self.running += 1
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        if self.max_backlog is not None and len(self._waiting) > self.max_backlog:
            self._waiting.popleft().set_result(False)  # the caller counts it as shed
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.result():
                self.release()  # admitted just as it was cancelled: pass the slot on
            elif fut in self._waiting:
                self._waiting.remove(fut)
            raise

    def release(self) -> None:
        """Hand the slot to the next waiting turn (by ``order``), or free it."""
        while self._waiting:
            fut = self._waiting.popleft() if self.order == "oldest" else self._waiting.pop()
            if not fut.done():
                fut.set_result(True)  # the slot passes on: running stays the same
                return
        self.running -= 1
